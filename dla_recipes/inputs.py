"""Client-side input preparation: prompts, target tokens and positions checked and turned into tensors.

Everything a user can get wrong is caught here, before any forward pass, with an ``InputError`` that names the
argument and the fix: an empty prompt, a target that is several tokens or not in the vocabulary, a position outside
a prompt, mismatched batch sizes, a granularity the model does not have, a bad ``batch_size`` / ``tolerance`` /
``dtype`` / ``device_map``, a model that is not a loaded ``StandardizedTransformer``. What a user would reasonably
pass is accepted: numpy / 0-d tensor integers as token ids and positions, a tuple or generator of prompts, a single
id in a list for all prompts. The prompts are tokenized once, here, with the model's tokenizer and padding side (as
nnsight pads), and the encoding is what the trace runs on, so the positions computed here are the positions the
model sees.

``check_model`` decides what ``attribute`` accepts as ``model``: a ``StandardizedTransformer`` as is; a transformers
``PreTrainedModel``, an nnsight ``LanguageModel`` or an existing local model folder (or a short name of
``dla_recipes.models``) is loaded for the user with ``dla_recipes.load`` (default dtype and device, cached so a loop
of calls loads once); anything else, including a hub id (``attribute`` never downloads), is an ``InputError`` that
says to call ``dla_recipes.load`` first.
"""

from __future__ import annotations

import difflib
import math
import numbers
import os
import weakref
from collections.abc import Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence, Union

import torch

from .errors import InputError

Token = Union[str, int]


@dataclass(frozen=True)
class Batch:
    """A checked batch.

    Attributes:
        prompts: the prompts, as given.
        encoding: ``{"input_ids", "attention_mask"}`` ``[batch, seq]``, padded on the tokenizer's side.
        positions: ``[batch]`` long, each prompt's attributed position as an index into the padded sequence.
        own_positions: each attributed position as an index into the prompt's own tokens (``0..length-1``).
        targets, contrasts: ``[batch]`` long token ids (``contrasts`` None without a contrast).
        target_tokens, contrast_tokens: the tokens decoded to text (``" Paris"``), for display.
        lengths: each prompt's own token count.
    """

    prompts: tuple[str, ...]
    encoding: dict
    positions: torch.Tensor
    own_positions: tuple[int, ...]
    targets: torch.Tensor
    contrasts: torch.Tensor | None
    target_tokens: tuple[str, ...]
    contrast_tokens: tuple[str, ...] | None
    lengths: tuple[int, ...]


def _vocab_size(model) -> int:
    size = getattr(model, "vocab_size", None)
    if not size:
        config = getattr(model.config, "text_config", None) or model.config
        size = config.vocab_size
    return int(size)


def as_index(value, role: str):
    """``value`` as a Python int when it is an integer (int, numpy integer, 0-d / 1-element integer tensor or array),
    else ``None``; a float, bool or complex number raises ``InputError`` (never truncated)."""
    if isinstance(value, bool) or _is_numpy_bool(value):
        raise InputError(f"{role} is a bool ({value!r}): pass an integer")
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, torch.Tensor) or type(value).__module__ == "numpy":
        size = value.numel() if isinstance(value, torch.Tensor) else getattr(value, "size", 1)
        if size != 1:
            return None
        dtype = value.dtype
        if isinstance(value, torch.Tensor):
            integral = not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)
        else:
            integral = getattr(dtype, "kind", "") in "iu"
        if not integral:
            raise InputError(
                f"{role} is a {dtype} value ({_item(value)!r}): pass an integer (a float is never truncated to an id)"
            )
        return int(_item(value))
    if isinstance(value, numbers.Number):
        raise InputError(f"{role} is a {type(value).__name__} ({value!r}): pass an integer (floats are never truncated)")
    return None


def _item(value):
    return value.reshape(()).item() if hasattr(value, "reshape") else value


def _is_numpy_bool(value) -> bool:
    return type(value).__module__ == "numpy" and getattr(getattr(value, "dtype", None), "kind", "") == "b"


def check_text(text, role: str) -> str:
    """``text`` checked to be a string the tokenizer can encode (bytes and lone surrogates are refused)."""
    if isinstance(text, (bytes, bytearray)):
        raise InputError(f"{role} is bytes ({bytes(text)[:40]!r}): decode it first, e.g. {role.split()[0]}.decode('utf-8')")
    if not isinstance(text, str):
        raise InputError(f"{role} is a {type(text).__name__}, not a string")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise InputError(
            f"{role} contains {text[error.start:error.end]!r} at character {error.start}, a lone surrogate that is "
            "not valid Unicode text: remove it, or decode the source bytes with errors='replace'"
        ) from None
    return str(text)


