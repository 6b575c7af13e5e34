"""The loopback NDIF server as a subprocess of the caller: ``LoopbackServer`` starts it, waits for it, stops it.

Python API::

    from dla_recipes.testing.loopback import LoopbackServer

    with LoopbackServer({"tiny-llama": "/path/to/folder"}, api_key="k") as server:  # subprocess; waits until ready
        model = server.remote_model("tiny-llama")  # nnterp StandardizedTransformer(remote=True), weights not loaded
        with server.client():                      # nnsight's CONFIG host + key -> this server, restored on exit
            with model.trace("w1 w2 w3", remote=True):
                logits = model.logits.save()
        server.stats()                             # one dict per request: request_bytes, result_bytes, seconds, ...
    # the server process is stopped by its pid on exit (also at interpreter exit, and it exits if its parent dies)

The server computes single-threaded (``threads=1`` by default); a bit-exact remote == local
comparison needs the local forward single-threaded too (``torch.set_num_threads(1)``), since float reductions
depend on the thread count. ``autocast=True`` runs every request on a bfloat16 / float16 model inside
``torch.autocast("cpu", dtype=<the model's dtype>)``, the bracket NDIF puts around every request on CUDA.

``ndif=True`` runs a request the way NDIF does: every model loaded in bfloat16 whatever the folder's dtype
(NDIF's model actor: ``HuggingFaceModel.from_model_key(..., dtype="bfloat16")``) with sdpa attention, and every
request inside ``torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False)`` (NDIF's ``request_dtype``
bracket, on the CPU where there is no CUDA); ``local_model`` then loads the same bfloat16 sdpa model, and a local
run under ``server.bracket()`` reproduces the server's numbers. The default (float32 folders served as saved, no
bracket) is the fast mode of the tests. ``restart()`` stops the process and starts a fresh one on the same port,
as a redeployed NDIF forgets its queued and finished jobs.
"""

import contextlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

from .client import load_tokenizer, nnsight_client, standardized_model
from .protocol import (
    API_KEY_ENV,
    API_KEY_HEADER,
    DEFAULT_BLOCKED_IMPORTS,
    DEFAULT_INLINE_LIMIT,
    DEFAULT_MAX_REQUEST_BYTES,
    READY_PREFIX,
    SERVER_SCRIPT,
)


@dataclass(frozen=True)
class ServerOptions:
    """A ``LoopbackServer``'s options (see its docstring): each a keyword of ``LoopbackServer(models, api_key,
    **options)``."""

    port: int | None = None
    inline_limit: int = DEFAULT_INLINE_LIMIT
    blocked_imports: tuple[str, ...] = DEFAULT_BLOCKED_IMPORTS
    startup_timeout: float = 180.0
    log_path: str | os.PathLike | None = None
    threads: int = 1
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    autocast: bool = False
    ndif: bool = False
    min_nnsight_version: str | None = None
    forked: bool = False


# What a server process imports (main.py, then jobs.py and handlers.py on the first request), in its order (anyio
# before nnsight: see main.py): a ``forked=True`` server is forked from a zygote that has imported these, never
# dla_recipes or nnterp (the server refuses to import them, as a real NDIF server has neither).
SERVER_PRELOAD = ("anyio._backends._asyncio", "anyio.abc", "torch", "uvicorn", "fastapi", "starlette.background",
                  "pydantic", "httpx", "zstandard", "transformers", "transformers.models.llama.modeling_llama",
                  "nnsight", "nnsight.modeling.transformers", "nnsight.tracing.util", "ndif.common.errors",
                  "ndif.common.schema", "ndif.services.ray.deployments.modeling.nns",
                  "ndif.services.ray.deployments.modeling.util")
_ZYGOTES: dict = {}  # (interpreter, the servers' start_env less their key) -> its zygote


