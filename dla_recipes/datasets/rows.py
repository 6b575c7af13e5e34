"""Reading a dataset in chunks of rows, each row checked: what ``attribute_dataset`` attributes.

A dataset is a list of dicts, a pandas ``DataFrame``, a Hugging Face ``datasets.Dataset`` (recognised by its
``column_names`` and ``iter(batch_size=)``; the library is never imported here) or any iterable of dicts (a
generator is read as it goes: nothing holds the whole dataset). Rows are numbered in the order they are read,
``0, 1, ...`` (a DataFrame's rows by position, not by its index).

Where a value comes from (``Column`` / ``Same``, ``spec``): ``prompt=`` is always a column; ``target=`` and
``contrast=`` are a column when given as a string (``target="answer"``), except the keywords ``"next"`` (target)
and ``"mean"`` (contrast), which mean what they mean in ``attribute``; anything else (a token id, a weighted set
``{tok: w}``, ``None``) is the same for every row, and so is ``Same(" Paris")`` (a token string for every row).
``Column("next")`` reads a column named like a keyword.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

from ..errors import InputError

SHOWN = 12  # problems listed in one error; the rest are counted


@dataclass(frozen=True)
class Column:
    """Read the value of each row from the data's column ``name``."""

    name: str


@dataclass(frozen=True)
class Same:
    """The same ``value`` for every row (a token string, a token id, a weighted set, ``"next"``, ``"mean"``, None)."""

    value: object


def spec(value, role: str, keywords: tuple[str, ...] = ()) -> Column | Same:
    """``value`` as a ``Column`` or a ``Same`` (the rule of the module docstring)."""
    if isinstance(value, (Column, Same)):
        return value
    if isinstance(value, str) and value not in keywords:
        return Column(value)
    return Same(value)


@dataclass(frozen=True)
class Source:
    """A dataset to read: ``blocks(size)`` yields lists of row dicts in order; ``total`` its row count when known,
    ``columns`` its column names when known, ``reiterable`` whether reading it again gives the same rows again."""

    data: object
    kind: str  # "records", "frame", "hf", "iterable"
    total: int | None
    columns: tuple[str, ...] | None
    reiterable: bool

    def blocks(self, size: int) -> Iterator[list]:
        if self.kind == "frame":
            for start in range(0, len(self.data), size):
                yield self.data.iloc[start:start + size].to_dict("records")
        elif self.kind == "hf":
            for batch in self.data.iter(batch_size=size):
                names = list(batch)
                yield [dict(zip(names, values)) for values in zip(*(batch[n] for n in names))]
        else:
            block = []
            for item in self.data:
                block.append(item)
                if len(block) == size:
                    yield block
                    block = []
            if block:
                yield block


def source(data) -> Source:
    """What ``data`` is (the module docstring), or an ``InputError`` saying what a dataset can be."""
    usage = ("give a list of dicts, a pandas DataFrame, a Hugging Face datasets.Dataset or an iterable of dicts "
             "(one dict a row)")
    if data is None or isinstance(data, (str, bytes, Mapping)):
        what = "a dict (of columns?)" if isinstance(data, Mapping) else repr(data)[:40]
        raise InputError(f"data is {what}: {usage}")
    try:
        import pandas as pd
    except ImportError:  # pragma: no cover (pandas is a dependency)
        pd = None
    if pd is not None and isinstance(data, pd.DataFrame):
        return Source(data, "frame", len(data), tuple(str(c) for c in data.columns), True)
    if hasattr(data, "column_names") and callable(getattr(data, "iter", None)):
        names = data.column_names
        total = len(data) if hasattr(data, "__len__") else None
        return Source(data, "hf", total, tuple(names) if names is not None else None, True)
    if isinstance(data, (list, tuple)):
        return Source(data, "records", len(data), None, True)
    if not isinstance(data, Iterable):
        raise InputError(f"data is a {type(data).__name__}: {usage}")
    return Source(data, "iterable", None, None, iter(data) is not data)


@dataclass(frozen=True)
class Chunk:
    """Checked rows: ``rows`` the data's indices, and per row its ``prompts``, ``targets``, ``contrasts``."""

    rows: list[int]
    prompts: list
    targets: list
    contrasts: list
    versus: list | None = None  # compare=Versus(prompt=...): each row's second prompt


