"""Batches: prompts tokenized once with the model's tokenizer, targets resolved, positions placed, groups formed.

``prepare`` checks and tokenizes one batch (as nnsight pads: the model's tokenizer and padding side), so the
positions computed here are the positions the model sees; ``prepare_encoding`` does the same for a batch already
tokenized (the one nnsight assembled from a trace's invokes). Everything that depends on the model's vocabulary or
its prompts' lengths is checked here with an ``InputError``: a target that is several tokens or not in the
vocabulary, a position outside a prompt, a prompt longer than the model's positions, a batch longer than the model
runs in one pass (``check_single_pass``). Every bad target and contrast of a call is named in one error, with its
prompt's index (``resolve_all``); a word given without the leading space the model most likely predicts is
attributed as given, with a warning (``space_warning``).

Which prompts share a forward pass (``group_prompts``): on most families left padding leaves a prompt's logits
unchanged, so prompts are batched in the user's order, ``batch_size`` at a time. On a family with
``padding_safe=False`` (a recurrent state or a router that reads the pad tokens: RecurrentGemma, DeepSeek-V4) a
padded prompt would be attributed as the padded batch computes it, not as the prompt alone; there prompts are
grouped by token count, so no batch is padded (the result puts the rows back in the user's order).
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..args import as_index, check_position, check_prompts, check_text, per_prompt
from ..errors import InputError, UnknownFamilyError
from ..families import family_of, text_config

Token = str | int


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


def vocab_size(model) -> int:
    size = getattr(model, "vocab_size", None)
    if not size:
        size = text_config(model).vocab_size
    return int(size)


def resolve_token(model, token: Token, role: str = "target") -> int:
    """The id of one token given as a string (``" Paris"``) or an integer id (Python, numpy or a 1-element integer
    tensor); raises ``InputError`` naming the problem."""
    tokenizer = model.tokenizer
    vocab = vocab_size(model)
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
        spaced = spaced_id(tokenizer, token)
        hint = f"{' ' + token!r}, with its leading space, is one token" if spaced is not None else (
            f"e.g. {tokenizer.convert_tokens_to_string(pieces[:1])!r}")
        raise InputError(
            f"{role} {token!r} is {len(ids)} tokens {pieces}, not one: attribute one token ({hint}) or pass a token id"
        )
    unk = getattr(tokenizer, "unk_token_id", None)
    if unk is not None and ids[0] == unk and token != tokenizer.unk_token:
        raise InputError(f"{role} {token!r} is not in the vocabulary (the tokenizer maps it to {tokenizer.unk_token!r})")
    if not 0 <= ids[0] < vocab:
        raise InputError(f"{role} {token!r} has id {ids[0]}, outside the model's vocabulary of {vocab}")
    return int(ids[0])


def resolve_all(model, prompts: Sequence[str], target, contrast=None, rows: Sequence[int] | None = None):
    """``(target ids, contrast ids or None)``, one per prompt: every token of the call checked before any is used.

    ``target`` / ``contrast``: one token for all prompts or one per prompt (``per_prompt``). Every bad one is named
    in ONE ``InputError``, with the indices (``rows``, default ``0..n-1``) of the prompts it was given for, so a
    dataset is fixed in one pass, not one error per run. A good but unspaced word gets a warning (``space_warning``).
    """
    tokenizer_of(model)
    rows = list(rows) if rows is not None else list(range(len(prompts)))
    targets = per_prompt(target, len(prompts), "target")
    contrasts = None if contrast is None else per_prompt(contrast, len(prompts), "contrast")
    problems: dict[str, list[int]] = {}  # message -> the prompts it was given for
    resolved = {}
    for role, tokens in (("target", targets), ("contrast", contrasts)):
        if tokens is None:
            continue
        ids = []
        for i, token in zip(rows, tokens):
            key = (role, token) if isinstance(token, str) or type(token) is int else None  # not True == 1, a tensor
            try:
                if key is None or key not in resolved:
                    value = resolve_token(model, token, role)
                    if key is not None:
                        resolved[key] = value
                ids.append(resolved[key] if key is not None else value)
            except InputError as error:
                problems.setdefault(str(error), []).append(i)
                ids.append(None)
        resolved[role] = ids
    if problems:
        raise InputError(token_problems(problems, len(prompts)))
    space_warning(model, prompts, targets, resolved["target"], "target", rows)
    if contrasts is not None:
        space_warning(model, prompts, contrasts, resolved["contrast"], "contrast", rows)
    return resolved["target"], resolved.get("contrast")


def tokenizer_of(model):
    """The model's tokenizer, or an ``InputError`` saying how to give it one."""
    if model.tokenizer is None:
        raise InputError("the model has no tokenizer: load it with dla_recipes.load(..., tokenizer=...)")
    return model.tokenizer


