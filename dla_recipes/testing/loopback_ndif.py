"""A loopback NDIF server: run ``model.trace(..., remote=...)`` against tiny local models, offline, on 127.0.0.1.

For tests and notebooks that need the *real* remote path of nnsight 0.8 (client serialization, by-value shipping,
the websocket/HTTP protocol, server-side execution, result download) without the NDIF service or the Hugging Face
hub. The server speaks the protocol of nnsight 0.8.1's ``RemoteBackend`` and runs each request with the official
server's own execution code (``ndif.services.ray.deployments.modeling.nns``: ``prepare_traced_block`` /
``execute_traced_block`` / ``block_scope``, ``BackendRequestModel.deserialize`` for error classification and
``cpu_pickle_module`` + zstd for the result), called in-process, without Ray, Redis or an object store.

Python API::

    from dla_recipes.testing.loopback_ndif import LoopbackServer

    with LoopbackServer({"tiny-llama": "/path/to/folder"}, api_key="k") as server:  # subprocess; waits until ready
        model = server.remote_model("tiny-llama")  # nnterp StandardizedTransformer(remote=True), weights not loaded
        with server.client():                      # nnsight's CONFIG host + key -> this server, restored on exit
            with model.trace("w1 w2 w3", remote=True):
                logits = model.logits.save()
        server.stats()                             # one dict per request: request_bytes, result_bytes, seconds, ...
    # the server process is stopped by its pid on exit (also at interpreter exit, and it exits if its parent dies)

The server computes single-threaded (``threads=1`` by default); a bit-exact remote == local
comparison needs the local forward single-threaded too (``torch.set_num_threads(1)``), since float reductions
depend on the thread count.

Command line (same server, foreground)::

    python -m dla_recipes.testing.loopback_ndif --port 8123 --api-key K --model tiny-llama=/path/to/folder ...

Endpoints (those nnsight 0.8.1's client calls, plus two for tests):

- ``WS  /subscribe``      sends ``{"session_id": ...}``, then every status of that session's requests: JSON text frames,
                          and on COMPLETED either a binary frame (``ResponseModel.pickle()`` carrying the result blob,
                          when it is at most ``inline_limit`` bytes, as NDIF does under its Redis publish limit) or a
                          JSON frame whose ``data`` is a one-shot download URL.
- ``POST /request``       multipart ``data`` (the ``RequestModel`` JSON) + ``blob`` (the serialized trace); header
                          ``ndif-api-key``. 401 missing key, 403 wrong key, 404 model not hosted, 413 request larger
                          than ``max_request_bytes``, 422 bad envelope, else the RECEIVED response. The client shows
                          the ``detail`` as ``RemoteError``. The server mints the request id (a client-sent ``id`` is
                          ignored) and never trusts the client's ``trusted`` / ``api_key`` fields.
- ``GET /result/{id}``    the result blob (zstd-compressed ``torch.save`` bytes), once; what the client downloads.
                          The COMPLETED message hands out a presigned URL (``?token=`` an HMAC of the id under the
                          key, as NDIF's object-store URLs are presigned): without that token or the key header, 401.
- ``GET /response/{id}``  latest status of a non-blocking request (``trace(..., blocking=False)``).
- ``GET /status``, ``GET /env``, ``GET /connected``, ``GET /whoami``: as NDIF (``nnsight.status()``,
                          ``nnsight.compare()``), but key required; ``/status`` names models, never folders.
- ``GET /ping``           liveness, the one endpoint without a key (it answers ``pong`` and nothing else).
- ``GET /stats``          per-request records; ``DELETE /stats`` clears them.
- ``POST /faults``        (tests) ``{"unavailable": n}``: the next ``n`` ``POST /request`` answer 503 Service
                          Unavailable, as a restarting deployment does, to exercise the client's retries.

Every endpoint but ``/ping`` requires the key (header ``ndif-api-key``; for ``/result`` the presigned token will do).

Each record: ``id, model, model_key, status`` (COMPLETED, ERROR, or REJECTED for a request refused at POST),
``http_status``, ``request_bytes`` (the payload the client sent), ``result_bytes`` (the exact bytes of the serialized
result the client receives and decompresses: the downloaded body, or the blob inside the inline frame),
``transport`` (inline / download), ``wire_bytes`` (the websocket frame or HTTP body actually sent), ``seconds``
(round trip: from the client's send stamp, the ``ndif-timestamp`` header, to the result handed over; one clock,
since client and server share the machine), ``exec_seconds`` (deserialize + run + serialize), ``error``.

The model-key workaround
------------------------
A remote trace names its model by ``model.to_model_key()``, ``"nnsight.modeling.transformers.TransformersModel:
{"repo_id": ..., "revision": null, "task": "text-generation"}"`` (nnterp's ``StandardizedTransformer`` and
``LanguageModel`` both key as ``TransformersModel``). To build it, nnsight's ``HuggingFaceModel._remoteable_model_key``
canonicalizes ``repo_id`` with ``HfApi().model_info(repo_id)``, memoized in ``nnsight.modeling.huggingface._ID_CACHE``
(user spelling -> canonical id). A local folder is not a hub id, so offline that lookup raises. The server hosts each
folder under a *name*, and :func:`register_model_key` seeds that cache entry, ``folder -> name`` (for the spellings of
the folder path), which is exactly what the lookup would have stored: the key then reads ``"repo_id": "<name>"``, no
hub call is made, and everything else about the model is untouched, so ``remote=True`` / ``remote=url`` /
``backend=`` all work. The server resolves the name through its allow-list (any other name: 404) and serves that
folder as the key's wrapper, ``TransformersModel(folder, task="text-generation", dispatch=True)``, loaded at startup.
``LoopbackServer.remote_model`` does the client half.
``_ID_CACHE`` is nnsight-private; :func:`register_model_key` fails loudly if a future nnsight drops it.

Faithfulness: the server process does not import ``dla_recipes`` or ``nnterp`` and refuses to import them (a real NDIF
server has neither the project nor, necessarily, nnterp), so a trace that leans on an installed package which was not
``nnsight.register``-ed for by-value shipping fails here as it would on NDIF. ``python -m`` re-executes the file by
path for that reason. Security: binds 127.0.0.1 only, requires the API key on ``POST /request`` and ``/stats``, and
loads only the allow-listed folders; it still runs client-sent code, so never expose it.
"""

