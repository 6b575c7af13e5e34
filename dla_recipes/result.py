"""The result stage: every batch's ``Readout`` becomes ONE self-checked ``Attribution``, in the user's order.

``assemble`` is the only place an ``Attribution`` is built from a trace: ``attribute``, ``attribute_direction`` and
``trace_attribution`` all go through it, so the three return the same diagnostics for the same call. It joins the
readouts (``Readout.concat``), runs the self-check against the model's own logit (``selfcheck``), takes the
components from the plan, and puts the rows back in the user's order (``in_user_order``: padding-unsafe families
run their prompts grouped by length).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch

from .present.attribution import Attribution
from .present.positions import PositionAttribution
from .present.stats import ACCUMULATORS, AttributionStats
from .selfcheck import Held, computed_dtype, self_check
from .trace.readout import Readout

# What an ExactnessError most likely means when the forward pass was edited.
EDIT_HINT = (
    "The forward pass was edited: an edit that adds to the residual stream itself (a block's output, "
    "layers_output, nnterp's model.steer) writes a vector that no component wrote, so the parts cannot sum to the "
    "logit. Add it to what a sublayer writes instead (e.g. model.layers[i].mlp.output), where it is attributed to "
    "that sublayer (L{i}.mlp by block; L{i}.mlp.edit by head, neuron, expert or source)."
)


class Rows(NamedTuple):
    """What was attributed, row by row (run order; a row is a site, one (prompt, position)): the prompts, the
    target and contrast tokens (as text; contrast None without one) and each row's own attributed position."""

    prompts: tuple[str, ...]
    target_tokens: tuple[str, ...]
    contrast_tokens: tuple[str, ...] | None
    positions: tuple[int, ...]


class Layout(NamedTuple):
    """Where each run-order site goes in a ``[batch, n_positions]`` table (several positions a prompt).

    Attributes:
        prompt, column: each site's prompt (the user's index) and column.  prompts: the prompts' texts, and
        tokens: their own tokens decoded one by one, both in the user's order.  one: one int position (the result
        is a plain ``Attribution``, one row a prompt).
    """

    prompt: tuple[int, ...]
    column: tuple[int, ...]
    prompts: tuple[str, ...]
    tokens: tuple[tuple[str, ...], ...]
    one: bool

    def order(self) -> list[int]:
        """Each run-order site's row in the result (prompt-major: by prompt, then column)."""
        keys = list(zip(self.prompt, self.column))
        ranked = sorted(range(len(keys)), key=keys.__getitem__)
        order = [0] * len(keys)
        for rank, k in enumerate(ranked):
            order[k] = rank
        return order

    def names(self, own: Sequence[int]) -> list[str]:
        """Each run-order site as the user knows it: ``"prompt 3"`` or ``"prompt 3, position 5"``."""
        if self.one:
            return [f"prompt {p}" for p in self.prompt]
        return [f"prompt {p}, position {o}" for p, o in zip(self.prompt, own)]


def rows_of(batches: Sequence) -> Rows:
    """The ``Rows`` of batches that ran (``transport.batches.Batch``), in order, one per site."""
    contrast_tokens = [b.contrast_tokens for b in batches]
    return Rows(
        prompts=sum((b.site_prompts for b in batches), ()),
        target_tokens=sum((b.target_tokens for b in batches), ()),
        contrast_tokens=None if contrast_tokens[0] is None else sum(contrast_tokens, ()),
        positions=sum((b.own_positions for b in batches), ()),
    )