def which(indices: Sequence[int], n: int) -> str:
    """``"prompt 3"``, ``"prompts 0, 4, 7"`` (at most 10 named), or ``"all 60 prompts"``."""
    if len(indices) == n and n > 1:
        return f"all {n} prompts"
    if len(indices) == 1:
        return f"prompt {indices[0]}"
    named = ", ".join(map(str, indices[:10]))
    return f"prompts {named}" + (f", ... ({len(indices) - 10} more)" if len(indices) > 10 else "")


def token_problems(problems: dict[str, list[int]], n: int) -> str:
    """One message for every bad token: ``{message: prompt indices}``."""
    if len(problems) == 1:
        (message, indices), = problems.items()
        return f"{which(indices, n)}: {message}"
    lines = [f"  {which(indices, n)}: {message}" for message, indices in problems.items()]
    return f"{len(problems)} bad tokens, each after the prompts it was given for; fix them all:\n" + "\n".join(lines)


def spaced_id(tokenizer, word: str) -> int | None:
    """The id of ``" " + word`` when that is a single token, else None (``word``: no leading space, a letter
    first)."""
    if not word or not word[0].isalpha():
        return None
    ids = tokenizer(" " + word, add_special_tokens=False)["input_ids"]
    return int(ids[0]) if len(ids) == 1 else None


def space_warning(model, prompts, tokens, ids, role: str, rows: Sequence[int]) -> None:
    """Warn when a word is given without its leading space (``"Paris"``) where the model most likely predicts
    the spaced token (``" Paris"``); the word is attributed as given.

    The rule reads only the tokenizer: it warns when the token was given as text starting with a letter, its
    spaced form is ONE other token of the vocabulary, and the prompt does not end in whitespace (after a space
    or a newline the unspaced token is the natural one). It does not read the model's logits: they are known only
    after the trace (remotely: after the request), and a second logit read for every call would cost each call
    for the sake of a few. On SmolLM2-135M and Gemma-3-270M the unspaced word's logit ("Paris", "Rome" after three
    city prompts) is 7 to 9.5 below the spaced one's: the unspaced word is almost never what was meant. A token id never
    warns: pass ``tokenizer.convert_tokens_to_ids(...)`` to attribute the unspaced token on purpose.
    """
    tokenizer = model.tokenizer
    found: dict[tuple[str, int, int], list[int]] = {}
    spaced: dict[str, int | None] = {}
    for i, prompt, token, index in zip(rows, prompts, tokens, ids):
        if not isinstance(token, str) or not prompt or prompt[-1].isspace():
            continue
        if token not in spaced:
            spaced[token] = spaced_id(tokenizer, token)
        if spaced[token] is not None and spaced[token] != index:
            found.setdefault((token, index, spaced[token]), []).append(i)
    for (token, index, other), indices in found.items():
        where = which(indices, len(prompts)) + (" does" if len(indices) == 1 else " do")
        warnings.warn(
            f"{role} {token!r} has no leading space, but {' ' + token!r} is one token too (id {other}), the one a "
            f"model usually predicts after a word, and {where} not end in a space. "
            f"Attributing {token!r} (id {index}) as given: pass {' ' + token!r} for the spaced word, or the id "
            f"{index} to keep {token!r} without this warning",
            UserWarning, stacklevel=user_stacklevel(),
        )