import argparse
import asyncio
import contextlib
import gc
import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import uuid
import weakref
from pathlib import Path
from typing import Any, Iterator, Mapping, Optional

API_KEY_HEADER = "ndif-api-key"
API_KEY_ENV = "LOOPBACK_NDIF_API_KEY"  # how the Python API hands the key to the server (not on the command line)
DEFAULT_INLINE_LIMIT = 8 * 1024 * 1024  # NDIF's stock Redis pubsub soft limit: larger results go through a download
DEFAULT_MAX_REQUEST_BYTES = 32 * 1024 * 1024  # a DLA request is 30-50 KB; anything near this is not one
DEFAULT_BLOCKED_IMPORTS = ("dla_recipes", "nnterp")
_READY_PREFIX = "LOOPBACK_NDIF_READY"
_MAX_RECORDS = 10_000

# --------------------------------------------------------------------------------------------------------------------
# client side
# --------------------------------------------------------------------------------------------------------------------


def _folder_spellings(folder: str | os.PathLike) -> set[str]:
    path = Path(folder).expanduser()
    return {os.fspath(folder), str(path), str(path.absolute()), str(path.resolve())}


def register_model_key(folder: str | os.PathLike, name: str) -> None:
    """Make a model built from local ``folder`` carry the remote key ``{"repo_id": name, ...}``, with no hub lookup.

    Seeds nnsight's repo-id canonicalization cache (see the module docstring). Idempotent; per process.
    """
    from nnsight.modeling import huggingface

    cache = getattr(huggingface, "_ID_CACHE", None)
    if not isinstance(cache, dict):
        raise RuntimeError(
            "nnsight.modeling.huggingface._ID_CACHE is gone (nnsight changed): the loopback model-key workaround "
            "needs a new hook; see dla_recipes.testing.loopback_ndif's docstring."
        )
    for spelling in _folder_spellings(folder):
        cache[spelling] = name