def layout_of(batches: Sequence, groups: Sequence[Sequence[int]], tokenizer=None) -> Layout:
    """The ``Layout`` of batches run for these groups of the user's prompts (``groups[k]``: batch ``k``'s)."""
    prompt, column, texts, tokens = [], [], {}, {}
    one = all(b.one for b in batches)
    for batch, group in zip(batches, groups):
        prompt.extend(group[int(r)] for r in batch.rows)
        column.extend(batch.columns or [0] * len(batch.rows))
        for k, i in enumerate(group):
            texts[i] = batch.prompts[k]
            if not one and tokenizer is not None:
                tokens[i] = tuple(tokenizer.decode([t]) for t in batch.ids[k])
    ordered = sorted(texts)
    return Layout(tuple(prompt), tuple(column), tuple(texts[i] for i in ordered),
                  tuple(tokens[i] for i in ordered) if tokens else (), one)


def by_position(attr: Attribution, layout: Layout):
    """The ``PositionAttribution`` of ``attr`` (its rows the sites in the user's order, ``Layout.order``): a column
    masked in every prompt (``target="next"`` at the last position) is left out."""
    prompts = sorted(set(layout.prompt))
    width = max(layout.column) + 1
    index = torch.full((len(prompts), width), -1, dtype=torch.long)
    for row, k in enumerate(sorted(range(len(layout.prompt)), key=lambda k: (layout.prompt[k], layout.column[k]))):
        index[prompts.index(layout.prompt[k]), layout.column[k]] = row
    index = index[:, (index >= 0).any(0)]
    return PositionAttribution(attr, index, layout.prompts, layout.tokens)


@dataclass(frozen=True)
class Of:
    """What a call's readouts attribute, as the result stage reads it: the plan's components at ``by`` (before
    ``stop``, ``by="source"``: split as ``sources`` says, ``edits``: with each split term's ``.edit`` column), the
    dtype the model computes in (when the trace did not measure it), the user's relative ``tolerance`` (or None)
    and ``read_by`` (``attribute_direction``'s norm, ``"L3.ln_2"``; empty for a logit)."""

    plan: object
    by: str
    dtype: torch.dtype
    tolerance: float | None = None
    stop: object = None
    sources: object = None
    read_by: str = ""
    edits: bool = False

    def components(self):
        """``(Components, Labels)`` of these readouts' columns (``components_of``)."""
        return components_of(self.plan, self.by, self.stop, self.sources, self.edits)


def assemble(of: Of, rows: Rows, readouts: Sequence[Readout], order: Sequence[int] | None = None,
             layout: Layout | None = None, reduce: str | None = None):
    """One self-checked ``Attribution`` from each batch's ``Readout`` (in the batches' order).

    Args:
        of: what the readouts attribute (``Of``).
        rows: what the rows attribute (``rows_of(batches)``), in run order.
        readouts: one ``Readout`` per batch.
        order: the user's index of each prompt in run order; the result's rows are put back in the user's order.
        layout: where each site goes (several positions a prompt: the result is a ``PositionAttribution``, its
            rows ordered by ``layout.order()``, which replaces ``order``); None: one row a prompt.
        reduce: ``"sum"``: each prompt's positions summed into one row (``PositionAttribution.sum``).
    """
    plan, by, dtype, tolerance, read_by, edits = of.plan, of.by, of.dtype, of.tolerance, of.read_by, of.edits
    readout = Readout.concat(readouts)
    components, labels = of.components()
    names = layout.names(rows.positions) if layout is not None else None
    error, checked = self_check(readout, Held(plan, by, dtype, tolerance, edits, names), labels)
    computed = str(computed_dtype(readout, dtype)).removeprefix("torch.")  # what sized the bound (error_summary)
    attr = Attribution(
        values=readout.values,
        labels=labels,
        constant=readout.constant,
        logit=readout.logit,
        output_logit=readout.output_logit,
        error=error,
        prompts=rows.prompts,
        target_tokens=() if read_by else rows.target_tokens,
        contrast_tokens=rows.contrast_tokens,
        positions=rows.positions,
        by=by,
        family=plan.family.name,
        read_by=read_by,
        diagnostics={
            "norm_fit_error": max(float(readout.norm_fit_error), float(readout.pattern_error)),
            "pattern_error": float(readout.pattern_error),
            "head_error": float(readout.head_error),
            "scale": readout.scale,
            **checked,
        },
        components=components,
        dtype=computed,
    )
    if layout is not None:
        order = layout.order()
    attr = attr if order is None else in_user_order(attr, order)
    if layout is None or layout.one and reduce is None:
        return attr
    positions = by_position(attr, layout)
    return positions.sum() if reduce == "sum" else positions


