"""``attribute_dataset``: a dataset, not a prompt, attributed chunk by chunk: rows in memory, to a Parquet
directory as each chunk finishes (resumable), or reduced to statistics.

    rows = [{"prompt": "When Mary and John went to the store, John gave a drink to", "target": " Mary"}, ...]
    attr = dla_recipes.attribute_dataset(model, rows, by="head")                       # an Attribution
    dla_recipes.attribute_dataset(model, frame, target="answer", out="runs/ioi.parquet")  # pandas.read_parquet it
    stats = dla_recipes.attribute_dataset(model, hf_dataset, reduce="stats")          # an AttributionStats

The data is read ``batch_size`` rows at a time (``rows``: a list of dicts, a DataFrame, a Hugging Face
``Dataset`` or any iterable of dicts), each chunk checked (every bad row and column of it in one ``InputError``; a
generator is checked as it is read, so the chunks before a bad one have run) and attributed by one
``attribute(...)`` call, exactly as ``attribute`` attributes those prompts. With ``out=`` each chunk's rows become
one Parquet part (``present.parquet``); a run killed or stopped by a remote failure and called again with the same
``out=`` (and the same data, in the same order) skips the rows already written, so the directory ends with the rows
of one uninterrupted run.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from ..api import attribute
from ..args import check_batch_size
from ..errors import InputError, RemoteError
from ..loading.load import as_standardized
from ..plan import build_plan
from ..present import parquet
from ..transport.remote import RemoteBatchError, is_transient
from . import rows as data_rows
from .rows import Column, Same

REDUCE = (None, "sum", "stats")

__all__ = ["Column", "Same", "attribute_dataset"]


def attribute_dataset(model, data, *, prompt="prompt", target="target", contrast=None, by="block", position=-1,
                      reduce=None, out=None, batch_size: int = 32, remote=False, progress: bool | None = None,
                      intervene=None, tolerance: float | None = None, **stats):
    """Attribute every row of ``data``: its ``prompt`` column's prompt, its target (minus its contrast), in chunks
    of ``batch_size`` rows, one ``attribute`` call a chunk (one forward pass; ``remote``: one request).

    Args:
        data: a list of dicts, a pandas ``DataFrame`` (rows by position), a Hugging Face ``datasets.Dataset`` or
            any iterable of dicts (a generator is streamed: only one chunk is held at a time).
        prompt: the column holding each row's prompt: a string or a list of token ids.
        target: a column name (each row's token string or token id), or one value for every row: the keywords
            ``"next"``, a token id, a weighted set ``{tok: w}``, ``None`` (the model's top token), or
            ``Same(" Paris")`` for a token string (a plain string names a column; ``Column("next")`` reads a
            column named like the keyword).
        contrast: as ``target`` (its keyword: ``"mean"``); default none.
        by, position, remote, intervene, tolerance: as in ``attribute``.
        reduce: ``None`` (one row a prompt, or a site with several positions), ``"sum"`` (each prompt's positions
            summed, as ``attribute``) or ``"stats"`` (``attribute(..., reduce="stats")`` a chunk, merged:
            ``**stats`` are its options).
        out: a directory (``"runs/ioi.parquet"``): the rows are written there chunk by chunk (``present.parquet``
            names the columns) and the path is returned; ``pandas.read_parquet(out)`` reads them in row order. A
            directory an earlier call wrote is resumed (its rows skipped) when the call is the same (model, by,
            position, reduce, columns, contrast), else an ``InputError``. Without ``out`` the rows come back as one
            ``Attribution`` / ``PositionAttribution`` (fine for data that fits in memory).
        batch_size: rows a chunk (and a forward pass).
        progress: a progress bar of prompts (their rate, the time left when the size is known); default: when
            there is more than one chunk.

    Raises:
        InputError: a malformed chunk (naming each row and column), a missing column, a resumed ``out`` written
            by another call, or data not in the order the resumed rows were written in.
        RemoteBatchError: a remote chunk failed after its retries: the parts written so far stay (``.done``: the
            rows in ``out``; ``.resume()`` where the failure was transient and the data can be read again), and the
            message says to call again with the same ``out=``.
    """
    if reduce not in REDUCE:
        raise InputError(f"reduce={reduce!r}: use None (one row a prompt), 'sum' (each prompt's positions summed) or "
                         "'stats' (statistics over the rows)")
    if stats and reduce != "stats":
        raise InputError(f"{', '.join(sorted(stats))}: options of reduce='stats' only")
    if batch_size is None:
        raise InputError("batch_size=None: attribute_dataset reads the data in chunks of batch_size rows; give an int")
    batch_size = check_batch_size(batch_size)
    if not isinstance(prompt, (str, Column)):
        raise InputError(f"prompt={prompt!r}: give the name of the column holding the prompts")
    specs = {"prompt": data_rows.spec(prompt, "prompt"), "target": data_rows.spec(target, "target", ("next",)),
             "contrast": data_rows.spec(contrast, "contrast", ("mean",))}
    src = data_rows.source(data)
    model = as_standardized(model)
    call = {"by": by, "position": position, "remote": remote, "intervene": intervene, "tolerance": tolerance}
    if reduce == "stats":
        return over_stats(model, src, specs, call, batch_size, progress, out, stats)
    if out is None:  # everything in memory: one attribute call, batched as attribute batches
        chunks = list(data_rows.chunks(src, batch_size, specs))
        if not chunks:
            raise InputError("the data has no rows")
        whole = data_rows.Chunk(*([v for c in chunks for v in getattr(c, f)] for f in ("rows", "prompts", "targets",
                                                                                      "contrasts")))
        return attribute(model, whole.prompts, **values_of(whole, specs), batch_size=batch_size, progress=progress,
                         reduce=reduce, **call)
    parts = parquet.Parts(out)
    parts.start(meta_of(model, specs, call, reduce))
    done = parts.done()
    bar = Bar(progress, src.total, batch_size, len(done), f"DLA by {by}")
    written: list[int] = []
    try:
        for k, chunk in enumerate(data_rows.chunks(src, batch_size, specs, skip=done)):
            bar.begin(k)
            try:
                attr = attribute(model, chunk.prompts, **values_of(chunk, specs), batch_size=batch_size,
                                 progress=False, reduce=reduce, **call)
            except RemoteError as error:
                raise stopped(error, k, sorted([*done, *written]), out, src,
                              lambda: attribute_dataset(model, data, prompt=prompt, target=target, contrast=contrast,
                                                        reduce=reduce, out=out, batch_size=batch_size,
                                                        progress=progress, **call)) from error
            parts.check_labels(list(attr.labels))
            parts.write(parquet.table(attr, chunk.rows, not is_none(specs["contrast"])))
            written += chunk.rows
            bar.update(len(chunk.rows))
    finally:
        bar.close()
    if not done and not written:
        raise InputError("the data has no rows")
    return Path(out)


def values_of(chunk, specs) -> dict:
    """``target`` and ``contrast`` for ``attribute``: one value for all rows (``Same``), or the chunk's list."""
    target = specs["target"].value if isinstance(specs["target"], Same) else chunk.targets
    contrast = specs["contrast"].value if isinstance(specs["contrast"], Same) else chunk.contrasts
    return {"target": target, "contrast": contrast}


def is_none(how) -> bool:
    return isinstance(how, Same) and how.value is None


def describe(how) -> str:
    return f"column {how.name!r}" if isinstance(how, Column) else f"same {how.value!r}"


def identity(model) -> str:
    """The model, as a resumed run must match it: its family, its name or path, a digest of its config."""
    config = getattr(model, "config", None)
    text = config.to_json_string(use_diff=False) if hasattr(config, "to_json_string") else repr(config)
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    return f"{build_plan(model).family.name} {getattr(config, 'name_or_path', '') or '(no name)'} config {digest}"


def meta_of(model, specs, call, reduce) -> dict:
    """What ``out=``'s ``_dla_recipes.json`` records of the call (a resumed call must match all of it)."""
    edit = call["intervene"]
    return {"model": identity(model), "by": call["by"], "position": repr(call["position"]), "reduce": reduce,
            "prompt": describe(specs["prompt"]), "target": describe(specs["target"]),
            "contrast": describe(specs["contrast"]),
            "intervene": None if edit is None else getattr(edit, "__qualname__", repr(edit)), "labels": None}


def stopped(error: RemoteError, k: int, rows: list[int], out, src, again) -> RemoteBatchError:
    """A ``RemoteBatchError`` for chunk ``k`` failing remotely after ``rows`` were written to ``out``."""
    resumable = is_transient(error) and src.reiterable
    how = ("call attribute_dataset again with the same out= (and the same data, in the same order) to attribute "
           "the rest" + ("; .resume() does that" if resumable else ""))
    return RemoteBatchError(f"chunk {k + 1} failed remotely: {error}\n\n{len(rows)} row(s) are kept in "
                            f"out={str(out)!r}; {how}.", partial=None, done=tuple(rows), failed_batch=k,
                            cause=error, resume=again if resumable else None)


class Bar:
    """A tqdm bar of prompts, opened at the second chunk (``progress=None``) or the first (``True``)."""

    def __init__(self, progress, total, batch_size, initial, desc):
        self.progress, self.total, self.initial, self.desc, self.bar = progress, total, initial, desc, None
        self.show_at = 0 if progress else 1

    def begin(self, k: int) -> None:
        if self.progress is False or self.bar is not None or k < self.show_at:
            return
        from tqdm.auto import tqdm

        self.bar = tqdm(desc=self.desc, unit="prompt", total=self.total, initial=self.initial)

    def update(self, n: int) -> None:
        self.initial += n
        if self.bar is not None:
            self.bar.update(n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def over_stats(model, src, specs, call, batch_size, progress, out, options):
    """``reduce="stats"``: ``attribute(..., reduce="stats")`` a chunk, the chunks' statistics merged
    (``AttributionStats.merge``); with ``out`` they are also saved there (``stats.save``)."""
    total = None
    bar = Bar(progress, src.total, batch_size, 0, f"DLA stats by {call['by']}")
    try:
        for k, chunk in enumerate(data_rows.chunks(src, batch_size, specs)):
            bar.begin(k)
            part = attribute(model, chunk.prompts, **values_of(chunk, specs), batch_size=batch_size, progress=False,
                             reduce="stats", **call, **options)
            total = part if total is None else total.merge(part)
            bar.update(len(chunk.rows))
    finally:
        bar.close()
    if total is None:
        raise InputError("the data has no rows")
    if out is not None:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        total.save(out)
    return total
