"""Loading: where the ``StandardizedTransformer`` an attribution runs on comes from.

``load`` builds one from a hub id, a local folder, a short name of ``dla_recipes.models`` (``"smollm2"``), a
transformers model, with the family table's loading needs filled in (a ``RenameConfig`` for Phi, RecurrentGemma,
Zamba2; ``allow_multimodal``; ``check_renaming``) and nnterp's failures turned into a ``LoadError`` naming what it
could not find. ``locate`` decides what a string names, failing fast (no hub retries) on a missing folder or an
offline hub.

``as_standardized`` decides what ``attribute`` accepts as ``model``: a ``StandardizedTransformer`` as is; a
transformers ``PreTrainedModel``, an nnsight ``LanguageModel`` or an existing local model folder (or a short name)
is loaded for the user with ``load`` (default dtype and device, cached so a loop of calls loads once); anything
else, including a hub id (``attribute`` never downloads), is an ``InputError`` that says to call ``load`` first.
"""

from __future__ import annotations

import logging
import os
import weakref
from pathlib import Path

import torch

from ..args import check_device_map, check_dtype
from ..errors import DLAError, InputError
from ..families import family_of
from . import models
from .load_errors import load_error


def tokenizer_for(model, tokenizer):
    """The tokenizer object to hand nnsight: given, or loaded from ``tokenizer`` / the model's name or folder.

    nnsight 0.8.1 does not hand transformers 5's pipeline a tokenizer for a name or folder, so it is loaded here.
    """
    if tokenizer is not None and not isinstance(tokenizer, (str, os.PathLike)):
        return tokenizer
    source = tokenizer or (model if isinstance(model, str) else getattr(model.config, "name_or_path", None))
    if not source:
        raise InputError(
            f"the {type(model).__name__} has no tokenizer name or folder: load(model, tokenizer=...) with a "
            "tokenizer object or folder"
        )
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(source))
    except Exception as error:  # say what failed: nnsight would fail later and say less
        raise InputError(f"could not load a tokenizer for {str(source)!r} ({error}); pass tokenizer=...") from error


def family_kwargs(model) -> dict:
    """What the family table says nnterp needs to load this model (empty for an unknown or unreachable config)."""
    from nnterp.rename_utils import RenameConfig

    config = getattr(model, "config", None)
    if config is None:
        try:
            from transformers import AutoConfig

            config = AutoConfig.from_pretrained(model)
        except Exception:  # noqa: BLE001 - an offline hub id: load without the family's hints
            return {}
    try:
        family = family_of(config)
    except ValueError:
        return {}
    kwargs = dict(family.load_kwargs)
    if family.rename:
        kwargs["rename_config"] = RenameConfig(**family.rename)
    return kwargs


def load(model, tokenizer=None, **kwargs):
    """Load ``model`` as an nnterp ``StandardizedTransformer`` with the nnsight 0.8 compatibility fix applied.

    Args:
        model: a hub id or local folder (str / path), a short name of ``dla_recipes.models`` (``"smollm2"``,
            ``"gemma3"``), an already-built transformers model, or a StandardizedTransformer (returned as is).
            A missing folder, or a hub id while the hub is offline or unreachable, is an ``InputError`` at once.
            With ``remote=True`` the model is named by the hub id the server hosts (``"meta-llama/Llama-3.1-8B"``):
            a local folder or a short name is an ``InputError`` at once (the server cannot be sent a folder), as is
            a hub id while the hub is offline (nnsight names a remote model by asking the hub for its id).
        tokenizer: a tokenizer object, or a hub id / folder to load one from; default: the model's own.
        **kwargs: passed to ``StandardizedTransformer`` (e.g. ``dtype``, ``device_map``, ``remote=True`` to build
            the model without weights for NDIF; ``attn_implementation="eager"`` or ``"sdpa"``, also on an
            already-built model: ``by="source"`` reads eager's own pattern and recomputes sdpa's). The family table's loading needs (a ``RenameConfig`` for Phi,
            RecurrentGemma, Zamba2; ``allow_multimodal``; ``check_renaming``) are filled in unless given.
    """
    from nnterp import StandardizedTransformer

    if isinstance(model, StandardizedTransformer):
        return model
    check_device_map(kwargs.get("device_map"))
    if "dtype" in kwargs:
        kwargs["dtype"] = check_dtype(kwargs["dtype"])
    remote = bool(kwargs.get("remote"))
    if isinstance(model, (str, os.PathLike)):
        model = locate_remote(model) if remote else locate(model)
    if isinstance(model, torch.nn.Module) and "attn_implementation" in kwargs:  # a built model: switch it now
        model.set_attn_implementation(kwargs.pop("attn_implementation"))
    kwargs = {**family_kwargs(model), **kwargs, "tokenizer": tokenizer_for(model, tokenizer)}
    # nnterp checks its renaming with a fake-tensor scan; on fused MoE experts torch logs a long, harmless error
    # traceback before nnterp falls back to a real trace. Keep it out of the user's output.
    fake_tensor_log = logging.getLogger("torch._subclasses.fake_tensor")
    level = fake_tensor_log.level
    fake_tensor_log.setLevel(logging.CRITICAL)
    try:
        loaded = StandardizedTransformer(model, **kwargs)
        if remote:
            check_remote_key(loaded, model)
        return loaded
    except DLAError:
        raise
    except OSError as error:  # a hub id the hub does not have, a folder without weights
        if not isinstance(model, str):
            raise load_error(model, error) from error
        raise InputError(f"could not load model {model!r}: {error}") from error
    except Exception as error:  # nnterp's own errors name too little: say what it could not find
        raise load_error(model, error) from error
    finally:
        fake_tensor_log.setLevel(level)