# plan -> {(by, stop, sources): (components, labels)}: a loop of calls on one model builds them once (by="neuron" on
# a large model has ~10^5-10^6). Client side only: nothing that travels into a remote trace refers to it.
_COMPONENTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def components_of(plan, by: str, stop=None, sources=None, edits: bool = False):
    """``(plan.components(...), their labels)``, built once per plan and arguments: a ``Components`` and its
    ``Labels``, both made when read (immutable, so every result of the plan shares them)."""
    cache = _COMPONENTS.setdefault(plan, {})
    key = (by, stop, sources, edits)
    if key not in cache:
        components = plan.components(by, stop, sources, edits)
        cache[key] = (components, components.labels())
    return cache[key]


def in_user_order(attr: Attribution, order: Sequence[int]) -> Attribution:
    """``attr`` (rows in run order: row ``k`` is prompt ``order[k]``) with its rows back in the user's order."""
    order = list(order)
    if order == sorted(order):
        return attr
    index = torch.empty(len(order), dtype=torch.long)
    index[torch.as_tensor(order)] = torch.arange(len(order))  # index[prompt] = its row in run order

    def rows(value):
        if isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape[0] == len(order):
            return value[index]
        if isinstance(value, tuple) and len(value) == len(order):
            return tuple(value[int(i)] for i in index)
        return value

    return replace(
        attr,
        values=rows(attr.values), constant=rows(attr.constant), logit=rows(attr.logit),
        output_logit=rows(attr.output_logit), prompts=rows(attr.prompts), target_tokens=rows(attr.target_tokens),
        contrast_tokens=rows(attr.contrast_tokens), positions=rows(attr.positions),
        diagnostics={key: rows(value) for key, value in attr.diagnostics.items()},
    )


def assemble_stats(of: Of, readouts: Sequence, names: Sequence[str] = (), sites: Sequence[int] = (),
                   stats=None) -> AttributionStats:
    """ONE ``AttributionStats`` from each batch's ``trace.stats.StatsReadout`` (``reduce="stats"``), self-checked.

    The rows each batch sent back (its worst sites for the self-check, and any non-finite one) are checked by the
    unchanged ``self_check``, so a failure raises the ``ExactnessError`` / ``NonFiniteError`` it raises on every
    row; ``names``: every site as the user knows it (run order), ``sites``: the sites per batch; ``stats``: the
    call's ``Stats`` (its seed and pairing). A batch's readout is None where a session merged it into the first
    batch's (``transport.session``): its kept sites count from that batch's first site.
    """
    plan, by, dtype, tolerance, edits = of.plan, of.by, of.dtype, of.tolerance, of.edits
    seed, paired = (0, False) if stats is None else (stats.seed, stats.paired)
    labels = of.components()[1]
    starts = [sum(sites[:k]) for k in range(len(readouts))]
    starts, readouts = zip(*[(start, r) for start, r in zip(starts, readouts) if r is not None])  # None: merged
    kept = Readout.concat([r.rows for r in readouts])
    kept_names = [names[start + int(s)] for start, r in zip(starts, readouts) for s in r.sites] if names else None
    self_check(kept, Held(plan, by, dtype, tolerance, edits, kept_names), labels)
    meta = {"seed": seed, "by": by, "family": plan.family.name, "read_by": of.read_by, "paired": paired}
    total = None
    for r in readouts:
        accumulators = {name: getattr(r, name) for name in ("count", *ACCUMULATORS)}
        part = AttributionStats.from_accumulators(labels, accumulators, error=float(r.error), **meta)
        total = part if total is None else total.merge(part)
    return total
