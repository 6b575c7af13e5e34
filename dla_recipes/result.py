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
from dataclasses import replace
from typing import NamedTuple

import torch

from .present.attribution import Attribution
from .selfcheck import computed_dtype, self_check
from .trace.readout import Readout

# What an ExactnessError most likely means when the forward pass was edited.
EDIT_HINT = (
    "The forward pass was edited: an edit that adds to the residual stream itself (a block's output, "
    "layers_output, nnterp's model.steer) writes a vector that no component wrote, so the parts cannot sum to the "
    "logit. Add it to what a sublayer writes instead (e.g. model.layers[i].mlp.output), where it is attributed to "
    "that sublayer (L{i}.mlp by block; L{i}.mlp.edit by head, neuron, expert or source)."
)


class Rows(NamedTuple):
    """What was attributed, row by row (run order): the prompts, the target and contrast tokens (as text; contrast
    None without one) and each row's own attributed position."""

    prompts: tuple[str, ...]
    target_tokens: tuple[str, ...]
    contrast_tokens: tuple[str, ...] | None
    positions: tuple[int, ...]


def rows_of(batches: Sequence) -> Rows:
    """The ``Rows`` of batches that ran (``transport.batches.Batch``), in order."""
    contrast_tokens = [b.contrast_tokens for b in batches]
    return Rows(
        prompts=sum((b.prompts for b in batches), ()),
        target_tokens=sum((b.target_tokens for b in batches), ()),
        contrast_tokens=None if contrast_tokens[0] is None else sum(contrast_tokens, ()),
        positions=sum((b.own_positions for b in batches), ()),
    )


def assemble(plan, rows: Rows, readouts: Sequence[Readout], by: str, dtype: torch.dtype,
             tolerance: float | None = None, stop=None, sources=None, order: Sequence[int] | None = None,
             read_by: str = "", edits: bool = False) -> Attribution:
    """One self-checked ``Attribution`` from each batch's ``Readout`` (in the batches' order).

    Args:
        plan: the model's ``Plan`` (its components at ``by``, before ``stop``, split by ``sources``).
        rows: what the rows attribute (``rows_of(batches)``), in run order.
        readouts: one ``Readout`` per batch.  dtype: the dtype the model computes in (when the trace did not
            measure it).  tolerance: the user's relative tolerance, or None.
        order: the user's index of each prompt in run order; the result's rows are put back in the user's order.
        read_by: ``attribute_direction``'s norm (``"L3.ln_2"``); empty for a logit.
        edits: the forward pass may have been edited (``intervene=``, ``trace_attribution``): each split term has
            an ``.edit`` column (``Plan.components``).
    """
    readout = Readout.concat(readouts)
    components, labels = components_of(plan, by, stop, sources, edits)
    error, checked = self_check(readout, plan, by, dtype, tolerance, labels=labels, edits=edits)
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
    return attr if order is None else in_user_order(attr, order)


# plan -> {(by, stop, sources): (components, labels)}: a loop of calls on one model builds them once (by="neuron" on
# a large model has ~10^5-10^6). Client side only: nothing that travels into a remote trace refers to it.
_COMPONENTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def components_of(plan, by: str, stop=None, sources=None, edits: bool = False) -> tuple[tuple, list[str]]:
    """``(plan.components(...), their labels)``, built once per plan and arguments."""
    cache = _COMPONENTS.setdefault(plan, {})
    key = (by, stop, sources, edits)
    if key not in cache:
        components = plan.components(by, stop, sources, edits)
        cache[key] = (components, tuple(components.labels()))
    components, labels = cache[key]
    return components, list(labels)


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