def load_tokenizer(folder: str | os.PathLike):
    """The tokenizer saved in ``folder`` (nnsight 0.8 wants it passed explicitly for a local folder)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(os.fspath(folder))


def standardized_model(folder: str | os.PathLike, *, remote: bool = False, name: Optional[str] = None, **kwargs: Any):
    """A ``StandardizedTransformer`` for a local folder (``dla_recipes.load``), with the folder's tokenizer.

    ``remote=True``: meta weights only (nothing loaded locally) and nnterp registered for by-value shipping; pass
    ``name`` (the server's name for the folder) so the model key resolves offline. ``remote=False``: a local model
    whose weights load on first use, for comparing against a remote run.
    """
    import dla_recipes

    if name is not None:
        register_model_key(folder, name)
    kwargs.setdefault("tokenizer", load_tokenizer(folder))
    return dla_recipes.load(str(Path(folder).expanduser().absolute()), remote=remote, **kwargs)


@contextlib.contextmanager
def nnsight_client(host: str, api_key: Optional[str]) -> Iterator[None]:
    """Point nnsight's client at ``host`` with ``api_key`` (None or "" sends no key) and restore the config after.

    nnsight reads ``CONFIG.API.HOST`` / ``CONFIG.API.APIKEY`` when a remote trace starts (``NDIF_HOST`` /
    ``NDIF_API_KEY`` only seed them at import), so this is how to aim ``remote=True`` at a loopback server.
    """
    from nnsight import CONFIG

    saved = (CONFIG.API.HOST, CONFIG.API.APIKEY)
    CONFIG.API.HOST, CONFIG.API.APIKEY = host, api_key
    try:
        yield
    finally:
        CONFIG.API.HOST, CONFIG.API.APIKEY = saved


def free_port() -> int:
    """A 127.0.0.1 port nothing listens on at this moment (e.g. to test an unreachable server)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class LoopbackServerError(RuntimeError):
    """The loopback server failed to start, or died."""


class LoopbackServer:
    """A loopback NDIF server in a subprocess (its own session), stopped by its pid.

    Args:
        models: served name -> local model folder (the allow-list; nothing else is loaded).
        api_key: the key the server requires (``ndif-api-key`` header).
        port: fixed port, or None for a free one (chosen by the server, read back from its ready line).
        inline_limit: results up to this many bytes ride on the websocket, larger ones are downloaded.
        blocked_imports: top-level packages the server refuses to import (default: ``dla_recipes``, ``nnterp``).
        startup_timeout: seconds to wait for the models to load and the port to answer.
        log_path: where the server's stdout/stderr go (default: a temporary file, kept for post-mortems).
        threads: torch threads the server computes with (default 1, whatever ``OMP_NUM_THREADS`` the client has,
            so a single-threaded local run reproduces its numbers bit for bit).
        max_request_bytes: the largest request body accepted (413 above it).
    """

    def __init__(
        self,
        models: Mapping[str, str | os.PathLike],
        api_key: str,
        *,
        port: Optional[int] = None,
        inline_limit: int = DEFAULT_INLINE_LIMIT,
        blocked_imports: tuple[str, ...] = DEFAULT_BLOCKED_IMPORTS,
        startup_timeout: float = 180.0,
        log_path: Optional[str | os.PathLike] = None,
        threads: int = 1,
        max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    ) -> None:
        if not models:
            raise ValueError("LoopbackServer needs at least one model: {name: folder}.")
        if not api_key:
            raise ValueError("LoopbackServer needs a non-empty api_key.")
        self.models = {name: str(Path(folder).expanduser().resolve()) for name, folder in models.items()}
        for name, folder in self.models.items():
            if not Path(folder, "config.json").is_file():
                raise ValueError(f"model {name!r}: {folder} has no config.json")
        self.api_key = api_key
        self.port = port
        self.inline_limit = inline_limit
        self.blocked_imports = tuple(blocked_imports)
        self.startup_timeout = startup_timeout
        self.log_path = Path(log_path) if log_path else None
        self.threads = int(threads)
        self.max_request_bytes = int(max_request_bytes)
        self.process: Optional[subprocess.Popen] = None
        self._finalizer = None
        self._log_offset = 0

    # -- lifecycle -------------------------------------------------------------------------------------------------

    @property
    def url(self) -> str:
        if self.port is None:
            raise LoopbackServerError("the loopback server is not started")
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> Optional[int]:
        return self.process.pid if self.process is not None else None

    def start(self) -> "LoopbackServer":
        if self.process is not None:
            return self
        _check_server_dependencies()
        if self.log_path is None:
            handle, name = tempfile.mkstemp(prefix="loopback_ndif_", suffix=".log")
            os.close(handle)
            self.log_path = Path(name)
        self._log_offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        # Port 0: the server binds a free port itself and announces it (no window for another process to take it).
        command = [sys.executable, "-P", str(Path(__file__).resolve()), "--port", str(self.port or 0)]
        command += ["--inline-limit", str(self.inline_limit), "--blocked-imports", ",".join(self.blocked_imports)]
        command += ["--parent-pid", str(os.getpid()), "--max-request-bytes", str(self.max_request_bytes)]
        for name, folder in self.models.items():
            command += ["--model", f"{name}={folder}"]
        env = dict(os.environ)
        env.update(
            {
                API_KEY_ENV: self.api_key,
                "OMP_NUM_THREADS": str(self.threads),
                "MKL_NUM_THREADS": str(self.threads),
                "TOKENIZERS_PARALLELISM": "false",
                "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1",
                "PYTHONUNBUFFERED": "1",
            }
        )
        env.pop("NDIF_API_KEY", None)
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
                start_new_session=True, close_fds=True,
            )
        # Stops the process even if the caller never calls stop() (garbage collection or interpreter exit).
        self._finalizer = weakref.finalize(self, _stop_process, self.process)
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self) -> None:
        import httpx

        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise LoopbackServerError(
                    f"the loopback NDIF server exited with code {self.process.returncode} during startup:\n"
                    f"{self.log_tail()}"
                )
            ready = re.search(rf"^{_READY_PREFIX} port=(\d+)", self._read_log(), re.MULTILINE)
            if ready:
                self.port = int(ready.group(1))
                try:
                    if httpx.get(f"{self.url}/ping", timeout=2.0).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
            time.sleep(0.1)
        raise LoopbackServerError(
            f"the loopback NDIF server did not become ready in {self.startup_timeout}s:\n{self.log_tail()}"
        )

    def _read_log(self) -> str:
        """This run's part of the log."""
        try:
            with open(self.log_path, "rb") as log:
                log.seek(self._log_offset)
                return log.read().decode(errors="replace")
        except OSError:
            return ""

    def log_tail(self, lines: int = 40) -> str:
        """The last lines of the server's log."""
        return "\n".join(self._read_log().splitlines()[-lines:])

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the server process (SIGTERM to its pid, SIGKILL after ``timeout``). Idempotent."""
        if self.process is None:
            return
        _stop_process(self.process, timeout)
        if self._finalizer is not None:
            self._finalizer.detach()

    def is_running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def __enter__(self) -> "LoopbackServer":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # -- queries -----------------------------------------------------------------------------------------------------

    def stats(self) -> list[dict]:
        """Per-request records (oldest first); see the module docstring for the fields."""
        import httpx

        response = httpx.get(f"{self.url}/stats", headers={API_KEY_HEADER: self.api_key}, timeout=10.0)
        response.raise_for_status()
        return response.json()["requests"]

    def clear_stats(self) -> None:
        import httpx

        httpx.delete(f"{self.url}/stats", headers={API_KEY_HEADER: self.api_key}, timeout=10.0).raise_for_status()

    def make_unavailable(self, requests: int) -> None:
        """Answer the next ``requests`` ``POST /request`` with 503 Service Unavailable (a test fault)."""
        import httpx

        httpx.post(f"{self.url}/faults", json={"unavailable": int(requests)},
                   headers={API_KEY_HEADER: self.api_key}, timeout=10.0).raise_for_status()

    # -- client helpers ----------------------------------------------------------------------------------------------

    def folder(self, name: str) -> str:
        if name not in self.models:
            raise KeyError(f"{name!r} is not served here; served: {sorted(self.models)}")
        return self.models[name]

    def remote_model(self, name: str, **kwargs: Any):
        """A ``StandardizedTransformer(remote=True)`` whose model key names ``name`` on this server (no weights loaded).

        Trace it with ``remote=True`` inside ``server.client()``, or with ``remote=server.url`` when nnsight's
        configured key (``NDIF_API_KEY`` / ``CONFIG.API.APIKEY``) is this server's.
        """
        return standardized_model(self.folder(name), remote=True, name=name, **kwargs)

    def local_model(self, name: str, **kwargs: Any):
        """The same folder as a local ``StandardizedTransformer`` (weights load on first use), for comparisons."""
        return standardized_model(self.folder(name), remote=False, **kwargs)

    def client(self, api_key: Optional[str] = ...) -> contextlib.AbstractContextManager:
        """Context manager aiming nnsight's ``remote=True`` at this server (optionally with another ``api_key``)."""
        return nnsight_client(self.url, self.api_key if api_key is ... else api_key)


