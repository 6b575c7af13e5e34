"""Server side of the loopback NDIF server: the served models, the jobs, and their execution with NDIF's own code.

Each request runs with the official server's execution code (``ndif.services.ray.deployments.modeling.nns``:
``prepare_traced_block`` / ``execute_traced_block`` / ``block_scope``, ``BackendRequestModel.deserialize`` for error
classification and ``cpu_pickle_module`` + zstd for the result), called in-process, without Ray, Redis or an object
store. Runs in the server process; imports nothing from ``dla_recipes``.

Each record: ``id, model, model_key, status`` (COMPLETED, ERROR, or REJECTED for a request refused at POST),
``http_status``, ``request_bytes`` (the payload the client sent), ``result_bytes`` (the exact bytes of the serialized
result the client receives and decompresses: the downloaded body, or the blob inside the inline frame),
``transport`` (inline / download), ``wire_bytes`` (the websocket frame or HTTP body actually sent), ``seconds``
(round trip: from the client's send stamp, the ``ndif-timestamp`` header, to the result handed over; one clock,
since client and server share the machine), ``exec_seconds`` (deserialize + run + serialize), ``error``.
"""

import asyncio
import contextlib
import gc
import io
import json
import time
import traceback
from typing import Any

from .protocol import DEFAULT_MAX_REQUEST_BYTES, MAX_RECORDS


class BlockedImports:
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


class ServedModel:
    """One allow-listed folder, loaded the way the official model actor loads a deployment."""

    KEY_CLASSES = ("nnsight.modeling.transformers.TransformersModel", "nnsight.modeling.language.LanguageModel")

    def __init__(self, name: str, folder: str, autocast: bool = False, ndif: bool = False) -> None:
        import torch
        from nnsight.modeling.transformers import TransformersModel
        from transformers import AutoTokenizer

        self.name, self.folder = name, folder
        # ndif: as NDIF's model actor loads a deployment (``HuggingFaceModel.from_model_key(..., dtype="bfloat16")``,
        # its default dtype; transformers' default attention, sdpa), whatever dtype the folder was saved in
        loading = {"dtype": "bfloat16", "attn_implementation": "sdpa"} if ndif else {}
        self.model = TransformersModel(
            folder, task="text-generation", tokenizer=AutoTokenizer.from_pretrained(folder), dispatch=True,
            device_map="auto", **loading,
        )
        self.model._module.requires_grad_(False)
        self.dtype = next(self.model._module.parameters()).dtype
        # NDIF's bracket (request_dtype) autocasts half-precision models only; here on the CPU, where NDIF's is a no-op
        self.autocast = (autocast or ndif) and self.dtype in (torch.float16, torch.bfloat16)
        self.attention = getattr(self.model._module.config, "_attn_implementation", None)
        self.model_key = f"{self.KEY_CLASSES[0]}:" + json.dumps(
            {"repo_id": name, "revision": None, "task": "text-generation"}
        )


def parse_model_key(model_key: str) -> tuple[str, dict]:
    import_path, _, suffix = model_key.partition(":")
    try:
        data = json.loads(suffix)
    except ValueError:
        data = None
    if not isinstance(data, dict):
        raise ValueError(f"malformed model key {model_key!r}")  # noqa: TRY004 (a bad value from the client)
    return import_path, data


def make_record(**fields: Any) -> dict:
    """One stats record: every field present, None when not applicable."""
    record = dict.fromkeys(
        ("id", "model", "model_key", "session_id", "status", "http_status", "request_bytes", "result_bytes",
         "wire_bytes", "transport", "compressed", "seconds", "exec_seconds", "error")
    )
    record.update(fields)
    return record


class Job:
    def __init__(self, request: Any, served: ServedModel, sent_at: float | None) -> None:
        self.request = request
        self.served = served
        self.received_at = time.time()
        self.started_at = sent_at if sent_at is not None and sent_at <= self.received_at else self.received_at
        self.record = make_record(
            id=request.id, model=served.name, model_key=request.model_key, session_id=request.session_id or None,
            status="RECEIVED", http_status=200, request_bytes=len(request.payload), compressed=request.compress,
        )

    def finish(self, **fields: Any) -> None:
        self.record.update(fields)
        self.record["seconds"] = round(time.time() - self.started_at, 6)


class State:
    def __init__(self, served: dict[str, ServedModel], api_key: str, inline_limit: int, port: int,
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
        self.results: dict[str, tuple[bytes, Job]] = {}  # id -> (blob, job) awaiting download
        self.run_lock: asyncio.Lock | None = None
        self.env: dict | None = None
        self.min_nnsight_version: str | None = None  # NDIF_MIN_NNSIGHT_VERSION: older clients are refused (400)

    def remember(self, record: dict) -> None:
        self.records.append(record)
        del self.records[:-MAX_RECORDS]


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


def execute(job: Job) -> bytes:
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
            bracket = (torch.autocast("cpu", dtype=job.served.dtype, cache_enabled=False) if job.served.autocast
                       else contextlib.nullcontext())
            with bracket:
                saved = execute_traced_block(tracer, job.served.dtype)
            buffer = io.BytesIO()
            torch.save(saved, buffer, pickle_module=cpu_pickle_module())
            data = buffer.getvalue()
            if request.compress:
                data = zstandard.ZstdCompressor(level=3).compress(data)
            return data
        except Exception as exception:
            # Formatted here, inside block_scope, while linecache still holds the client's source lines.
            raise JobFailed(_format_error(exception)) from exception
        finally:
            model.interleaver.cancel()
            gc.collect()


class JobFailed(Exception):
    pass
