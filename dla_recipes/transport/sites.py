"""Sites: which (prompt, position) pairs a batch attributes, and what each one attributes (its ``LinearTarget``).

``place`` turns ``position=`` (an int, a list, a slice, ``"all"``, a slice per prompt: ``args.check_position``) into
each prompt's own positions, laid out in columns: column ``k`` of a list is its ``k``-th position; of a slice (or a
prompt's own slice), the ``k``-th position the slice takes from each prompt (``"all"``: column ``k`` is own
position ``k``), so a prompt shorter than the others has its last columns masked. ``target="next"`` keeps the sites with a token after them. ``targets_of``
resolves ``target`` / ``contrast`` per site: a token (string or id), a weighted set ``{" Paris": 1.0, "Paris":
1.0}``, ``contrast="mean"``, one per prompt (a list), or one per prompt and position (``[batch, n_positions]``).
Every bad position and token of a batch is named in one ``InputError``. ``remembered``: what a tokenizer made of a
token (its id, its spaced form's), kept per tokenizer so a loop of calls asks it once.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from ..args import Position
from ..errors import InputError
from ..trace.targets import LinearTarget

CACHE = "_dla_recipes_token_ids"  # the tokenizer's attribute holding what ``remembered`` computed


def remembered(tokenizer, key: tuple, compute):
    """``compute()`` for ``key`` of this tokenizer, computed once (a raised error is not kept): a token's id
    (``batches.resolve_token``), its spaced form's (``spacing.spaced_id``), kept on the tokenizer itself as
    ``{(what, text, vocabulary size): value}`` (the size is the tokenizer's own ``len``, so a token added later is
    looked up anew). Not a module-level table: a trace sent to NDIF pickles this package's functions with their
    globals (``nnsight.register``), and a table of weak references cannot be pickled."""
    try:
        cache = vars(tokenizer).setdefault(CACHE, {})
        key = (*key, len(tokenizer))
    except TypeError:  # a tokenizer without attributes or a length: ask it every time
        return compute()
    if key not in cache:
        cache[key] = compute()
    return cache[key]


@dataclass(frozen=True)
class Placed:
    """Each site of a batch, prompt-major (every site of prompt 0 in column order, then prompt 1's, ...).

    Attributes:
        rows: each site's prompt (its row of the batch).  own: its position in the prompt's own tokens.
        columns: its column (``[batch, n_columns]`` layout).  n_columns: the columns (the result drops a column
            masked in every prompt of the call: ``target="next"`` at the last position).
        one: ``position`` was one int: one site per prompt, today's shapes.
    """

    rows: tuple[int, ...]
    own: tuple[int, ...]
    columns: tuple[int, ...]
    n_columns: int
    one: bool


def own_positions(position: Position, length: int) -> list[int | None]:
    """The prompt's own position in each column (``None``: outside the prompt) for a prompt of ``length`` tokens."""
    if isinstance(position, slice):
        return list(range(length))[position]
    values = (position,) if isinstance(position, int) else position
    owns = [p + length if p < 0 else p for p in values]
    return [o if 0 <= o < length else None for o in owns]


def place(position: Position, lengths: Sequence[int], names: Sequence[str], ids: Sequence[Sequence[int]],
          next_token: bool = False) -> Placed:
    """The sites of a batch of prompts of these ``lengths`` (``names``: ``"prompt 3 ('...')"`` for messages; ``ids``:
    each prompt's own tokens). A listed position outside a prompt raises (every one named); a slice takes what each
    prompt has. ``next_token``: keep only sites with a token after them (``target="next"``)."""
    problems, per_prompt = [], []
    spans = is_spans(position)
    if spans and len(position) != len(lengths):
        raise InputError(f"position is {len(position)} spans for {len(lengths)} prompts: give one slice per prompt")
    for b, (name, length) in enumerate(zip(names, lengths)):
        own = own_positions(position[b] if spans else position, length)
        if not isinstance(position, slice) and not spans:
            bad = [p for p, o in zip((position,) if isinstance(position, int) else position, own) if o is None]
            if bad:
                problems.append(f"position{'s' if len(bad) > 1 else ''} {', '.join(map(str, bad))} "
                                f"{'are' if len(bad) > 1 else 'is'} outside {name}, which has {length} tokens: "
                                f"use {-length}..{length - 1}")
        if next_token:
            own = [o if o is not None and o + 1 < length else None for o in own]
        per_prompt.append(own)
    if problems:
        raise InputError(problems[0] if len(problems) == 1 else
                         f"{len(problems)} prompts are too short for position={position!r}:\n  " + "\n  ".join(problems))
    if (isinstance(position, slice) or spans) and not any(any(o is not None for o in own) for own in per_prompt):
        raise InputError(f"position={position!r} takes no position of any prompt (lengths {list(lengths)})")
    if next_token:
        empty = [f"{name} ({length} token{'s' if length != 1 else ''})" for name, length, own
                 in zip(names, lengths, per_prompt) if not any(o is not None for o in own)]
        if empty:
            raise InputError(
                f"target='next' attributes each position's next token in the prompt, and {', '.join(empty)} "
                f"{'has' if len(empty) == 1 else 'have'} none "
                f"after position={position!r}: attribute earlier positions (e.g. position=slice(None, -1)) or give "
                "the target")
    width = max(len(own) for own in per_prompt)
    rows, owns, columns = [], [], []
    for b, own in enumerate(per_prompt):
        for k, o in enumerate(own):
            if o is not None:
                rows.append(b)
                owns.append(o)
                columns.append(k)
    return Placed(tuple(rows), tuple(owns), tuple(columns), width, isinstance(position, int))


def is_spans(position) -> bool:
    """Whether ``position`` (checked: ``args.check_position``) is one slice per prompt (each prompt's own span)."""
    return isinstance(position, tuple) and bool(position) and isinstance(position[0], slice)


def for_prompts(position, group: Sequence[int], n: int):
    """``position`` for the prompts ``group`` of a call of ``n``: itself, or (one span per prompt) theirs."""
    if not is_spans(position):
        return position
    if len(position) != n:
        raise InputError(f"position is {len(position)} spans for {n} prompts: give one slice per prompt")
    return tuple(position[i] for i in group)


Spec = str | int | dict  # one site's target: a token, or {token: weight}


def per_site(value, placed: Placed, n_prompts: int, role: str, columns_given: int) -> list:
    """``value`` as one spec per site: one for all, one per prompt (a list of ``n_prompts``), or one per prompt and
    column (``[n_prompts, columns_given]``: a nested list, a 2-D tensor or array)."""
    if isinstance(value, torch.Tensor) or type(value).__module__ == "numpy" and hasattr(value, "ndim"):
        if value.ndim == 2:
            value = value.tolist()
        elif value.ndim >= 1:
            value = value.reshape(-1).tolist()
        else:
            value = value.item() if isinstance(value, torch.Tensor) else value
    if isinstance(value, (list, tuple)):
        if value and all(isinstance(v, (list, tuple)) for v in value):  # [prompts, positions]
            # a batch of a larger call may have fewer columns than the call (check_grid checks the call's)
            if len(value) != n_prompts or any(len(v) < columns_given for v in value):
                raise InputError(
                    f"{role} is a grid of {len(value)} x {[len(v) for v in value][:4]}: a {role} per prompt and position "
                    f"is [batch, n_positions] = [{n_prompts}, {columns_given}] (the positions as position= lists them)")
            return [value[b][c] for b, c in zip(placed.rows, placed.columns)]
        if len(value) == 1:
            value = list(value) * n_prompts
        if len(value) != n_prompts:
            raise InputError(f"{len(value)} {role} tokens for {n_prompts} prompts: give one for all or one per prompt")
        return [value[b] for b in placed.rows]
    return [value] * len(placed.rows)


def weighted(spec, role: str) -> list[tuple[object, float]]:
    """A spec as ``[(token, weight)]``: a token with weight 1, or a ``{token: weight}`` dict (weights are finite
    real numbers; a dict may not be empty)."""
    if not isinstance(spec, Mapping):
        return [(spec, 1.0)]
    if not spec:
        raise InputError(f"{role} is an empty dict: give at least one {{token: weight}}")
    out = []
    for token, weight in spec.items():
        if isinstance(weight, bool) or not isinstance(weight, numbers.Real) or not math.isfinite(float(weight)):
            raise InputError(f"{role} {{{token!r}: {weight!r}}}: a weight must be a finite number, e.g. 1.0")
        out.append((token, float(weight)))
    return out


def describe(spec, resolved: list[tuple[int, float]], decode) -> str:
    """A site's target as text: the token (``" Paris"``) or the weighted set (``"1*' Paris' + 1*'Paris'"``)."""
    if not isinstance(spec, Mapping):
        return decode([resolved[0][0]])
    return " + ".join(f"{w:g}*{decode([t])!r}" for t, w in resolved)


class Spelling(NamedTuple):
    """How a batch's tokens are read: ``resolve(token, role) -> id`` (raises ``InputError``) and ``decode(ids) ->
    text``."""

    resolve: Callable
    decode: Callable


def targets_of(spelling: Spelling, placed: Placed, rows: Sequence[int], target, contrast,
               next_ids: list[int] | None = None):
    """``(LinearTarget over the sites, target texts, contrast texts or None)`` for the batch's ``len(rows)``
    prompts, ``target`` and ``contrast`` given per prompt and column as ``placed.n_columns`` columns.

    ``spelling.resolve`` raises ``InputError``; every bad token is collected, with its prompts (each site's prompt
    as the user numbers it: ``rows[b]`` for row ``b``), and raised in one error. ``next_ids``: each site's next
    token (``target="next"``).
    """
    resolve, decode = spelling
    n_prompts, columns_given = len(rows), placed.n_columns
    user = [rows[b] for b in placed.rows]  # each site's prompt, as the user numbers it
    problems: dict[str, list[int]] = {}
    cache: dict = {}

    def resolved_specs(specs, role):
        out = []
        for b, spec in zip(user, specs):
            try:
                pairs = []
                for token, weight in weighted(spec, role):
                    key = (token, type(token)) if isinstance(token, (str, int)) else None
                    if key is None or key not in cache:
                        value = resolve(token, role)
                        if key is None:
                            pairs.append((value, weight))
                            continue
                        cache[key] = value
                    pairs.append((cache[key], weight))
                out.append(pairs)
            except InputError as error:
                indices = problems.setdefault(str(error), [])
                if b not in indices:
                    indices.append(b)
                out.append([(0, 0.0)])
        return out

    t_specs = [int(i) for i in next_ids] if next_ids is not None else per_site(target, placed, n_prompts, "target",
                                                                                 columns_given)
    targets = resolved_specs(t_specs, "target")
    mean = isinstance(contrast, str) and contrast == "mean"
    contrasts = None
    if contrast is not None and not mean:
        c_specs = per_site(contrast, placed, n_prompts, "contrast", columns_given)
        contrasts = resolved_specs(c_specs, "contrast")
    if problems:
        raise InputError(token_problems(problems, n_prompts))
    pairs = [t + ([(i, -w) for i, w in contrasts[s]] if contrasts is not None else []) for s, t in enumerate(targets)]
    width = max(len(p) for p in pairs)
    ids = torch.zeros(len(pairs), width, dtype=torch.long)
    weights = torch.zeros(len(pairs), width)
    for s, p in enumerate(pairs):
        ids[s, :len(p)] = torch.tensor([i for i, _ in p])
        weights[s, :len(p)] = torch.tensor([w for _, w in p])
    linear = LinearTarget(ids, weights, torch.full((len(pairs),), 1.0 if mean else 0.0))
    target_texts = tuple(describe(spec, r, decode) for spec, r in zip(t_specs, targets))
    contrast_texts = None
    if mean:
        contrast_texts = ("mean",) * len(pairs)
    elif contrasts is not None:
        contrast_texts = tuple(describe(spec, r, decode) for spec, r in zip(c_specs, contrasts))
    return linear, target_texts, contrast_texts


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


def for_group(value, group: Sequence[int], n: int):
    """``value``'s entries for the prompts of ``group`` when it has one per prompt (a list / tuple / array / tensor
    of ``n``), else ``value`` itself (one for all: a token, a weighted set, ``"next"``, ``"mean"``)."""
    if isinstance(value, (str, dict)) or value is None:
        return value
    if isinstance(value, (list, tuple)) and len(value) == n:
        return [value[i] for i in group]
    if getattr(value, "ndim", 0) >= 1 and len(value) == n:  # an array / tensor stays one: [group(, n_positions)]
        return value[list(group)]
    return value


def check_grid(value, batches, role: str) -> None:
    """A ``role`` given per prompt and position (a nested list, a 2-D tensor or array) has the whole call's
    ``n_positions`` columns (each batch reads the columns of its own prompts: a batch of shorter prompts fewer)."""
    if getattr(value, "ndim", 0) == 2:
        widths = {int(value.shape[1])}
    elif isinstance(value, (list, tuple)) and value and all(isinstance(v, (list, tuple)) for v in value):
        widths = {len(v) for v in value}
    else:
        return
    width = max(b.n_columns for b in batches)
    if widths != {width}:
        raise InputError(f"{role} is a grid of {len(value)} x {sorted(widths)}: a {role} per prompt and position is "
                         f"[batch, n_positions] = [{len(value)}, {width}] (the positions as position= lists them)")