def _registered_folder(name: str) -> str | None:
    """The folder of a registered short name (``"smollm2"``, ``"gemma3-270m"``), or None for other names."""
    try:
        key = models.canonical_key(name)
    except KeyError:
        return None
    return str(models.MODELS[key]())


def short_names() -> str:
    """The short names ``load`` accepts (``"smollm2"``, ...), comma-separated."""
    return ", ".join(sorted(set(models.MODELS) | set(models.ALIASES) - {models.DEFAULT_MODEL.lower()}))


def locate(name: str, *, hub: bool = True) -> str:
    """What ``load`` should open for a string: an existing folder, a short name's folder or (``hub``) a hub id.

    Fails fast with an ``InputError`` (no hub retries) for a missing path, a file, and a hub id when the hub is
    offline (``HF_HUB_OFFLINE``) or unreachable and the id is not in the local hub cache.
    """
    text = os.fspath(name)
    path = Path(text).expanduser()
    if path.is_dir():
        return str(path)
    if path.exists():
        raise InputError(f"model {text!r} is a file: give the folder that holds its config.json and weights")
    folder = _registered_folder(text)
    if folder is not None:
        return folder
    advice = f"give an existing model folder or a short name ({short_names()})"
    looks_like_path = text.startswith(("/", ".", "~")) or "\\" in text or text.count("/") > 1 or not text.strip()
    if looks_like_path or not hub:
        raise InputError(f"model {text!r} is not a local folder: {advice}")
    if _hub_cached(text):
        return text
    reason = _hub_unreachable()
    if reason:
        raise InputError(f"model {text!r} is not a local folder and the Hugging Face hub is {reason}: {advice}")
    return text


REMOTE_EXAMPLE = "meta-llama/Llama-3.1-8B"


def locate_remote(name, cli: bool = False) -> str:
    """What ``load(name, remote=True)`` builds: ``name`` as a hub id, refused at once (``InputError``) when it is a
    short name, not shaped as a hub id, or when the hub is offline or unreachable. A local folder is returned as is
    and judged by its model key once built (``check_remote_key``): a folder registered under a served name (the
    loopback server's ``register_model_key``) is named by that name; any other folder is refused there. ``cli``:
    word the refusals for the command line (``--model``, ``--remote``)."""
    text = os.fspath(name)
    if Path(text).expanduser().is_dir():
        return text
    what = f"--model {text!r} with --remote" if cli else f"model {text!r} with remote=True"
    here = "give it without --remote to run it here" if cli else "load it without remote=True to run it here"
    try:
        key = models.canonical_key(text)
    except KeyError:
        key = None
    if key is not None:
        hub_id = models.HUB_IDS[key]
        raise InputError(
            f"{what}: {text!r} is the short name of a local copy fetched from PyPI, and a remote model is named by "
            f"the hub id the server hosts: " + (f"--model {hub_id}" if cli else f"load({hub_id!r}, remote=True)")
            + f" (if the server hosts it), or {here}"
        )
    looks_like_path = text.startswith(("/", ".", "~")) or "\\" in text or text.count("/") > 1 or not text.strip()
    if looks_like_path:
        raise InputError(
            f"{what} is not a hub id: a remote model is named by the hub id the server hosts ('org/name', e.g. "
            f"{REMOTE_EXAMPLE!r})"
        )
    reason = _hub_unreachable()
    if reason:
        raise InputError(
            f"{what}: a remote model is named by its hub id, which nnsight checks with the Hugging Face hub (and this "
            f"machine reads its config and tokenizer there), and the hub is {reason}; run where the hub is reachable, "
            "or " + ("give a local folder without --remote to run it here" if cli
                     else "load a local folder without remote=True to run it here")
        )
    return text