def resolve_token(model, token: Token, role: str = "target") -> int:
    """The id of one token given as a string (``" Paris"``) or an integer id (Python, numpy or a 1-element integer
    tensor); raises ``InputError`` naming the problem."""
    tokenizer = model.tokenizer
    vocab = _vocab_size(model)
    index = as_index(token, role)
    if index is not None:
        if not 0 <= index < vocab:
            raise InputError(f"{role} token id {index} is not in the vocabulary (ids 0..{vocab - 1})")
        return index
    if not isinstance(token, (str, bytes, bytearray)):
        raise InputError(f"{role} must be a token string or a token id, not {type(token).__name__}: {token!r}")
    token = check_text(token, role)
    if token == "":
        raise InputError(f"{role} is an empty string: give one token, e.g. ' Paris'")
    ids = tokenizer(token, add_special_tokens=False)["input_ids"]
    if len(ids) != 1:
        pieces = tokenizer.convert_ids_to_tokens(ids)
        raise InputError(
            f"{role} {token!r} is {len(ids)} tokens {pieces}, not one: attribute one token "
            f"(e.g. {tokenizer.convert_tokens_to_string(pieces[:1])!r}) or pass a token id"
        )
    unk = getattr(tokenizer, "unk_token_id", None)
    if unk is not None and ids[0] == unk and token != tokenizer.unk_token:
        raise InputError(f"{role} {token!r} is not in the vocabulary (the tokenizer maps it to {tokenizer.unk_token!r})")
    if not 0 <= ids[0] < vocab:
        raise InputError(f"{role} {token!r} has id {ids[0]}, outside the model's vocabulary of {vocab}")
    return int(ids[0])


def per_prompt(value, n: int, role: str) -> list:
    """``value`` as one entry per prompt: a list / tuple / array / tensor of ``n``, or a single token (or a sequence of
    one) repeated ``n`` times."""
    if isinstance(value, (Mapping, AbstractSet)):
        raise InputError(
            f"{role} is a {type(value).__name__}: give a token string or id, or a list of one per prompt"
        )
    if isinstance(value, torch.Tensor) or type(value).__module__ == "numpy" and hasattr(value, "reshape"):
        value = list(value.reshape(-1)) if getattr(value, "ndim", 0) else value
    if isinstance(value, (list, tuple)):
        if len(value) == 1:
            return list(value) * n
        if len(value) != n:
            raise InputError(f"{len(value)} {role} tokens for {n} prompts: give one for all or one per prompt")
        return list(value)
    return [value] * n


def check_prompts(prompts) -> list[str]:
    """``prompts`` as a non-empty list of strings: a string, or a list / tuple / generator / array of strings."""
    if prompts is None:
        raise InputError("prompts is None: pass a string or a list of strings, e.g. 'The Eiffel Tower is in'")
    if isinstance(prompts, (str, bytes, bytearray)):
        prompts = [prompts]
    elif isinstance(prompts, (Mapping, AbstractSet)):
        raise InputError(
            f"prompts is a {type(prompts).__name__}, which has no fixed order: pass a list of strings"
        )
    else:
        try:
            prompts = list(prompts)
        except TypeError:
            raise InputError(
                f"prompts is a {type(prompts).__name__}: pass a string or a list of strings"
            ) from None
    if not prompts:
        raise InputError("no prompts given: pass a string or a non-empty list of strings")
    return [check_text(prompt, f"prompt {i}") for i, prompt in enumerate(prompts)]


def check_arguments(model, prompts, by, batch_size, tolerance, remote=False):
    """The checks at the top of ``attribute`` / ``attribute_direction``: ``(model, prompts, batch_size, tolerance)``
    checked and converted (``model`` loaded for the user where ``check_model`` allows it; ``by`` checked against it;
    ``remote`` checked to be a bool or a server URL).
    """
    check_by(by)
    check_remote(remote)
    prompts = check_prompts(prompts)
    batch_size, tolerance = check_batch_size(batch_size), check_tolerance(tolerance)
    model = check_model(model)
    from .plan import build_plan

    check_by(by, build_plan(model))
    return model, prompts, batch_size, tolerance


