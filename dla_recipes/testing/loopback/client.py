"""Client-side helpers of the loopback NDIF server: the offline model key, local-folder models, nnsight's host.

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
"""

import contextlib
import os
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any


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
        raise RuntimeError(  # noqa: TRY004 (nnsight changed: not the caller's type error)
            "nnsight.modeling.huggingface._ID_CACHE is gone (nnsight changed): the loopback model-key workaround "
            "needs a new hook; see dla_recipes.testing.loopback.client's docstring."
        )
    for spelling in _folder_spellings(folder):
        cache[spelling] = name


def load_tokenizer(folder: str | os.PathLike):
    """The tokenizer saved in ``folder`` (nnsight 0.8 wants it passed explicitly for a local folder)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(os.fspath(folder))


def standardized_model(folder: str | os.PathLike, *, remote: bool = False, name: str | None = None, **kwargs: Any):
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
def nnsight_client(host: str, api_key: str | None) -> Iterator[None]:
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