SERVER_REQUIREMENTS = {  # import name -> what to install (see the project's install step)
    "ndif": "ndif==0.1.2 (pip install --no-deps --ignore-requires-python ndif==0.1.2)",
    "fastapi": "fastapi==0.141.1",
    "starlette": "starlette==1.10.0",
    "uvicorn": "uvicorn==0.54.0",
    "multipart": "python-multipart==0.0.34",
    "websockets": "websockets==17.4",
}


def _check_server_dependencies() -> None:
    import importlib.util

    missing = [spec for name, spec in SERVER_REQUIREMENTS.items() if importlib.util.find_spec(name) is None]
    if missing:
        raise LoopbackServerError(
            "the loopback NDIF server needs packages that are not installed: " + "; ".join(missing)
        )


def _stop_process(process: subprocess.Popen, timeout: float = 10.0) -> None:
    if process.poll() is not None:
        return
    try:
        os.kill(process.pid, signal.SIGTERM)
        process.wait(timeout)
    except subprocess.TimeoutExpired:
        os.kill(process.pid, signal.SIGKILL)
        process.wait(timeout)
    except ProcessLookupError:
        pass


# --------------------------------------------------------------------------------------------------------------------
# server side (runs in the subprocess; imports nothing from dla_recipes)
# --------------------------------------------------------------------------------------------------------------------


class _BlockedImports:
    """A meta-path finder refusing packages a real NDIF server would not have installed."""

    def __init__(self, names: tuple[str, ...]) -> None:
        self.names = set(names)

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> None:
        if fullname.partition(".")[0] in self.names:
            raise ModuleNotFoundError(
                f"No module named '{fullname}' on the loopback NDIF server (it hides {sorted(self.names)}, which a "
                "real NDIF server does not have). Ship local code by value: nnsight.register(<module>) before the "
                "first remote trace.",
                name=fullname,
            )
        return None


class _ServedModel:
    """One allow-listed folder, loaded the way the official model actor loads a deployment."""

    KEY_CLASSES = ("nnsight.modeling.transformers.TransformersModel", "nnsight.modeling.language.LanguageModel")

    def __init__(self, name: str, folder: str) -> None:
        from nnsight.modeling.transformers import TransformersModel
        from transformers import AutoTokenizer

        self.name, self.folder = name, folder
        self.model = TransformersModel(
            folder, task="text-generation", tokenizer=AutoTokenizer.from_pretrained(folder), dispatch=True,
            device_map="auto",
        )
        self.model._module.requires_grad_(False)
        self.dtype = next(self.model._module.parameters()).dtype
        self.model_key = f"{self.KEY_CLASSES[0]}:" + json.dumps(
            {"repo_id": name, "revision": None, "task": "text-generation"}
        )