def _zygote(env: dict):
    """The zygote ``forked`` servers started in ``env`` fork from: one per interpreter and environment in this
    process, started on first use, stopped at exit (and it exits with this process: its stdin closes)."""
    import atexit

    from ..zygote import Zygote, start_env

    kept = start_env(env, API_KEY_ENV)  # the key is read when the server parses its arguments, not at import
    key = (sys.executable, tuple(sorted(kept.items())))
    if key not in _ZYGOTES:
        _ZYGOTES[key] = Zygote(sys.executable, kept, SERVER_PRELOAD)
        atexit.register(_ZYGOTES[key].close)
    return _ZYGOTES[key]


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
        autocast: run each request on a half-precision model inside ``torch.autocast("cpu", dtype=<its dtype>,
            cache_enabled=False)``, as NDIF runs every request inside ``torch.autocast("cuda", ...)``
            (``ndif...modeling.nns.request_dtype``, a no-op without CUDA); float32 models are unaffected, as there.
        ndif: serve as NDIF does: bfloat16 models, sdpa attention, the autocast bracket (see the module docstring).
        min_nnsight_version: refuse (400) a client whose nnsight is older, with ndif's own check
            (``ndif.services.api.versioning``, NDIF's ``NDIF_MIN_NNSIGHT_VERSION``).
        forked: fork the server process from a zygote that has imported its stack (``SERVER_PRELOAD``, one per
            client process, ``dla_recipes.testing.zygote``) rather than start a fresh interpreter: about 4 s of CPU
            less a start, for a test suite that starts many; the same server otherwise.
    """

    def __init__(self, models: Mapping[str, str | os.PathLike], api_key: str, **options) -> None:
        """``options``: ``ServerOptions``' fields by name (a name it has not raises ``TypeError``)."""
        given = ServerOptions(**options)
        port, log_path = given.port, given.log_path
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
        self.inline_limit = given.inline_limit
        self.blocked_imports = tuple(given.blocked_imports)
        self.startup_timeout = given.startup_timeout
        self.log_path = Path(log_path) if log_path else None
        self.threads = int(given.threads)
        self.max_request_bytes = int(given.max_request_bytes)
        self.autocast = bool(given.autocast)
        self.ndif = bool(given.ndif)
        self.min_nnsight_version = given.min_nnsight_version
        self.forked = bool(given.forked)
        self._pid_file: Path | None = None  # forked: where the launcher writes the server's own pid
        self.process: subprocess.Popen | None = None
        self.stopped: subprocess.Popen | None = None  # the last process stop() ended
        self._finalizer = None
        self._log_offset = 0

    # -- lifecycle -------------------------------------------------------------------------------------------------

    @property
    def url(self) -> str:
        if self.port is None:
            raise LoopbackServerError("the loopback server is not started")
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        """The server process's pid (after ``stop()``: the stopped one's); ``forked``: the forked server's, not its
        launcher's."""
        process = self.process if self.process is not None else self.stopped
        if process is not None and self._pid_file is not None:
            with contextlib.suppress(OSError, ValueError):
                return int(self._pid_file.read_text())
        return process.pid if process is not None else None

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
        command = [str(SERVER_SCRIPT), "--port", str(self.port or 0)]
        command += ["--inline-limit", str(self.inline_limit), "--blocked-imports", ",".join(self.blocked_imports)]
        command += ["--max-request-bytes", str(self.max_request_bytes)]
        command += ["--autocast"] if self.autocast else []
        command += ["--ndif"] if self.ndif else []
        command += ["--min-nnsight-version", self.min_nnsight_version] if self.min_nnsight_version else []
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
        if self.forked:  # its parent is the zygote, which exits with this process
            zygote = _zygote(env)
            zygote.start()
            self._pid_file = self.log_path.with_suffix(".pid")
            self._pid_file.unlink(missing_ok=True)
            command = zygote.command("safe-script", [*command, "--parent-pid", str(zygote.process.pid)],
                                     str(self._pid_file))
        else:
            command = [sys.executable, "-P", *command, "--parent-pid", str(os.getpid())]
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
            ready = re.search(rf"^{READY_PREFIX} port=(\d+)", self._read_log(), re.MULTILINE)
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
        self.stopped = self.process
        self.process = None

    def restart(self) -> "LoopbackServer":
        """Stop the server and start a fresh process on the same port: every job it held is forgotten."""
        self.stop()
        return self.start()

    def is_running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- queries -----------------------------------------------------------------------------------------------------

    def stats(self) -> list[dict]:
        """Per-request records (oldest first); see ``dla_recipes.testing.loopback.jobs`` for the fields."""
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
        """The same folder as a local ``StandardizedTransformer`` (weights load on first use), for comparisons;
        with ``ndif=True`` loaded as the server loads it (bfloat16, sdpa attention): run it under ``bracket()``."""
        if self.ndif:  # built as the server builds it, then wrapped (nnterp's own bfloat16 load fails on some MoE)
            import torch
            from transformers import AutoModelForCausalLM

            import dla_recipes

            built = AutoModelForCausalLM.from_pretrained(self.folder(name), dtype=torch.bfloat16,
                                                         attn_implementation="sdpa")
            return dla_recipes.load(built, tokenizer=load_tokenizer(self.folder(name)), **kwargs)
        return standardized_model(self.folder(name), remote=False, **kwargs)

    def bracket(self) -> contextlib.AbstractContextManager:
        """The autocast region the server runs each request inside (``ndif=True``; ``autocast=True`` on bfloat16
        models), for a local run to reproduce it: ``torch.autocast("cpu", bfloat16, cache_enabled=False)``."""
        import torch

        if self.ndif or self.autocast:
            return torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False)
        return contextlib.nullcontext()

    def client(self, api_key: str | None = ...) -> contextlib.AbstractContextManager:
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
