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
from dataclasses import dataclass, replace

from ..api import Logits, attribute_logits
from ..args import Check, Granularity
from ..errors import InputError
from ..generation import KEYWORDS, for_rows
from ..loading.load import as_standardized
from ..plan import build_plan
from ..present import parquet
from ..present.stats import Stats
from ..question import Question, ask
from . import rows as data_rows
from .rows import Column, Same
from .stream import Bar, RowsSink, StatsSink, Stream, difference_stats, last_prompt, load_stats

__all__ = ["Column", "Same", "Versus", "attribute_dataset", "load_stats"]

KEEP = object()  # a Versus field left as the first condition has it


@dataclass(frozen=True)
class Versus:
    """``compare=``: the second condition, what differs from the first (the samples are first - second).

    ``prompt``: a column of the data holding each row's second prompt (clean vs corrupted: both prompts of a row
    run in one batch, the difference reduced in the trace). ``intervene``: the second condition's edit (``None``:
    the plain model against ``intervene=``'s edit). ``model``: a second model of the same architecture (base vs
    fine-tuned). A plain string ``compare="corrupted"`` is ``Versus(prompt="corrupted")``."""

    prompt: object = KEEP
    intervene: object = KEEP
    model: object = KEEP


def attribute_dataset(model, data, *, prompt="prompt", target="target", contrast=None, position=-1,
                      generate: dict | None = None, by: Granularity = "block", dictionaries: dict | None = None,
                      sources: dict | None = None, intervene=None, check: Check = "logit",
                      tolerance: float | None = None, reduce=None, compare=None, out=None, remote=False,
                      blocking: bool = True, batch_size: int | None = None, progress: bool | None = None, fast=True):
    """Attribute every row of ``data``: its ``prompt`` column's prompt, its target (minus its contrast), in chunks
    of ``batch_size`` rows, one ``attribute`` call a chunk (one forward pass; ``remote``: one request).

    Args:
        data: a list of dicts, a pandas ``DataFrame`` (rows by position), a Hugging Face ``datasets.Dataset`` or
            any iterable of dicts (a generator is streamed: only one chunk is held at a time).
        prompt: the column holding each row's prompt: a string or a list of token ids.
        target: a column name (each row's token string or token id), or one value for every row: the keyword
            ``"next"``, a token id, a weighted set ``{tok: w}``, ``None`` (the model's top token), or
            ``Same(" Paris")`` for a token string (a plain string names a column; ``Column("next")`` reads a
            column named like the keyword).
        contrast: as ``target`` (its keyword: ``"mean"``); default none.
        by, position, dictionaries, sources, intervene, check, tolerance, remote, fast: as in ``attribute``
            (with ``generate``: as in ``attribute_generation``).
        reduce: ``None`` (one row a prompt, or a site with several positions), ``"sum"`` (each prompt's positions
            summed, as ``attribute``), ``"stats"`` or a ``Stats(replicates=, seed=)`` (``attribute(...,
            reduce="stats")`` a chunk, merged exactly: an ``AttributionStats``).
        blocking: refused unless True: the chunks run one after another, each written before the next.
        generate: ``dict(max_new_tokens=8, ...)`` (and transformers ``generate`` options, ``seed``): attribute
            each row's own generated answer instead of a target (``attribute_generation``: every generated step a
            site; ``contrast`` may be ``"runner-up"``); ``target`` and ``position`` are then not read.
        compare: with statistics, a second condition (``Versus``: a second prompt column, another edit, another
            model): the statistics are of the per-site differences first - second.
        out: a directory (``"runs/ioi.parquet"``). The rows are written there chunk by chunk, one Parquet part a
            chunk (``present.parquet`` names the columns), and the path is returned: ``pandas.read_parquet(out)``
            reads them in row order. Statistics are saved there after each chunk (``load_stats(out)``). A
            directory an earlier call wrote is resumed (its rows skipped) when the call is the same (model, by,
            position, reduce, columns, contrast, edit), else an ``InputError``. Without ``out`` the rows come back
            as one ``Attribution`` / ``PositionAttribution`` (fine for data that fits in memory).
        batch_size: rows a chunk (and a forward pass); None: 32.
        progress: a progress bar of prompts (their rate, the time left when the size is known); default: when
            there is more than one chunk.

    Raises:
        InputError: a malformed chunk (naming each row and column), a missing column, a resumed ``out`` written
            by another call, or data not in the order the resumed rows were written in.
        RemoteBatchError: a chunk failed remotely after its retries: what finished is kept (``.done`` the rows;
            the parts in ``out``, or ``.partial`` the statistics so far), the message says how to go on, and,
            the failure being transient, ``.resume()`` attributes the failed chunk again and goes on.
    """
    question = ask("attribute_dataset", by=by, dictionaries=dictionaries, sources=sources, intervene=intervene,
                   check=check, tolerance=tolerance, reduce=reduce, compare=compare, remote=remote, blocking=blocking,
                   batch_size=CHUNK if batch_size is None else batch_size, progress=progress, fast=fast)
    q = question
    stats_record = q.stats
    for name in ("start", "paired"):
        if stats_record is not None and getattr(stats_record, name) != getattr(Stats(), name):
            raise InputError(f"Stats({name}=...) is attribute_dataset's to set (each chunk's first row; compare=)")
    batch_size = q.batch_size
    if not isinstance(prompt, (str, Column)):
        raise InputError(f"prompt={prompt!r}: give the name of the column holding the prompts")
    versus = Versus(prompt=compare) if isinstance(compare, (str, Column)) else compare
    if versus is not None and (not isinstance(versus, Versus) or stats_record is None):
        raise InputError(f"compare={compare!r}: give Versus(prompt=..., intervene=..., model=...) or a column name, "
                         "with reduce='stats' (the statistics of the per-prompt differences)")
    if generate is not None and not (isinstance(position, int) and position == -1):
        raise InputError(f"position={position!r} with generate=: each row's generated answer is attributed at its "
                         "own positions; drop position=")
    if generate is not None and versus is not None:
        raise InputError("compare= with generate=: the two conditions would generate different answers; attribute "
                         "each with its own attribute_dataset call")
    specs = {"prompt": data_rows.spec(prompt, "prompt"),
             "target": data_rows.spec(target, "target", ("next",)) if generate is None else Same("generated"),
             "contrast": data_rows.spec(contrast, "contrast", ("mean",) if generate is None else KEYWORDS)}
    if versus is not None and versus.prompt is not KEEP:
        specs["versus"] = data_rows.spec(versus.prompt, "compare")
    src = data_rows.source(data)
    model = as_standardized(model)
    call = Call(q.but(compare=None), position, None if generate is None else for_rows(generate))
    if stats_record is None and out is None:  # everything in memory: one attribute call, batched as attribute does
        chunks = list(data_rows.chunks(src, batch_size, specs))
        if not chunks:
            raise InputError("the data has no rows")
        whole = data_rows.Chunk(*([v for c in chunks for v in getattr(c, f)] for f in ("rows", "prompts", "targets",
                                                                                      "contrasts")))
        return call.run(model, whole, specs, None)
    meta = meta_of(model, specs, call, repr(stats_record) if stats_record is not None else reduce, versus)
    parts = None if out is None else parquet.Parts(out)
    if parts is not None:
        parts.start(meta)

    def attribute_chunk(chunk, how):  # how: the chunk's Stats, or None for the rows (reduce None or "sum")
        one = call.but(batch_size=len(chunk.prompts), progress=False, reduce=q.reduce if how is None else how)
        if generate is not None:
            return one.run(model, chunk, specs, None)
        return one.run(model, chunk, specs, versus)

    if stats_record is None:
        done = parts.done()
        sink = RowsSink(attribute_chunk, parts, not is_none(specs["contrast"]), done)
    else:
        total, rows = load_stats(out) if out is not None else (None, 0)
        done = dict.fromkeys(range(rows))  # skipped; the last one's prompt checked against the one saved
        if rows:
            done[rows - 1] = last_prompt(out, rows)
        sink = StatsSink(attribute_chunk, stats_record, out, total, rows)
    bar = Bar(progress, src.total, len(done), f"DLA {'stats ' if stats_record else ''}by {by}")
    return Stream(data_rows.chunks(src, batch_size, specs, skip=done), sink, bar, out).go()