def _parse_model_key(model_key: str) -> tuple[str, dict]:
    import_path, _, suffix = model_key.partition(":")
    try:
        data = json.loads(suffix)
    except ValueError:
        data = None
    if not isinstance(data, dict):
        raise ValueError(f"malformed model key {model_key!r}")
    return import_path, data


def _record(**fields: Any) -> dict:
    """One stats record: every field present, None when not applicable."""
    record = dict.fromkeys(
        ("id", "model", "model_key", "session_id", "status", "http_status", "request_bytes", "result_bytes",
         "wire_bytes", "transport", "compressed", "seconds", "exec_seconds", "error")
    )
    record.update(fields)
    return record


class _Job:
    def __init__(self, request: Any, served: _ServedModel, sent_at: Optional[float]) -> None:
        self.request = request
        self.served = served
        self.received_at = time.time()
        self.started_at = sent_at if sent_at is not None and sent_at <= self.received_at else self.received_at
        self.record = _record(
            id=request.id, model=served.name, model_key=request.model_key, session_id=request.session_id or None,
            status="RECEIVED", http_status=200, request_bytes=len(request.payload), compressed=request.compress,
        )

    def finish(self, **fields: Any) -> None:
        self.record.update(fields)
        self.record["seconds"] = round(time.time() - self.started_at, 6)


class _State:
    def __init__(self, served: dict[str, _ServedModel], api_key: str, inline_limit: int, port: int,
                 max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES) -> None:
        self.served = served
        self.max_request_bytes = max_request_bytes
        self.unavailable = 0  # test fault: how many coming POST /request answer 503
        self.api_key = api_key
        self.inline_limit = inline_limit
        self.port = port
        self.records: list[dict] = []
        self.sessions: dict[str, asyncio.Queue] = {}
        self.responses: dict[str, str] = {}  # non-blocking requests: id -> latest ResponseModel JSON
        self.results: dict[str, tuple[bytes, _Job]] = {}  # id -> (blob, job) awaiting download
        self.run_lock: Optional[asyncio.Lock] = None
        self.env: Optional[dict] = None

    def remember(self, record: dict) -> None:
        self.records.append(record)
        del self.records[:-_MAX_RECORDS]


def _format_error(exception: BaseException) -> str:
    """As the official actor's ``format_error``: a rejected request as its sentence, else the user's traceback."""
    from ndif.common.errors import RequestError
    from nnsight.tracing.util import clean_traceback, filter_traceback

    if isinstance(exception, RequestError):
        cause = exception.__cause__
        if isinstance(cause, ModuleNotFoundError):
            # NDIF words this as a possibly corrupted payload; here the cause is known: a module not shipped.
            return f"Your request payload could not be read on the server: {cause}"
        return str(exception)
    tb = clean_traceback(exception.__traceback__)
    tb = filter_traceback(tb, lambda frame: frame.f_code.co_filename != __file__)
    return "".join(traceback.format_exception(type(exception), exception, tb))


def _execute(job: _Job) -> bytes:
    """Worker-thread body, after ``BaseModelDeployment.run`` / ``execute`` / ``prepare_result``: the result blob."""
    import torch
    import zstandard
    from ndif.common.schema.request import BackendRequestModel
    from ndif.services.ray.deployments.modeling.nns import block_scope, execute_traced_block, prepare_traced_block
    from ndif.services.ray.deployments.modeling.util import cpu_pickle_module

    model, request = job.served.model, job.request
    with block_scope():
        try:
            model._remoteable_set_env(request.env)
            tracer, _ = prepare_traced_block(
                model, request.payload, request.compress, deserialize=BackendRequestModel.deserialize
            )
            saved = execute_traced_block(tracer, job.served.dtype)
            buffer = io.BytesIO()
            torch.save(saved, buffer, pickle_module=cpu_pickle_module())
            data = buffer.getvalue()
            if request.compress:
                data = zstandard.ZstdCompressor(level=3).compress(data)
            return data
        except Exception as exception:
            # Formatted here, inside block_scope, while linecache still holds the client's source lines.
            raise _JobFailed(_format_error(exception)) from exception
        finally:
            model.interleaver.cancel()
            gc.collect()


class _JobFailed(Exception):
    pass


def result_token(api_key: str, request_id: str) -> str:
    """The presigned-URL token of a result: an HMAC of the request id under the server's key."""
    import hashlib
    import hmac

    return hmac.new(api_key.encode(), request_id.encode(), hashlib.sha256).hexdigest()


