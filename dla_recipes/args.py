"""Argument checks that need no model: prompts, token ids, positions, granularity, sizes, dtypes, remote targets.

The first stage of every call. Each check raises an ``InputError`` naming the argument and the fix, and accepts what
a user would reasonably pass: numpy / 0-d tensor integers as ids and positions, a tuple or generator of prompts, a
single id in a list for all prompts, ``"bf16"`` for a dtype. Nothing here loads, tokenizes or reads a model: what
depends on one (tokens in its vocabulary, positions inside its prompts) is checked where the prompts are tokenized
(``transport.batches``), and what depends on its family (``by="expert"`` on a dense model) by the plan
(``Plan.require``).
"""

from __future__ import annotations

import difflib
import math
import numbers
from collections.abc import Mapping, Sequence
from collections.abc import Set as AbstractSet
from typing import Literal, get_args

import torch

from .errors import InputError

Granularity = Literal["block", "head", "neuron", "expert", "source"]
Check = Literal["logit", "adds"]  # the self-check: the whole logit's bound, or also every residual add (math.adds)
CHECKS: tuple[str, ...] = get_args(Check)
GRANULARITIES: tuple[str, ...] = get_args(Granularity)


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


Prompt = str | tuple[int, ...]  # a text, or a prompt's own token ids


def token_ids(value, role: str) -> tuple[int, ...] | None:
    """``value`` as a tuple of token ids when it is a sequence of integers (a list, a 1-D integer tensor or array),
    else None; an empty sequence, or one mixing integers with other things, raises ``InputError``."""
    if isinstance(value, torch.Tensor) or type(value).__module__ == "numpy" and hasattr(value, "ndim"):
        if value.ndim != 1:
            return None
        value = value.tolist()
    if not isinstance(value, (list, tuple)) or not value:
        return None
    if not any(isinstance(v, numbers.Integral) and not isinstance(v, bool) for v in value):
        return None
    bad = [v for v in value if isinstance(v, bool) or not isinstance(v, numbers.Integral)]
    if bad:
        raise InputError(f"{role} mixes token ids with {bad[0]!r}: give a string or a list of int token ids")
    return tuple(int(v) for v in value)


def encoded_prompts(prompts) -> list[tuple[int, ...]] | None:
    """Token-id prompts, each its own ids without padding: a ``[batch, pos]`` integer tensor / array (every token
    real), a dict or ``BatchEncoding`` with ``input_ids`` and ``attention_mask``, or a list of id lists; None when
    ``prompts`` is not token ids (a list of one prompt's ids is handled by ``check_prompts``)."""
    if isinstance(prompts, Mapping) and "input_ids" in prompts:
        ids, mask = prompts["input_ids"], prompts.get("attention_mask")
        ids = torch.as_tensor(ids)
        ids = ids[None] if ids.dim() == 1 else ids
        mask = torch.ones_like(ids, dtype=torch.bool) if mask is None else torch.as_tensor(mask).reshape(ids.shape).bool()
        return [tuple(int(t) for t in row[keep]) for row, keep in zip(ids, mask)]
    if (isinstance(prompts, torch.Tensor) or type(prompts).__module__ == "numpy") and getattr(prompts, "ndim", 0) == 2:
        if isinstance(prompts, torch.Tensor) and (prompts.dtype.is_floating_point or prompts.dtype == torch.bool):
            raise InputError(f"prompts is a {prompts.dtype} tensor: token ids are integers")
        return [tuple(int(t) for t in row) for row in prompts.tolist()]
    return None


def check_prompts(prompts) -> list[Prompt]:
    """``prompts`` as a non-empty list of prompts, each a string or its own token ids (``tuple[int, ...]``).

    Accepted: a string; a list / tuple / generator / array of strings; token ids: one prompt's (a list of ints, a
    1-D integer tensor), several (a list of id lists, a ``[batch, pos]`` integer tensor: every token real), or a
    dict / ``BatchEncoding`` with ``input_ids`` and ``attention_mask`` (the mask says which tokens are real, on
    either side). Ids are attributed as given: no BOS token is added."""
    if prompts is None:
        raise InputError("prompts is None: pass a string or a list of strings, e.g. 'The Eiffel Tower is in'")
    encoded = encoded_prompts(prompts)
    one = None if encoded is not None else token_ids(prompts, "prompts")
    if encoded is not None or one is not None:
        encoded = [one] if one is not None else encoded
        if not encoded:
            raise InputError("no prompts given: pass a string or a non-empty list of strings")
        return list(encoded)
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
    out: list[Prompt] = []
    for i, prompt in enumerate(prompts):
        ids = token_ids(prompt, f"prompt {i}")
        out.append(ids if ids is not None else check_text(prompt, f"prompt {i}"))
    return out


def check_granularity(by) -> str:
    """``by``, or an ``InputError`` (suggesting the closest name) unless it is one of ``GRANULARITIES``."""
    if not isinstance(by, str) or by not in GRANULARITIES:
        raise InputError(
            f"by={by!r} is not a granularity: use one of {', '.join(map(repr, GRANULARITIES))}"
            f"{closest(by, GRANULARITIES)}"
        )
    return by


def check_check(check) -> str:
    """``check``, or an ``InputError`` unless it is one of ``CHECKS``."""
    if not isinstance(check, str) or check not in CHECKS:
        raise InputError(f"check={check!r}: use 'logit' (the parts against the whole logit's bound, the default) or "
                         "'adds' (also every residual add against its own rounding: a write no component made is "
                         "caught at its block, from 1% of the stream's norm in bfloat16)")
    return check


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


# one position (today's shapes), a list of them, a slice of each prompt, or one slice per prompt (its own span)
Position = int | tuple[int, ...] | slice | tuple[slice, ...]


def check_position(position) -> Position:
    """``position`` checked: an int (Python, numpy, 0-d integer tensor), a list / tuple / 1-D tensor of ints, a
    ``slice`` of each prompt's own tokens, ``"all"`` (``slice(None)``), or a list of one slice per prompt (each
    prompt's own span, e.g. its answer: column ``k`` is the ``k``-th position of each span). Negative values count
    from the end of each prompt's own tokens."""
    usage = ("give an int, a list of ints, a slice or 'all' (negative values count from the end of each prompt's "
             "own tokens)")
    if isinstance(position, str):
        if position.strip().lower() == "all":
            return slice(None)
        raise InputError(f"position={position!r}: {usage}")
    if isinstance(position, slice):
        for name in ("start", "stop", "step"):
            value = getattr(position, name)
            if value is not None and as_index(value, f"position's slice {name}") is None:
                raise InputError(f"position={position!r}: its {name} is not an int; {usage}")
        start, stop, step = (None if v is None else as_index(v, "position") for v in
                             (position.start, position.stop, position.step))
        if step is not None and step <= 0:
            raise InputError(f"position={position!r}: a slice's step must be positive (positions run forward)")
        return slice(start, stop, step)
    index = None if position is None else as_index(position, "position")
    if index is not None:
        return index
    many = position.tolist() if isinstance(position, torch.Tensor) or type(position).__module__ == "numpy" else position
    if isinstance(many, (list, tuple, range)):
        if not many:
            raise InputError(f"position={position!r} is empty: {usage}")
        if all(isinstance(p, slice) for p in many):  # one span per prompt
            return tuple(check_position(p) for p in many)
        items = [as_index(p, f"position {k} of the list") for k, p in enumerate(many)]
        if any(p is None for p in items):
            raise InputError(f"position={position!r} holds a value that is not an int: {usage}")
        return tuple(items)
    raise InputError(f"position={position!r}: {usage}")


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
