"""Batches: prompts tokenized once with the model's tokenizer, targets resolved, positions placed, groups formed.

``prepare`` checks and tokenizes one batch (as nnsight pads: the model's tokenizer and padding side), so the
positions computed here are the positions the model sees; ``prepare_encoding`` does the same for a batch already
tokenized (the one nnsight assembled from a trace's invokes). Everything that depends on the model's vocabulary or
its prompts' lengths is checked here with an ``InputError``: a target that is several tokens or not in the
vocabulary, a position outside a prompt, a prompt longer than the model's positions, a batch longer than the model
runs in one pass (``check_single_pass``). Every bad target and contrast of a call is named in one error, with its
prompt's index (``resolve_all``); a word given without the leading space the model most likely predicts is
attributed as given, with a warning (``spacing.space_warning``).

Which prompts share a forward pass (``group_prompts``): on most families left padding leaves a prompt's logits
unchanged, so prompts are batched in the user's order, ``batch_size`` at a time. On a family with
``padding_safe=False`` (a recurrent state or a router that reads the pad tokens: RecurrentGemma, DeepSeek-V4) a
padded prompt would be attributed as the padded batch computes it, not as the prompt alone; there prompts are
grouped by token count, so no batch is padded (the result puts the rows back in the user's order).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from ..args import as_index, check_position, check_prompts, check_text, per_prompt
from ..errors import InputError, UnknownFamilyError
from ..families import family_of, text_config
from ..trace.targets import LinearTarget
from .sites import Spelling, place, remembered, targets_of, token_problems, which
from .spacing import space_warning, spaced_id

Token = str | int


@dataclass(frozen=True)
class Batch:
    """A checked batch: its prompts padded into one encoding, and its sites (``transport.sites``), prompt-major.

    Attributes:
        prompts: the prompts as text (token-id prompts decoded), one per prompt.
        encoding: ``{"input_ids", "attention_mask"}`` ``[batch, seq]``, padded on the tokenizer's side.
        positions: ``[n]`` long, each site's position as an index into the padded sequence.
        own_positions: each site's position in its prompt's own tokens (``0..length-1``).
        targets: the ``LinearTarget`` of each site (a contrast folded in; ``contrasts`` is then None).
        contrasts: None (kept for the in-trace call's signature).
        target_tokens, contrast_tokens: each site's target and contrast as text (``" Paris"``, ``"mean"``).
        lengths: each prompt's own token count.
        rows: ``[n]`` long, each site's prompt (its row of the batch).  columns: each site's column.
        n_columns: the columns of the ``[batch, n_positions]`` layout.  one: one int position (today's shapes).
        ids: each prompt's own token ids.
    """

    prompts: tuple[str, ...]
    encoding: dict
    positions: torch.Tensor
    own_positions: tuple[int, ...]
    targets: object
    contrasts: torch.Tensor | None
    target_tokens: tuple[str, ...]
    contrast_tokens: tuple[str, ...] | None
    lengths: tuple[int, ...]
    rows: torch.Tensor | None = None
    columns: tuple[int, ...] = ()
    n_columns: int = 1
    one: bool = True
    ids: tuple[tuple[int, ...], ...] = ()

    @property
    def site_prompts(self) -> tuple[str, ...]:
        """Each site's prompt text."""
        return tuple(self.prompts[b] for b in self.rows.tolist())  # one read of the host tensor, not one per site


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
    ids = remembered(tokenizer, ("ids", token), lambda: list(tokenizer(token, add_special_tokens=False)["input_ids"]))
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
    dataset is fixed in one pass, not one error per run. A good but unspaced word gets a warning (``spacing.space_warning``).
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


class Group(NamedTuple):
    """A batch of a larger call: ``rows``, each prompt's index in the user's list (errors name the prompt the user
    knows; None: ``0..n-1``), and ``ids``, each prompt's own token ids already tokenized (``token_ids``, or an
    earlier batch's ``Batch.ids``: padded, not tokenized again; None: tokenized here)."""

    rows: Sequence[int] | None = None
    ids: Sequence[Sequence[int]] | None = None


def prepare(model, prompts, target, contrast=None, position=-1, group: Group | None = None) -> Batch:
    """Check and tokenize a batch; see the module docstring. ``position`` counts each prompt's own tokens
    (``args.check_position``: an int, a list, a slice, ``"all"``); ``prompts`` are texts or token ids
    (``args.check_prompts``).

    ``group``: the batch's place in a larger call (``Group``: the user's index of each prompt, and its ids when
    already tokenized as this function would).
    """
    rows, ids = group if group is not None else (None, None)
    prompts = check_prompts(prompts)
    rows = list(rows) if rows is not None else list(range(len(prompts)))
    for i, prompt in zip(rows, prompts):
        if len(prompt) == 0:
            raise InputError(f"prompt {i} is empty: give it some text to attribute")
    position = check_position(position)
    tokenizer = tokenizer_of(model)
    if ids is not None and all(isinstance(p, str) for p in prompts):  # tokenized once already: pad them
        encoding = tokenizer.pad({"input_ids": [list(i) for i in ids]}, return_tensors="pt", padding=True)
        texts = prompts
    elif all(isinstance(p, str) for p in prompts):
        encoding = tokenizer(prompts, return_tensors="pt", padding=True)
        texts = prompts
    else:  # token ids, as given (a text among them is tokenized as nnsight would)
        lists = [list(p) if not isinstance(p, str) else tokenizer(p)["input_ids"] for p in prompts]
        vocab = vocab_size(model)
        bad = [i for i, ids in zip(rows, lists) if any(not 0 <= t < vocab for t in ids)]
        if bad:
            raise InputError(f"{which(bad, len(prompts))}: token ids outside the vocabulary (ids 0..{vocab - 1})")
        encoding = tokenizer.pad({"input_ids": lists}, return_tensors="pt", padding=True)
        texts = [p if isinstance(p, str) else tokenizer.decode(list(p)) for p in prompts]
    encoding = {"input_ids": encoding["input_ids"], "attention_mask": encoding["attention_mask"]}
    return prepare_encoding(model, encoding, target, contrast, position, Known(texts, rows))


class Known(NamedTuple):
    """A batch's prompts as the user knows them: ``prompts`` (the texts, for display; None: each row's tokens
    decoded) and ``rows`` (each prompt's index in the user's list, as in ``prepare``; None: ``0..n-1``)."""

    prompts: Sequence | None = None
    rows: Sequence[int] | None = None


def prepare_encoding(model, encoding: dict, target, contrast=None, position=-1, known: Known | None = None) -> Batch:
    """``prepare`` for a batch already tokenized (``encoding``: ``input_ids`` and ``attention_mask``
    ``[batch, seq]``, padded on either side), e.g. the batch nnsight assembled from a trace's invokes.

    ``known``: the prompts' texts and the user's numbering of them (``Known``; default: decoded, ``0..n-1``).
    """
    prompts, rows = known or Known()
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
    for i, prompt, length in zip(rows, prompts, lengths):
        if length == 0:
            raise InputError(f"prompt {i} ({prompt!r}) is empty: it has no tokens to attribute")
    own_ids = [tuple(row[keep].tolist()) for row, keep in zip(ids, mask)]  # one conversion a row, not one a token
    next_token = isinstance(target, str) and target == "next"
    names = [f"prompt {i} ({short_text(p)})" for i, p in zip(rows, prompts)]
    placed = place(position, lengths, names, own_ids, next_token)
    padded = [mask[k].nonzero()[:, 0].tolist() for k in range(len(lengths))]
    positions = [padded[b][own] for b, own in zip(placed.rows, placed.own)]
    next_ids = [own_ids[b][own + 1] for b, own in zip(placed.rows, placed.own)] if next_token else None
    if placed.one and plain(target) and plain(contrast):
        targets, contrasts = resolve_all(model, prompts, target, contrast, rows)  # one site per prompt: as before
        linear = LinearTarget.tokens(torch.tensor(targets), None if contrasts is None else torch.tensor(contrasts))
        target_texts = tuple(tokenizer.decode([t]) for t in targets)
        contrast_texts = None if contrasts is None else tuple(tokenizer.decode([t]) for t in contrasts)
    else:
        spelling = Spelling(lambda token, role: resolve_token(model, token, role), tokenizer.decode)
        linear, target_texts, contrast_texts = targets_of(spelling, placed, rows, target, contrast, next_ids)
    return Batch(
        prompts=tuple(prompts),
        encoding=encoding,
        positions=torch.tensor(positions, dtype=torch.long),
        own_positions=placed.own,
        targets=linear,
        contrasts=None,
        target_tokens=target_texts,
        contrast_tokens=contrast_texts,
        lengths=tuple(int(n) for n in lengths),
        rows=torch.tensor(placed.rows, dtype=torch.long),
        columns=placed.columns,
        n_columns=placed.n_columns,
        one=placed.one,
        ids=tuple(own_ids),
    )


def plain(value) -> bool:
    """Whether a target / contrast is tokens only: one, or one per prompt (no weighted set, no ``"mean"``, no
    ``[batch, n_positions]`` grid): then one site per prompt is resolved as ``resolve_all`` does."""
    if isinstance(value, Mapping) or isinstance(value, str) and value in ("mean", "next"):
        return False
    if isinstance(value, torch.Tensor) or type(value).__module__ == "numpy" and hasattr(value, "ndim"):
        return value.ndim <= 1
    if isinstance(value, (list, tuple)):
        return not any(isinstance(v, (Mapping, list, tuple)) for v in value)
    return True


def short_text(text: str, width: int = 30) -> str:
    """``repr(text)``, cut to about ``width`` characters."""
    return repr(text) if len(text) <= width else repr(text[: width - 1] + "…")


def offsets(batch: Batch) -> torch.Tensor:
    """``[n]`` long: where each site's prompt's own tokens start in the padded sequence."""
    return batch.positions - torch.tensor(batch.own_positions, dtype=torch.long)


def groups(model, plan, prompts: list, batch_size: int | None, ids: Sequence | None = None) -> list[list[int]]:
    """The prompts' indices per forward pass: never a padded batch on a padding-unsafe family (grouped by the
    length of ``ids``, each prompt's token ids, ``token_ids``: tokenized here when not given)."""
    safe = plan.family.padding_safe
    ids = None if safe else token_ids(model, plan, prompts) if ids is None else ids
    lengths = [len(i) for i in ids] if ids is not None else [0] * len(prompts)
    return group_prompts(lengths, batch_size, safe)


def token_ids(model, plan, prompts: Sequence, every: bool = False) -> list[list[int]] | None:
    """Each prompt's own token ids as ``prepare`` tokenizes it, in ONE tokenizer call, on a padding-unsafe family
    (``every``: on any family): grouped by length (``groups``), then padded into each batch (``prepare(..., Group(rows, ids))``).
    None on a padding-safe family (each batch is tokenized once, in ``prepare``) or without a tokenizer."""
    tokenizer = model.tokenizer
    if (plan.family.padding_safe and not every) or tokenizer is None:
        return None
    texts = [p for p in prompts if isinstance(p, str)]
    encoded = iter(tokenizer(texts)["input_ids"] if texts else [])
    return [list(next(encoded)) if isinstance(p, str) else list(p) for p in prompts]


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