def check_remote(remote) -> None:
    """``remote``: ``False``, ``True`` (NDIF) or a server URL starting with ``http://`` / ``https://``."""
    if isinstance(remote, bool) or remote is None:
        return
    if isinstance(remote, str) and remote.startswith(("http://", "https://")):
        return
    raise InputError(
        f"remote={remote!r}: give True (NDIF, host from nnsight's config), False, or a server URL starting with "
        "http:// or https://"
    )


def check_int(value, role: str) -> int:
    """``value`` as an int (Python, numpy, 0-d integer tensor), else ``InputError`` naming ``role``."""
    index = None if value is None else as_index(value, role)
    if index is None:
        raise InputError(f"{role} must be an int, not {value!r}")
    return index


def check_position(position) -> int:
    """``position`` as an int (Python, numpy, 0-d integer tensor); negative counts from the end of each prompt."""
    index = None if position is None else as_index(position, "position")
    if index is None:
        raise InputError(
            f"position must be one int for all prompts (negative counts from the end of each prompt), not {position!r}"
        )
    return index


def check_batch_size(batch_size) -> int | None:
    """``batch_size`` as a positive int, or None (all prompts in one forward pass)."""
    if batch_size is None:
        return None
    try:
        size = as_index(batch_size, "batch_size")
    except InputError:
        size = None
    if size is None or size < 1:
        raise InputError(
            f"batch_size={batch_size!r}: give a positive int (prompts per forward pass), or None for all in one"
        )
    return size


def check_tolerance(tolerance) -> float | None:
    """``tolerance`` as a positive finite float, or None (the default for the model's dtype)."""
    if tolerance is None:
        return None
    if isinstance(tolerance, bool) or not isinstance(tolerance, numbers.Real) or not (
        math.isfinite(float(tolerance)) and float(tolerance) > 0
    ):
        raise InputError(
            f"tolerance={tolerance!r}: give a positive relative tolerance (e.g. 1e-4), or None for the default "
            "of the model's dtype"
        )
    return float(tolerance)


def check_by(by, plan=None) -> str:
    """``by`` checked to be a granularity (the closest valid name suggested) and, with ``plan``, one the model has."""
    from .plan import check_granularity

    check_granularity(by)
    if plan is not None and by == "expert" and not any(
        planned.mode(by) is not None for terms in plan.layers for planned in terms
    ):
        raise InputError(
            f"by='expert': this {plan.family.name} model has no routed experts (no mixture-of-experts block); "
            "use by='block', 'head' or 'neuron'"
        )
    return by


def closest(name, choices: Sequence[str]) -> str:
    """`` (did you mean 'head'?)`` for the choice closest to ``name``, or ``""``."""
    if not isinstance(name, str):
        return ""
    key = name.strip().lower()
    match = difflib.get_close_matches(key, choices, n=1, cutoff=0.5) or [c for c in choices if key.startswith(c)]
    return f" (did you mean {match[0]!r}?)" if match else ""


DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "f32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "f16": torch.float16, "half": torch.float16,
    "float64": torch.float64, "fp64": torch.float64, "double": torch.float64,
}


def check_dtype(dtype):
    """A dtype given as a ``torch.dtype``, ``"auto"`` or a name (``"bfloat16"`` / ``"bf16"``, ``"fp16"``, ...)."""
    if dtype is None or isinstance(dtype, torch.dtype) or dtype == "auto":
        return dtype
    if isinstance(dtype, str) and dtype.strip().lower().removeprefix("torch.") in DTYPES:
        return DTYPES[dtype.strip().lower().removeprefix("torch.")]
    raise InputError(
        f"dtype {dtype!r} is not a dtype: use float32 (fp32), bfloat16 (bf16) or float16 (fp16), or a torch.dtype"
    )


def check_device_map(device_map) -> None:
    """Refuse ``device_map="meta"``: a model without weights cannot be attributed."""
    if device_map == "meta" or isinstance(device_map, torch.device) and device_map.type == "meta" or (
        isinstance(device_map, Mapping) and any(str(v) == "meta" for v in device_map.values())
    ):
        raise InputError(
            "device_map='meta' builds the model without weights, which cannot be attributed: use device_map='cpu' "
            "(or 'auto' / 'cuda'), or remote=True to build it without weights for an NDIF server"
        )


