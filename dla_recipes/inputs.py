"""Client-side input preparation: prompts, target tokens and positions checked and turned into tensors.

Everything a user can get wrong is caught here, before any forward pass, with an error that names the problem:
an empty prompt, a target that is several tokens or not in the vocabulary, a position outside a prompt, mismatched
batch sizes. The prompts are tokenized once, here, with the model's tokenizer and padding side (as nnsight pads),
and the encoding is what the trace runs on, so the positions computed here are the positions the model sees.
"""

from __future__ import annotations

from dataclasses import dataclass
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


def resolve_token(model, token: Token, role: str = "target") -> int:
    """The id of one token given as a string (``" Paris"``) or an id; raises ``InputError`` naming the problem."""
    tokenizer = model.tokenizer
    vocab = _vocab_size(model)
    if isinstance(token, bool) or not isinstance(token, (str, int)) and not (
        isinstance(token, torch.Tensor) and token.numel() == 1
    ):
        raise InputError(f"{role} must be a token string or a token id, not {type(token).__name__}: {token!r}")
    if isinstance(token, torch.Tensor):
        token = int(token)
    if isinstance(token, int):
        if not 0 <= token < vocab:
            raise InputError(f"{role} token id {token} is not in the vocabulary (ids 0..{vocab - 1})")
        return token
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
    """``value`` as one entry per prompt: a list of ``n``, or a single token repeated ``n`` times."""
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise InputError(f"{len(value)} {role} tokens for {n} prompts: give one for all or one per prompt")
        return list(value)
    if isinstance(value, torch.Tensor) and value.numel() > 1:
        if value.numel() != n:
            raise InputError(f"{value.numel()} {role} tokens for {n} prompts: give one for all or one per prompt")
        return [int(v) for v in value.flatten()]
    return [value] * n


def prepare(model, prompts: str | Sequence[str], target, contrast=None, position: int = -1) -> Batch:
    """Check and tokenize a batch; see the module docstring. ``position`` counts each prompt's own tokens."""
    if isinstance(prompts, str):
        prompts = [prompts]
    prompts = list(prompts)
    if not prompts:
        raise InputError("no prompts given: pass a string or a non-empty list of strings")
    for i, prompt in enumerate(prompts):
        if not isinstance(prompt, str):
            raise InputError(f"prompt {i} is a {type(prompt).__name__}, not a string")
        if prompt == "":
            raise InputError(f"prompt {i} is empty: give it some text to attribute")
    if isinstance(position, bool) or not isinstance(position, int):
        raise InputError(f"position must be an int (negative counts from the end of each prompt), not {position!r}")
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
    if isinstance(position, bool) or not isinstance(position, int):
        raise InputError(f"position must be an int (negative counts from the end of each prompt), not {position!r}")
    tokenizer = model.tokenizer
    ids = encoding["input_ids"]
    mask = encoding.get("attention_mask")
    mask = torch.ones_like(ids, dtype=torch.bool) if mask is None else mask.bool()
    if prompts is None:
        prompts = [tokenizer.decode(row[keep]) for row, keep in zip(ids, mask)]
    lengths = mask.sum(-1).tolist()
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
