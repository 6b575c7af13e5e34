"""A loopback NDIF server: run ``model.trace(..., remote=...)`` against tiny local models, offline, on 127.0.0.1.

For tests and notebooks that need the *real* remote path of nnsight 0.8 (client serialization, by-value shipping,
the websocket/HTTP protocol, server-side execution, result download) without the NDIF service or the Hugging Face
hub. The server speaks the protocol of nnsight 0.8.1's ``RemoteBackend`` and runs each request with the official
server's own execution code, in-process, without Ray, Redis or an object store.

Modules: ``server`` (``LoopbackServer``, the server subprocess: the Python API), ``client`` (the offline model key,
local-folder models, ``nnsight_client``), ``protocol`` (what both sides share); in the server process ``__main__``
and ``main`` (the command line), ``app`` (``build_app``), ``handlers`` (the endpoints), ``jobs`` (the served models,
the execution of a request, the stats records).
"""

from .client import free_port, load_tokenizer, nnsight_client, register_model_key, standardized_model
from .protocol import API_KEY_HEADER, result_token
from .server import SERVER_REQUIREMENTS, LoopbackServer, LoopbackServerError

__all__ = [
    "API_KEY_HEADER",
    "SERVER_REQUIREMENTS",
    "LoopbackServer",
    "LoopbackServerError",
    "free_port",
    "load_tokenizer",
    "nnsight_client",
    "register_model_key",
    "result_token",
    "standardized_model",
]