CHUNK = 32  # rows a chunk when batch_size is None


@dataclass(frozen=True)
class Call:
    """One chunk's call: the dataset's ``question`` (its ``batch_size`` the chunk's), the ``position`` attributed,
    and ``generate`` (``generation.for_rows``'s call, or None: each row's target)."""

    question: Question
    position: object
    generate: object = None

    def but(self, **changes) -> Call:
        """This call with the question's ``changes`` (a chunk's size, its ``Stats``)."""
        return replace(self, question=self.question.but(**changes))

    def run(self, model, chunk, specs, versus=None):
        """One chunk attributed (``versus``: the second condition too: a second prompt column, one paired call;
        another edit or model, two calls, their per-site differences reduced here)."""
        q, values = self.question, values_of(chunk, specs)
        if self.generate is not None:
            return self.generate(model, chunk.prompts, values["contrast"], q)
        logits = Logits(values["target"], values["contrast"], self.position)
        if versus is None:
            return attribute_logits(model, chunk.prompts, logits, q)
        n, stats = len(chunk.prompts), q.stats
        if versus.prompt is not KEEP:  # clean + corrupted, paired in the trace
            doubled = Logits(*(v + v if isinstance(v, list) else v for v in logits[:2]), self.position)
            return attribute_logits(model, chunk.prompts + chunk.versus, doubled,
                                    q.but(batch_size=2 * n, reduce=replace(stats, paired=True)))
        first = attribute_logits(model, chunk.prompts, logits, q.but(reduce=None))
        other = q.but(reduce=None) if versus.intervene is KEEP else q.but(reduce=None, intervene=versus.intervene)
        second_model = model if versus.model is KEEP else as_standardized(versus.model)
        second = attribute_logits(second_model, chunk.prompts, logits, other)
        return difference_stats(first, second, chunk.rows, stats)


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


def meta_of(model, specs, call, reduce, versus=None) -> dict:
    """What ``out=``'s ``_dla_recipes.json`` records of the call (a resumed call must match all of it)."""
    q = call.question
    edit = q.intervene
    if versus is not None:
        versus = {"prompt": None if versus.prompt is KEEP else describe(specs["versus"]),
                  "intervene": None if versus.intervene is KEEP else name_of(versus.intervene),
                  "model": None if versus.model is KEEP else identity(as_standardized(versus.model))}
    return {"versus": versus, "model": identity(model), "by": q.by, "position": repr(call.position), "reduce": reduce,
            "prompt": describe(specs["prompt"]), "target": describe(specs["target"]),
            "contrast": describe(specs["contrast"]),
            "intervene": name_of(edit), "labels": None} | ({} if q.dictionaries is None else {"dictionaries": {
                key: list(d.W_dec.shape) for key, d in q.dictionaries.items()}}) | (
                {} if q.check == "logit" else {"check": q.check}) | ({} if q.sources is None else {
                    "sources": repr(dict(q.sources))})


def name_of(edit) -> str | None:
    return None if edit is None else getattr(edit, "__qualname__", repr(edit))


