"""Batches: prompts tokenized once with the model's tokenizer, targets resolved, positions placed, groups formed.

``prepare`` checks and tokenizes one batch (as nnsight pads: the model's tokenizer and padding side), so the
positions computed here are the positions the model sees; ``prepare_encoding`` does the same for a batch already
tokenized (the one nnsight assembled from a trace's invokes). Everything that depends on the model's vocabulary or
its prompts' lengths is checked here with an ``InputError``: a target that is several tokens or not in the
vocabulary, a position outside a prompt, a prompt longer than the model's positions.

Which prompts share a forward pass (``group_prompts``): on most families left padding leaves a prompt's logits
unchanged, so prompts are batched in the user's order, ``batch_size`` at a time. On a family with
``padding_safe=False`` (a recurrent state or a router that reads the pad tokens: RecurrentGemma, DeepSeek-V4) a
padded prompt would be attributed as the padded batch computes it, not as the prompt alone; there prompts are
grouped by token count, so no batch is padded (the result puts the rows back in the user's order).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..args import as_index, check_position, check_prompts, check_text, per_prompt
from ..errors import InputError
from ..families import text_config

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


def check_length(model, lengths: Sequence[int]) -> None:
    """Refuse a prompt longer than the model's position table (``max_position_embeddings`` / ``n_positions``)."""
    config = text_config(model)
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