def check_length(model, lengths: Sequence[int]) -> None:
    """Refuse a prompt longer than the model's position table (``max_position_embeddings`` / ``n_positions``)."""
    config = getattr(model.config, "text_config", None) or model.config
    limit = next(
        (getattr(config, name) for name in ("max_position_embeddings", "n_positions", "n_ctx")
         if isinstance(getattr(config, name, None), int) and getattr(config, name) > 0),
        None,
    )
    for i, length in enumerate(lengths):
        if limit is not None and length > limit:
            raise InputError(
                f"prompt {i} has {length} tokens, more than this model's {limit} positions "
                "(config max_position_embeddings): shorten it"
            )


def _registered_folder(name: str) -> str | None:
    """The folder of a registered short name (``"smollm2"``, ``"gemma3-270m"``), or None for other names."""
    from .loading import models

    try:
        key = models.canonical_key(name)
    except KeyError:
        return None
    return str(models.MODELS[key]())


def short_names() -> str:
    from .loading import models

    return ", ".join(sorted(set(models.MODELS) | set(models.ALIASES) - {models.DEFAULT_MODEL.lower()}))


def check_source(name: str, *, hub: bool = True) -> str:
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


def check_model(model):
    """The ``StandardizedTransformer`` to attribute: ``model`` itself, or loaded for the user (see module docstring)."""
    from nnterp import StandardizedTransformer

    from .api import load

    if isinstance(model, StandardizedTransformer):
        return model
    if isinstance(model, (str, os.PathLike)):
        text = os.fspath(model)
        try:
            folder = check_source(text, hub=False)
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


def prepare(model, prompts: str | Sequence[str], target, contrast=None, position: int = -1) -> Batch:
    """Check and tokenize a batch; see the module docstring. ``position`` counts each prompt's own tokens."""
    prompts = check_prompts(prompts)
    for i, prompt in enumerate(prompts):
        if prompt == "":
            raise InputError(f"prompt {i} is empty: give it some text to attribute")
    position = check_position(position)
    tokenizer = model.tokenizer
    if tokenizer is None:
        raise InputError("the model has no tokenizer: load it with dla_recipes.load(..., tokenizer=...)")
    encoding = tokenizer(prompts, return_tensors="pt", padding=True)
    encoding = {"input_ids": encoding["input_ids"], "attention_mask": encoding["attention_mask"]}
    return prepare_encoding(model, encoding, target, contrast, position, prompts)


def prepare_encoding(model, encoding: dict, target, contrast=None, position: int = -1, prompts=None) -> Batch:
    """``prepare`` for a batch already tokenized (``encoding``: ``input_ids`` and ``attention_mask``
    ``[batch, seq]``, padded on either side), e.g. the batch nnsight assembled from a trace's invokes.

    ``prompts``: the texts, for display; default: each row's tokens decoded.
    """
    position = check_position(position)
    tokenizer = model.tokenizer
    ids = encoding["input_ids"]
    mask = encoding.get("attention_mask")
    mask = torch.ones_like(ids, dtype=torch.bool) if mask is None else mask.bool()
    if prompts is None:
        prompts = [tokenizer.decode(row[keep]) for row, keep in zip(ids, mask)]
    lengths = mask.sum(-1).tolist()
    check_length(model, lengths)
    positions, own_positions = [], []
    for i, (prompt, length) in enumerate(zip(prompts, lengths)):
        if length == 0:
            raise InputError(f"prompt {i} ({prompt!r}) is empty: it has no tokens to attribute")
        own = position + length if position < 0 else position
        if not 0 <= own < length:
            raise InputError(
                f"position {position} is outside prompt {i} ({prompt!r}), which has {length} tokens: "
                f"use {-length}..{length - 1}"
            )
        token_indices = mask[i].nonzero()[:, 0]
        positions.append(int(token_indices[own]))
        own_positions.append(own)
    targets = [resolve_token(model, t, "target") for t in per_prompt(target, len(prompts), "target")]
    contrasts = None
    if contrast is not None:
        contrasts = [resolve_token(model, t, "contrast") for t in per_prompt(contrast, len(prompts), "contrast")]
    return Batch(
        prompts=tuple(prompts),
        encoding=encoding,
        positions=torch.tensor(positions, dtype=torch.long),
        own_positions=tuple(own_positions),
        targets=torch.tensor(targets, dtype=torch.long),
        contrasts=None if contrasts is None else torch.tensor(contrasts, dtype=torch.long),
        target_tokens=tuple(tokenizer.decode([t]) for t in targets),
        contrast_tokens=None if contrasts is None else tuple(tokenizer.decode([t]) for t in contrasts),
        lengths=tuple(int(n) for n in lengths),
    )