def check_remote_key(model, source) -> None:
    """Refuse a remote model no server can be asked for: nnsight names it by ``model.to_model_key()``, the hub id its
    folder or name stands for; a local folder (not a hub id) has none, and the first remote run would fail."""
    try:
        model.to_model_key()
    except Exception as error:  # what the remote run would have raised, said now
        text = os.fspath(source) if isinstance(source, (str, os.PathLike)) else type(source).__name__
        if isinstance(source, (str, os.PathLike)) and Path(text).expanduser().is_dir():
            raise InputError(
                f"model {text!r} with remote=True is a local folder, and a remote model is named by the hub id the "
                f"server hosts (the server runs its own copy; it cannot be sent this folder): load('org/name', "
                f"remote=True), e.g. load({REMOTE_EXAMPLE!r}, remote=True), or load the folder without remote=True "
                "to run it here"
            ) from error
        raise InputError(
            f"model {text!r} with remote=True has no hub id nnsight can name it by "
            f"({type(error).__name__}: {error}); a remote model is named by the hub id the server hosts"
        ) from error


def _hub_cached(repo_id: str) -> bool:
    try:
        from huggingface_hub import try_to_load_from_cache

        return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)
    except Exception:  # noqa: BLE001 - a malformed id: not cached
        return False


def _hub_unreachable() -> str | None:
    """Why the hub cannot be used (offline mode, no connection within 3 s), or None."""
    import socket
    from urllib.parse import urlparse

    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
        return "offline (HF_HUB_OFFLINE is set)"
    if any(os.environ.get(name) for name in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return None  # behind a proxy a direct connection says nothing: let the hub client try
    try:
        from huggingface_hub import constants

        endpoint = urlparse(constants.ENDPOINT)
    except Exception:  # noqa: BLE001
        endpoint = urlparse("https://huggingface.co")
    host, port = endpoint.hostname or "huggingface.co", endpoint.port or (443 if endpoint.scheme == "https" else 80)
    try:
        socket.create_connection((host, port), timeout=3).close()
    except OSError as error:
        return f"not reachable ({host}: {error})"
    return None


_LOADED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # transformers model -> its StandardizedTransformer


_LOADED_FOLDER: dict = {}  # the last folder attribute() loaded: {path: model}


def as_standardized(model):
    """The ``StandardizedTransformer`` to attribute: ``model`` itself, or loaded for the user (see module docstring)."""
    from nnterp import StandardizedTransformer

    if isinstance(model, StandardizedTransformer):
        return model
    if isinstance(model, (str, os.PathLike)):
        text = os.fspath(model)
        try:
            folder = locate(text, hub=False)
        except InputError as error:
            raise InputError(
                f"{error}. attribute() loads only local folders: load the model once with "
                f"model = dla_recipes.load({text!r}) and pass the model"
            ) from None
        if folder not in _LOADED_FOLDER:
            _LOADED_FOLDER.clear()
            _LOADED_FOLDER[folder] = load(folder)
        return _LOADED_FOLDER[folder]
    from transformers import PreTrainedModel

    module, tokenizer = model, None
    if not isinstance(model, PreTrainedModel) and isinstance(getattr(model, "_module", None), PreTrainedModel):
        module, tokenizer = model._module, getattr(model, "tokenizer", None)  # an nnsight LanguageModel
    if isinstance(module, PreTrainedModel):
        if module not in _LOADED:
            try:
                _LOADED[module] = load(module, tokenizer=tokenizer)
            except ValueError as error:
                raise InputError(
                    f"could not wrap the {type(module).__name__} for attribution ({error}): load it with "
                    "model = dla_recipes.load(hf_model, tokenizer=...) and pass that"
                ) from error
        return _LOADED[module]
    raise InputError(
        f"model is a {type(model).__name__}: pass a model loaded with dla_recipes.load(...) (a hub id, a folder "
        "or a transformers model)"
    )