def build_app(served: dict[str, _ServedModel], api_key: str, inline_limit: int, port: int,
              max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES):
    """The FastAPI app (see the module docstring for the endpoints)."""
    from fastapi import FastAPI, HTTPException, Request, Response, WebSocket, WebSocketDisconnect
    from fastapi.responses import JSONResponse
    from ndif.common.schema import BackendRequestModel, BackendResponseModel, Status
    from pydantic import ValidationError
    from starlette.background import BackgroundTask

    state = _State(served, api_key, inline_limit, port, max_request_bytes)
    tasks: set[asyncio.Task] = set()

    @contextlib.asynccontextmanager
    async def lifespan(_app: Any):
        state.run_lock = asyncio.Lock()
        print(f"{_READY_PREFIX} port={state.port} pid={os.getpid()} models={sorted(state.served)}", flush=True)
        yield

    app = FastAPI(title="loopback NDIF", lifespan=lifespan)
    app.state.loopback = state

    def check_key(given: Optional[str]) -> None:
        if not given:
            raise HTTPException(
                401, "Missing API key: this loopback NDIF server requires one. Set NDIF_API_KEY (or nnsight's "
                "CONFIG.API.APIKEY, e.g. with LoopbackServer.client()) to the server's key.",
            )
        import hmac

        if not hmac.compare_digest(given.encode(), state.api_key.encode()):
            raise HTTPException(403, "Invalid API key: the loopback NDIF server does not accept this key.")

    async def bounded_body(http_request: Request) -> None:
        """Read the body, refusing (413) one over the size limit before reading it whole."""
        limit = state.max_request_bytes
        declared = http_request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > limit:
            raise HTTPException(413, f"Request too large: {int(declared):,} bytes, the limit is {limit:,} bytes.")
        chunks, size = [], 0
        async for chunk in http_request.stream():
            size += len(chunk)
            if size > limit:
                raise HTTPException(413, f"Request too large: over {limit:,} bytes, the limit.")
            chunks.append(chunk)
        http_request._body = b"".join(chunks)  # what .form() parses from here on

    def response_json(job: _Job, status: Any, description: str, data: Any = None, meta: Any = None) -> str:
        return BackendResponseModel(id=job.request.id, status=status, description=description, data=data,
                                    meta=meta).model_dump_json()

    async def publish(job: _Job, message: str | bytes) -> bool:
        """Send a status to the job's websocket session, or store it for GET /response; False if nobody listens."""
        session = job.request.session_id
        if not session:
            state.responses[job.request.id] = message if isinstance(message, str) else ""
            return True
        queue = state.sessions.get(session)
        if queue is None:
            return False
        done = asyncio.get_running_loop().create_future()
        await queue.put((message, done))
        try:  # bounded: a session that closes right after this put never answers
            return await asyncio.wait_for(done, timeout=60.0)
        except asyncio.TimeoutError:
            return False

    async def run(job: _Job) -> None:
        await publish(job, response_json(job, Status.QUEUED, "Your job has been queued."))
        async with state.run_lock:
            await publish(job, response_json(job, Status.RUNNING, "Your job has started running."))
            started = time.time()
            try:
                blob = await asyncio.to_thread(_execute, job)
            except _JobFailed as failure:
                exec_seconds = round(time.time() - started, 6)
                await publish(job, response_json(job, Status.ERROR, str(failure), meta={"runtime": exec_seconds}))
                job.finish(status="ERROR", exec_seconds=exec_seconds, error=str(failure).strip().splitlines()[-1])
                return
            except Exception as exception:  # the server's own failure, not the user's
                message = f"Loopback NDIF server error: {type(exception).__name__}: {exception}"
                await publish(job, response_json(job, Status.ERROR, message))
                job.finish(status="ERROR", error=message)
                return
        exec_seconds = round(time.time() - started, 6)
        job.record.update(exec_seconds=exec_seconds, result_bytes=len(blob))
        meta = {"runtime": exec_seconds}
        if job.request.session_id and len(blob) <= state.inline_limit:
            frame = BackendResponseModel(id=job.request.id, status=Status.COMPLETED,
                                         description="Your job has been completed.", data=blob, meta=meta).pickle()
            delivered = await publish(job, frame)
            job.finish(status="COMPLETED" if delivered else "UNDELIVERED", transport="inline", wire_bytes=len(frame))
        else:
            state.results[job.request.id] = (blob, job)
            token = result_token(state.api_key, job.request.id)
            url = f"http://127.0.0.1:{state.port}/result/{job.request.id}?token={token}"
            await publish(job, response_json(job, Status.COMPLETED, "Your job has been completed.", url, meta))
            # finished when downloaded (GET /result)

    @app.websocket("/subscribe")
    async def subscribe(websocket: WebSocket) -> None:
        await websocket.accept()
        session = uuid.uuid4().hex
        queue: asyncio.Queue = asyncio.Queue()
        state.sessions[session] = queue
        try:
            await websocket.send_json({"session_id": session})
            disconnect = asyncio.ensure_future(websocket.receive())
            while True:
                getter = asyncio.ensure_future(queue.get())
                done, _ = await asyncio.wait({getter, disconnect}, return_when=asyncio.FIRST_COMPLETED)
                if getter not in done:
                    getter.cancel()
                    return
                message, future = getter.result()
                try:
                    if isinstance(message, bytes):
                        await websocket.send_bytes(message)
                    else:
                        await websocket.send_text(message)
                    future.set_result(True)
                except Exception:
                    future.set_result(False)
                    return
        except WebSocketDisconnect:
            return
        finally:
            state.sessions.pop(session, None)
            while not queue.empty():
                _, future = queue.get_nowait()
                if not future.done():
                    future.set_result(False)

    @app.post("/request")
    async def create_request(http_request: Request) -> Response:
        given = http_request.headers.get(API_KEY_HEADER)
        request = None
        try:
            check_key(given)
            if state.unavailable > 0:
                state.unavailable -= 1
                raise HTTPException(503, "Service Unavailable: the deployment is restarting (a loopback test fault).")
            await bounded_body(http_request)
            form = await http_request.form()
            try:
                request = BackendRequestModel.model_validate_json(form.get("data") or "")
            except ValidationError as error:
                raise HTTPException(422, f"Malformed request envelope: {error}") from error
            # Server-side fields are the server's: a fresh id (a client cannot pick or collide with one), never
            # trusted, and the key it was checked with.
            request.id = uuid.uuid4().hex
            request.trusted = False
            blob = form.get("blob")
            if blob is None or isinstance(blob, str):
                raise HTTPException(422, "Malformed request: no 'blob' file part.")
            request.payload = await blob.read()
            request.api_key = given
            job = _Job(request, _resolve(request.model_key), _float(http_request.headers.get("ndif-timestamp")))
        except HTTPException as error:
            state.remember(_record(
                id=getattr(request, "id", None), model_key=getattr(request, "model_key", None), status="REJECTED",
                http_status=error.status_code, error=error.detail,
                request_bytes=len(request.payload) if getattr(request, "payload", None) is not None else None,
            ))
            return JSONResponse({"detail": error.detail}, status_code=error.status_code)
        state.remember(job.record)
        body = response_json(job, Status.RECEIVED, "Your job has been received and is waiting to be queued.")
        if not request.session_id:
            state.responses[request.id] = body
        task = asyncio.get_running_loop().create_task(run(job))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        return Response(body, media_type="application/json")

    def _resolve(model_key: str) -> _ServedModel:
        try:
            import_path, data = _parse_model_key(model_key)
        except ValueError as error:
            raise HTTPException(422, str(error)) from error
        name = data.get("repo_id")
        model = state.served.get(name)
        if model is None:
            raise HTTPException(
                404, f"Model {name!r} is not hosted by this loopback NDIF server (it serves: "
                f"{', '.join(sorted(state.served))}). Model key: {model_key}",
            )
        wrong = []
        if import_path not in _ServedModel.KEY_CLASSES:
            wrong.append(f"wrapper class {import_path}")
        if data.get("task", "text-generation") != "text-generation":
            wrong.append(f"task {data.get('task')!r}")
        if data.get("revision") not in (None, "main"):
            wrong.append(f"revision {data.get('revision')!r}")
        if wrong:
            raise HTTPException(
                400, f"Model {name!r} is served only as {model.model_key}; this request asks for " + ", ".join(wrong)
            )
        return model

    @app.get("/result/{request_id}")
    async def get_result(request_id: str, http_request: Request, token: Optional[str] = None) -> Response:
        import hmac

        if token is None or not hmac.compare_digest(token, result_token(state.api_key, request_id)):
            check_key(http_request.headers.get(API_KEY_HEADER))
        entry = state.results.pop(request_id, None)
        if entry is None:
            raise HTTPException(404, f"No result for request {request_id} (unknown, or already downloaded).")
        blob, job = entry

        async def delivered() -> None:
            job.finish(status="COMPLETED", transport="download", wire_bytes=len(blob))

        return Response(blob, media_type="application/octet-stream", background=BackgroundTask(delivered))

    @app.get("/response/{request_id}")
    async def get_response(request_id: str, http_request: Request) -> Response:
        check_key(http_request.headers.get(API_KEY_HEADER))
        body = state.responses.get(request_id)
        if body is None:
            raise HTTPException(404, f"No response for request {request_id}.")
        return Response(body, media_type="application/json")

    @app.get("/stats")
    async def get_stats(http_request: Request) -> dict:
        check_key(http_request.headers.get(API_KEY_HEADER))
        return {"requests": state.records}

    @app.delete("/stats")
    async def clear_stats(http_request: Request) -> dict:
        check_key(http_request.headers.get(API_KEY_HEADER))
        state.records.clear()
        return {"cleared": True}

    @app.post("/faults")
    async def set_faults(http_request: Request) -> dict:
        check_key(http_request.headers.get(API_KEY_HEADER))
        state.unavailable = max(0, int((await http_request.json()).get("unavailable", 0)))
        return {"unavailable": state.unavailable}

    @app.get("/status")
    async def get_status(http_request: Request) -> dict:
        check_key(http_request.headers.get(API_KEY_HEADER))
        deployments = {
            model.model_key: {
                "model_key": model.model_key, "repo_id": name, "revision": "main", "task": "text-generation",
                "deployment_level": "HOT", "application_state": "RUNNING",
            }
            for name, model in state.served.items()
        }
        return {"deployments": deployments}

    @app.get("/env")
    async def get_env(http_request: Request) -> dict:
        check_key(http_request.headers.get(API_KEY_HEADER))
        if state.env is None:
            from nnsight.ndif import get_local_env

            state.env = await asyncio.to_thread(get_local_env)
        return state.env

    @app.get("/ping")
    async def ping() -> str:
        return "pong"

    @app.api_route("/connected", methods=["GET", "HEAD"])
    async def connected(http_request: Request) -> dict:
        check_key(http_request.headers.get(API_KEY_HEADER))
        return {"status": "connected"}

    @app.get("/whoami")
    async def whoami(http_request: Request) -> dict:
        check_key(http_request.headers.get(API_KEY_HEADER))
        return {"email": "loopback@127.0.0.1", "tags": []}

    return app


