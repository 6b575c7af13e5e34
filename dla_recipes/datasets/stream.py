"""The chunk loop of ``attribute_dataset``: each chunk attributed and handed to a sink (Parquet parts, merged
statistics), a progress bar of prompts, and a remote failure that keeps what finished and can go on.

A ``Stream`` holds the iterator of checked chunks (``rows.chunks``) and the chunk in flight, so that after a remote
failure ``RemoteBatchError.resume()`` attributes that chunk again and goes on with the same iterator (a generator
included: nothing is read twice). A sink has ``run(chunk)`` (the attribution of one chunk: ``attribute`` calls),
``add(chunk, result)`` and ``result()``.
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import torch

from ..errors import InputError, RemoteError
from ..math.stats import accumulate
from ..present import parquet
from ..present.stats import AttributionStats
from ..transport.remote import RemoteBatchError, is_transient
from ..transport.stats import SAMPLE_STRIDE


class Bar:
    """A tqdm bar of prompts (rate, time left when the size is known), opened at the second chunk
    (``progress=None``) or the first (``True``)."""

    def __init__(self, progress, total, initial, desc):
        self.progress, self.total, self.count, self.desc, self.bar = progress, total, initial, desc, None

    def begin(self, k: int) -> None:
        if self.progress is False or self.bar is not None or k < (0 if self.progress else 1):
            return
        from tqdm.auto import tqdm

        self.bar = tqdm(desc=self.desc, unit="prompt", total=self.total, initial=self.count)

    def update(self, n: int) -> None:
        self.count += n
        if self.bar is not None:
            self.bar.update(n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


class Stream:
    """``chunks`` through ``sink``, one ``attribute`` call (or two, compared) a chunk (see the module docstring)."""

    def __init__(self, chunks, sink, bar: Bar, out=None):
        self.chunks, self.sink, self.bar, self.out = chunks, sink, bar, out
        self.pending, self.k = None, 0

    def go(self):
        try:
            while True:
                if self.pending is None:
                    self.pending = next(self.chunks, None)
                    if self.pending is None:
                        break
                self.bar.begin(self.k)
                try:
                    result = self.sink.run(self.pending)
                except RemoteError as error:
                    raise self.stopped(error) from error
                except KeyboardInterrupt as stop:  # the run killed by hand (or by the notebook's stop button)
                    if self.out is not None:
                        stop.add_note(f"attribute_dataset stopped in chunk {self.k + 1} (rows {self.pending.rows[0]}.."
                                      f"{self.pending.rows[-1]}): the {len(self.sink.done())} row(s) before it are "
                                      f"kept in out={str(self.out)!r}; calling attribute_dataset again with the same "
                                      "out= (and the same data, in the same order) attributes the rest")
                    raise
                self.sink.add(self.pending, result)
                self.bar.update(len(self.pending.rows))
                self.pending, self.k = None, self.k + 1
        finally:
            self.bar.close()
        return self.sink.result()

    def stopped(self, error: RemoteError) -> RemoteBatchError:
        """Chunk ``k`` failed remotely after its retries: what finished is kept, and (a transient failure) can go on."""
        done = self.sink.done()
        where = (f"kept in out={str(self.out)!r}; calling attribute_dataset again with the same out= (and the same "
                 "data, in the same order) attributes the rest" if self.out is not None else "kept in .partial")
        resumable = is_transient(error)
        then = "; .resume() attributes the failed chunk again and goes on" if resumable else ""
        return RemoteBatchError(
            f"chunk {self.k + 1} (rows {self.pending.rows[0]}..{self.pending.rows[-1]}) failed remotely: {error}\n\n"
            f"The {len(done)} row(s) before it are {where}{then}.", partial=self.sink.partial(), done=tuple(done),
            failed_batch=self.k, cause=error, resume=self.go if resumable else None)


class RowsSink:
    """Each chunk's rows (``present.parquet.table``) written as one part of ``parts``; returns the directory."""

    def __init__(self, attribute_chunk, parts: parquet.Parts, contrast: bool, done: dict):
        self.attribute_chunk, self.parts, self.contrast = attribute_chunk, parts, contrast
        self.count = len(done)  # rows in the parts (nothing per row is kept: memory flat in the rows)

    def run(self, chunk):
        return self.attribute_chunk(chunk, None)

    def add(self, chunk, attr) -> None:
        self.parts.check_labels(list(attr.labels))
        self.parts.write(parquet.table(attr, chunk.rows, self.contrast))
        self.count += len(chunk.rows)

    def done(self) -> list[int]:
        return sorted(self.parts.done())

    def partial(self):
        return None

    def result(self):
        if not self.count:
            raise InputError("the data has no rows")
        return self.parts.path