def chunks(src: Source, size: int, specs: dict, skip: Mapping[int, str] | None = None) -> Iterator[Chunk]:
    """The rows of ``src`` not in ``skip``, ``size`` at a time, each chunk checked (``check``); ``specs``:
    ``{"prompt": Column, "target": Column | Same, "contrast": Column | Same}`` (and ``"versus"``: a second prompt
    column). A skipped row whose prompt is text
    must be the prompt ``skip`` holds for it (the data read in the same order as the run that wrote it)."""
    missing = [s.name for s in specs.values() if isinstance(s, Column)
               and src.columns is not None and s.name not in src.columns]
    if missing:
        raise InputError(f"the data has no column {', '.join(map(repr, missing))}: its columns are "
                         f"{list(src.columns)} (a plain string names a column; the same token string for every row "
                         f"is dla_recipes.datasets.Same({missing[0]!r}))")
    skip = skip or {}
    pending: list[tuple[int, object]] = []
    index = 0
    for block in src.blocks(size):
        for row in block:
            if index in skip:
                was = skip[index]
                now = row.get(specs["prompt"].name) if isinstance(row, Mapping) else None
                if was is not None and isinstance(now, str) and now != was:
                    raise InputError(f"row {index}'s prompt is {now[:60]!r}, but the rows already written hold "
                                     f"{was[:60]!r} there: the data is not read in the same order as the run that "
                                     "wrote them (resuming needs the same rows in the same order), or give a new out=")
            else:
                pending.append((index, row))
            index += 1
            if len(pending) == size:
                yield check(pending, specs)
                pending = []
    if pending:
        yield check(pending, specs)
    beyond = [i for i in skip if i >= index]
    if beyond:  # the rows already written came from longer data: returning them as this data's would be wrong
        raise InputError(f"the data has {index} row(s), but the rows already written hold row(s) up to "
                         f"{max(beyond)}: they were written from other data. Give the same data to resume, or a new "
                         "out=")


def check(pending: list[tuple[int, object]], specs: dict) -> Chunk:
    """``pending`` ``[(row index, row)]`` read into a ``Chunk``, or ONE ``InputError`` naming every bad row and
    column of it."""
    problems: list[str] = []
    out: dict[str, list] = {role: [] for role in specs}
    for index, row in pending:
        if not isinstance(row, Mapping):
            problems.append(f"row {index}: a {type(row).__name__}, not a dict of columns")
            continue
        for role, how in specs.items():
            if isinstance(how, Same):
                out[role].append(how.value)
                continue
            if how.name not in row:
                problems.append(f"row {index}: no column {how.name!r} (it has {sorted(map(str, row))})")
                continue
            value, why = (prompt_value if role in ("prompt", "versus") else token_value)(row[how.name])
            if why:
                problems.append(f"row {index}, column {how.name!r}: {why}")
            out[role].append(value)
    if problems:
        more = f"\n  ... and {len(problems) - SHOWN} more" if len(problems) > SHOWN else ""
        raise InputError(f"{len(problems)} malformed value(s) in rows {pending[0][0]}..{pending[-1][0]} of the data:\n  "
                         + "\n  ".join(problems[:SHOWN]) + more)
    return Chunk([i for i, _ in pending], out["prompt"], out["target"], out["contrast"], out.get("versus"))


def short(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:39] + "…"


def is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def prompt_value(value) -> tuple[object, str]:
    """``(prompt, "")``: a non-empty string, a non-empty list of token ids or a conversation (a list of
    ``{"role", "content"}`` dicts); else ``(None, why)``."""
    if isinstance(value, str):
        return (value, "") if value.strip() else (None, f"an empty prompt ({value!r})")
    if hasattr(value, "tolist") and not isinstance(value, (list, tuple)):
        value = value.tolist()  # a numpy array / tensor of ids (a Dataset's or DataFrame's token column)
    if isinstance(value, (list, tuple)) and value and all(is_int(v) for v in value):
        return [int(v) for v in value], ""
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, Mapping) and "role" in v for v in value):
        return [dict(v) for v in value], ""  # a conversation: chat messages (attribute_dataset(generate=...))
    what = "an empty list" if isinstance(value, (list, tuple)) and not value else f"a {type(value).__name__}"
    return None, f"{what} ({short(value)}), not a prompt: give a string or a list of token ids"


def token_value(value) -> tuple[object, str]:
    """``(token, "")``: a non-empty token string, a token id, or a weighted set ``{token: weight}``; else
    ``(None, why)`` (an empty value, a float, anything else)."""
    if isinstance(value, str):
        return (value, "") if value else (None, "an empty target ('')")
    if is_int(value):
        return int(value), ""
    if isinstance(value, Mapping) and value:
        return dict(value), ""
    if value is None or isinstance(value, float) and math.isnan(value):
        return None, "empty (None / NaN): every row needs its token"
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return None, (f"a float ({value!r}), not a token: give a token string (' Paris') or a token id (an int); "
                      "a column of floats is not a target")
    return None, f"a {type(value).__name__} ({short(value)}), not a token string or a token id"