def _float(value: Optional[str]) -> Optional[float]:
    try:
        return float(value) if value else None
    except ValueError:
        return None


def _parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m dla_recipes.testing.loopback_ndif",
        description="Loopback NDIF server (127.0.0.1 only) serving local model folders to nnsight's remote client.",
    )
    parser.add_argument("--port", type=int, required=True, help="port on 127.0.0.1 (0: any free port)")
    parser.add_argument("--api-key", default=None, help=f"required API key (default: ${API_KEY_ENV})")
    parser.add_argument("--model", action="append", default=[], metavar="NAME=FOLDER", help="serve FOLDER as NAME")
    parser.add_argument("--inline-limit", type=int, default=DEFAULT_INLINE_LIMIT,
                        help="results up to this many bytes go back on the websocket, larger ones by download")
    parser.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES,
                        help="refuse (413) a request body larger than this")
    parser.add_argument("--parent-pid", type=int, default=None,
                        help="exit when this process is gone (LoopbackServer passes its own pid)")
    parser.add_argument("--blocked-imports", default=",".join(DEFAULT_BLOCKED_IMPORTS),
                        help="comma-separated packages the server refuses to import ('' for none)")
    args = parser.parse_args(argv)
    args.api_key = args.api_key or os.environ.get(API_KEY_ENV)
    if not args.api_key:
        parser.error(f"an API key is required: --api-key or ${API_KEY_ENV}")
    models = {}
    for spec in args.model:
        name, sep, folder = spec.partition("=")
        if not sep or not name or not folder:
            parser.error(f"--model expects NAME=FOLDER, got {spec!r}")
        if not Path(folder, "config.json").is_file():
            parser.error(f"--model {name}: {folder} has no config.json")
        models[name] = str(Path(folder).resolve())
    if not models:
        parser.error("serve at least one --model NAME=FOLDER")
    args.models = models
    return args