class StatsSink:
    """Each chunk's ``AttributionStats`` merged into one; with ``out`` the merged statistics after each chunk are
    saved there (``stats-<rows done>.pt``, the latest kept), so a call with the same ``out`` goes on from them."""

    def __init__(self, attribute_chunk, stats, out=None, total=None, rows: int = 0):
        self.attribute_chunk, self.stats, self.out, self.total, self.rows = attribute_chunk, stats, out, total, rows

    def run(self, chunk):
        return self.attribute_chunk(chunk, replace(self.stats, start=chunk.rows[0]))

    def add(self, chunk, part) -> None:
        self.total = part if self.total is None else self.total.merge(part)
        self.rows = chunk.rows[-1] + 1
        if self.out is not None:
            last = chunk.prompts[-1]
            save_stats(self.out, self.total, self.rows, last if isinstance(last, str) else None)

    def done(self) -> list[int]:
        return list(range(self.rows))

    def partial(self):
        return self.total

    def result(self):
        if self.total is None:
            raise InputError("the data has no rows")
        return self.total


def save_stats(out, stats: AttributionStats, rows: int, last_prompt: str | None = None) -> Path:
    """``stats`` as ``out/stats-<rows>.pt`` (written whole, then renamed), next to ``stats-<rows>.json`` (the
    rows covered and the last one's prompt: a resumed run checks the data against it); older ones removed."""
    out = Path(out)
    name = out / f"stats-{rows:012d}.pt"
    side = name.with_suffix(".json")
    side.write_text(json.dumps({"rows": rows, "last_prompt": last_prompt}), encoding="utf-8")  # before its .pt
    tmp = out / f".{name.name}.tmp"
    stats.save(tmp)
    os.replace(tmp, name)
    for old in [*out.glob("stats-*.pt"), *out.glob("stats-*.json")]:
        if old not in (name, side):
            old.unlink()
    return name


def load_stats(out) -> tuple[AttributionStats | None, int]:
    """The latest statistics ``save_stats`` wrote in ``out`` and the rows they cover, or ``(None, 0)``."""
    found = sorted(Path(out).glob("stats-*.pt"))
    if not found:
        return None, 0
    return AttributionStats.load(found[-1]), int(found[-1].stem.split("-")[1])


def last_prompt(out, rows: int) -> str | None:
    """The prompt of row ``rows - 1`` as the statistics saved for ``rows`` rows recorded it (None: unknown)."""
    side = Path(out) / f"stats-{rows:012d}.json"
    return json.loads(side.read_text(encoding="utf-8")).get("last_prompt") if side.exists() else None


def sites_of(attr) -> tuple:
    """``(flat Attribution, column [n_sites])``: one row a site, each site's position column (0 with one)."""
    sites = getattr(attr, "sites", attr)
    if sites is attr:
        return attr, torch.zeros(len(attr), dtype=torch.int64)
    return sites, attr.mask.nonzero()[:, 1].to(torch.int64)


def difference_stats(first, second, rows, stats) -> AttributionStats:
    """The statistics of the per-site differences ``first - second`` (two attributions of the same prompts and
    positions, under two conditions), reduced by ``math.stats.accumulate``: columns aligned by label (a column only
    one side has, such as an edit's ``L3.mlp.edit``, is 0 on the other), then ``constant`` and ``logit``."""
    a, column = sites_of(first)
    b, other = sites_of(second)
    if len(a) != len(b) or not torch.equal(column, other):
        raise InputError(f"the two conditions attribute {len(a)} and {len(b)} sites: compare the same positions")
    column_of = {label: k for k, label in enumerate(dict.fromkeys([*a.labels, *b.labels]))}
    labels = list(column_of)

    def table(x):
        out = torch.zeros(len(x), len(labels) + 2, dtype=torch.float64)
        out[:, [column_of[label] for label in x.labels]] = x.values.double()  # a dict: labels.index is O(C) each
        out[:, -2], out[:, -1] = x.constant.double(), x.logit.double()
        return out

    rows = torch.tensor(rows, dtype=torch.int64)
    owner = rows[first.mask.nonzero()[:, 0]] if hasattr(first, "sites") else rows
    index = owner * SAMPLE_STRIDE + column
    acc = accumulate(table(a) - table(b), index, stats.seed, stats.replicates)
    return AttributionStats.from_accumulators(labels, acc, seed=stats.seed, error=max(a.error, b.error), by=a.by,
                                              family=a.family, read_by=a.read_by, paired=True)