def user_stacklevel() -> int:
    """The ``stacklevel`` of ``warnings.warn`` (called by the caller of this function) that names the first frame
    outside dla_recipes: the user's line."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_globals.get("__name__", "").split(".")[0] == "dla_recipes":
        frame, level = frame.f_back, level + 1
    return level


def check_length(model, lengths: Sequence[int], rows: Sequence[int] | None = None) -> None:
    """Refuse a prompt longer than the model's position table (``max_position_embeddings`` / ``n_positions``);
    ``rows``: each prompt's index in the user's list, for the message (default ``0..n-1``)."""
    config = text_config(model)
    limit = next(
        (getattr(config, name) for name in ("max_position_embeddings", "n_positions", "n_ctx")
         if isinstance(getattr(config, name, None), int) and getattr(config, name) > 0),
        None,
    )
    for i, length in zip(rows or range(len(lengths)), lengths):
        if limit is not None and length > limit:
            raise InputError(
                f"prompt {i} has {length} tokens, more than this model's {limit} positions "
                "(config max_position_embeddings): shorten it"
            )


def check_single_pass(model, seq: int, rows: Sequence[int]) -> None:
    """Refuse a forward pass of ``seq`` tokens (the padded batch of the prompts ``rows``) longer than the family's
    ``single_pass`` config value, past which the model runs it chunk by chunk (xLSTM's ``max_inference_chunksize``)."""
    config = text_config(model)
    try:
        name = family_of(config).single_pass
    except UnknownFamilyError:  # no entry: the plan refuses the model with its own error
        return
    limit = getattr(config, name, None) if name else None
    if isinstance(limit, int) and seq > limit:
        raise InputError(
            f"prompt(s) {', '.join(map(str, rows))} run {seq} tokens, more than the {limit} (config {name}) this model "
            "runs in one pass: beyond it the model runs its blocks chunk by chunk, each block once per chunk, with the "
            "recurrent state carried between chunks (in a bfloat16 cache unless use_cache is on), so no trace reads "
            "one pass of each block and its logits are not the one-pass forward's; shorten the prompts to at most "
            f"{limit} tokens or raise config.{name}"
        )


def prepare(model, prompts: str | Sequence[str], target, contrast=None, position: int = -1,
            rows: Sequence[int] | None = None) -> Batch:
    """Check and tokenize a batch; see the module docstring. ``position`` counts each prompt's own tokens.

    ``rows``: each prompt's index in the user's list (a batch of a larger call), so that errors name the prompt
    the user knows; default ``0..n-1``.
    """
    prompts = check_prompts(prompts)
    rows = list(rows) if rows is not None else list(range(len(prompts)))
    for i, prompt in zip(rows, prompts):
        if prompt == "":
            raise InputError(f"prompt {i} is empty: give it some text to attribute")
    position = check_position(position)
    encoding = tokenizer_of(model)(prompts, return_tensors="pt", padding=True)
    encoding = {"input_ids": encoding["input_ids"], "attention_mask": encoding["attention_mask"]}
    return prepare_encoding(model, encoding, target, contrast, position, prompts, rows)


def prepare_encoding(model, encoding: dict, target, contrast=None, position: int = -1, prompts=None,
                     rows: Sequence[int] | None = None) -> Batch:
    """``prepare`` for a batch already tokenized (``encoding``: ``input_ids`` and ``attention_mask``
    ``[batch, seq]``, padded on either side), e.g. the batch nnsight assembled from a trace's invokes.

    ``prompts``: the texts, for display; default: each row's tokens decoded. ``rows``: as in ``prepare``.
    """
    position = check_position(position)
    tokenizer = model.tokenizer
    ids = encoding["input_ids"]
    mask = encoding.get("attention_mask")
    mask = torch.ones_like(ids, dtype=torch.bool) if mask is None else mask.bool()
    if prompts is None:
        prompts = [tokenizer.decode(row[keep]) for row, keep in zip(ids, mask)]
    lengths = mask.sum(-1).tolist()
    rows = list(rows) if rows is not None else list(range(len(lengths)))
    check_length(model, lengths, rows)
    check_single_pass(model, int(ids.shape[1]), rows)
    positions, own_positions = [], []
    for k, (i, prompt, length) in enumerate(zip(rows, prompts, lengths)):
        if length == 0:
            raise InputError(f"prompt {i} ({prompt!r}) is empty: it has no tokens to attribute")
        own = position + length if position < 0 else position
        if not 0 <= own < length:
            raise InputError(
                f"position {position} is outside prompt {i} ({prompt!r}), which has {length} tokens: "
                f"use {-length}..{length - 1}"
            )
        token_indices = mask[k].nonzero()[:, 0]
        positions.append(int(token_indices[own]))
        own_positions.append(own)
    targets, contrasts = resolve_all(model, prompts, target, contrast, rows)
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


def offsets(batch: Batch) -> torch.Tensor:
    """``[batch]`` long: where each prompt's own tokens start in the padded sequence."""
    return batch.positions - torch.tensor(batch.own_positions, dtype=torch.long)


def groups(model, plan, prompts: list, batch_size: int | None) -> list[list[int]]:
    """The prompts' indices per forward pass: never a padded batch on a padding-unsafe family."""
    safe = plan.family.padding_safe
    lengths = [0] * len(prompts) if safe else token_lengths(model, prompts)
    return group_prompts(lengths, batch_size, safe)


def group_prompts(lengths: Sequence[int], batch_size: int | None, padding_safe: bool) -> list[list[int]]:
    """The prompts' indices, one list per forward pass, at most ``batch_size`` each (None or 0: no limit).

    ``padding_safe``: consecutive prompts in the user's order. Otherwise: prompts of one token count per batch,
    groups in the order of their first prompt, prompts in the user's order inside each. Every index appears once.
    """
    n = len(lengths)
    size = n if not batch_size else max(1, int(batch_size))
    if padding_safe:
        groups = [list(range(n))]
    else:
        by_length: dict[int, list[int]] = {}
        for i, length in enumerate(lengths):
            by_length.setdefault(int(length), []).append(i)
        groups = list(by_length.values())
    return [group[i:i + size] for group in groups for i in range(0, len(group), size)]


def token_lengths(model, prompts: Sequence[str]) -> list[int]:
    """Each prompt's own token count, as ``prepare`` tokenizes it (special tokens included)."""
    tokenizer = model.tokenizer
    if tokenizer is None:
        return [0] * len(prompts)  # prepare raises the clear error
    return [len(tokenizer(p)["input_ids"]) if isinstance(p, str) else 0 for p in prompts]