def _exit_with_parent(parent_pid: int) -> None:
    """SIGTERM this server once ``parent_pid`` is gone, so a killed test run leaves no server behind."""
    import threading

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="loopback-ndif-parent-watch", daemon=True).start()


def main(argv: Optional[list[str]] = None) -> None:
    args = _parse_args(argv)
    if "dla_recipes" in sys.modules and "dla_recipes" in args.blocked_imports.split(","):
        # Run as `python -m dla_recipes...`: the package (and its client-side shim) is already imported, so start
        # over from the file itself, where nothing of the project is imported (see the module docstring).
        os.execv(sys.executable, [sys.executable, "-P", str(Path(__file__).resolve()), *(argv or sys.argv[1:])])
    blocked = tuple(name for name in args.blocked_imports.split(",") if name)
    if blocked:
        sys.meta_path.insert(0, _BlockedImports(blocked))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

    # Before nnsight: it mounts `.save` on every object (CONFIG.APP.PYMOUNT, which client code run here relies on),
    # after which anyio refuses to define its typed-attribute classes ("Attribute 'save' is missing its type
    # annotation") if they are first imported later, e.g. by Starlette's thread pool.
    import anyio._backends._asyncio  # noqa: F401
    import anyio.abc  # noqa: F401
    import uvicorn
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    if args.parent_pid:
        _exit_with_parent(args.parent_pid)
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", args.port))  # loopback only, never 0.0.0.0
    port = listener.getsockname()[1]
    served = {name: _ServedModel(name, folder) for name, folder in args.models.items()}
    for model in served.values():
        print(f"serving {model.name} as {model.model_key}", flush=True)
    app = build_app(served, args.api_key, args.inline_limit, port, args.max_request_bytes)
    config = uvicorn.Config(
        app, log_level="warning", ws="websockets-sansio", timeout_graceful_shutdown=2, lifespan="on"
    )
    uvicorn.Server(config).run(sockets=[listener])


if __name__ == "__main__":
    main()
