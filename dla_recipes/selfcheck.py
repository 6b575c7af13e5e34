"""The self-check: the parts must sum to the model's own logit within the rounding the model itself did, or raise.

``self_check(readout, Held(plan, by, dtype))`` runs on the client after every attribution, in this order:

1. **Finite.** Any NaN or inf (in the head direction, a component's write or its value once the frozen scale
   multiplies it, the stream entering the final norm, the frozen norm's scale, the model's own logits, the parts'
   sum) raises ``NonFiniteError`` naming the first place it appears in forward order and what to do (a float16
   model that overflows: load it in bfloat16 or float32).
2. **The final head** (logit scale, soft-cap from the family table) reproduces the model's output logits.
3. **Split terms.** Where a term is split into heads or neurons through one projection, in low precision, its
   parts plus bias are compared with what it really wrote, read where it is added, along the same direction
   (``Readout.split_gap``): that write was rounded (by the projection, any post-norm or multiplier after it), the
   parts were not. Each term's gap must be within its own rounding (``SIGMAS * u * sqrt(k * sum_i (w_i u_i)^2)``
   plus the float32 floor), so a write after the projection that no part makes (a torch hook, a family table that
   misses a gate) is caught in bfloat16 too, naming the term; the gaps are reported as
   ``diagnostics["split_rounding"]`` and not counted against step 4. A call that may carry an edit
   (``intervene=``, ``trace_attribution``) has each split term's gap as a column of its own instead
   (``L3.mlp.edit``), so there is nothing to hold here.
4. **The adds** (``math.adds``; with ``check="adds"``, derived bound only): at each block the family table lets it check, the stream
   leaving the block must be the stream entering it plus what its terms wrote, channel by channel, within the
   adds' own rounding (half an ulp of each add's result in the stream's dtype, plus the recipe's float32 sum),
   and the next block (or the final norm) must read that stream unchanged. A write no component made (a torch
   hook on a block or a sublayer, an edit outside the call) raises ``ExactnessError`` naming the block and the
   write's size, far below the whole logit's bound of step 5.
5. **The sum.** ``|values.sum(-1) + constant + split_gap - logit|`` must be within ``bound``, derived from the
   precision the model computed in (its unit roundoff ``u``: 2^-8 in bfloat16, 2^-11 in float16, 2^-24 in float32):

   - each logit rounded at its own size: ``u * (b(z_target) + b(z_contrast))``, ``b(z) = 2^floor(log2 |z|)`` (a
     logit difference is rounded at the size of each logit, not at the size of the difference);
   - the final norm's output rounded per channel, carried along the head direction: ``u * head_noise``;
   - every residual add rounded per channel, carried along the direction the stream is read in:
     ``u * stream_noise`` (the stream around each add, read after each block);

   the last two are sums of many independent roundings, allowed ``SIGMAS`` times their scale. On top comes the
   float32 bound of the recipe's own arithmetic, ``FLOAT32_RTOL * max(1, |logit|)``.

   A user ``tolerance`` replaces this derived bound (steps 3 to 5) by ``tolerance * max(1, |logit|)``: larger
   loosens the check, smaller tightens it, and a tolerance below the derived bound can fail on the model's own
   rounding alone (the error then says so, with the tolerance that would hold).

The precision is the activations' (``Readout.unit_roundoff``, read in the trace), not the parameters': a float32
model run under ``torch.autocast`` to bfloat16 is held to bfloat16's rounding, and any error it raises says first
that the forward ran under autocast (``Readout.weight_roundoff``, the parameters', read there too).

The error message says whether precision or the family table is the likely cause: a gap within a few times the
precision bound is the model's own rounding; a gap far beyond it is a write the family table does not describe.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from .errors import DLAError, ExactnessError, NonFiniteError
from .math.adds import where as add_site
from .math.checks import FLOAT32_RTOL, precision_of, relative_bound, split_sum_bound
from .math.rounding import SIGMAS, UNIT_ROUNDOFF, finite, unit_roundoff

__all__ = ["SIGMAS", "UNIT_ROUNDOFF", "model_dtype", "precision_bound", "self_check", "unit_roundoff"]
# FLOAT32_RTOL (the float32-style bound, FLOAT32_RTOL * max(1, |logit|)) and each site's bounds live in math.checks,
# which the in-trace reducer (reduce="stats") ranks the sites with: the same arithmetic on both sides (this module's
# SIGMAS and FLOAT32_RTOL are passed on, so a test that patches them here patches the check).
PRECISION_LIKELY = 4.0  # a gap within this many precision bounds is called possibly rounding in the error message


def model_dtype(model) -> torch.dtype:
    """The dtype the model computes in (its ``lm_head`` weight's); float32 when it cannot be read."""
    try:
        return model.lm_head.weight.dtype
    except AttributeError:
        return torch.float32


def computed_dtype(readout, dtype: torch.dtype) -> torch.dtype:
    """The dtype the model really computed in: what the trace measured (``Readout.unit_roundoff``, read where the
    model ran: on NDIF the client's model has no weights), else ``dtype``."""
    measured = getattr(readout, "unit_roundoff", None)
    if measured is None or measured.numel() == 0:
        return dtype
    u = float(measured.max())  # NaN if any is (max propagates it): one read of the host tensor
    if not math.isfinite(u) or u <= 0:
        return dtype
    return min(UNIT_ROUNDOFF, key=lambda d: abs(UNIT_ROUNDOFF[d] - u))


def precision_bound(readout, dtype: torch.dtype) -> torch.Tensor:
    """``[batch]``: what the model's own rounding in ``dtype`` can move the logit by (see the module docstring)."""
    return precision_of(unit_roundoff(dtype), readout.logit_size, readout.head_noise, readout.stream_noise, SIGMAS)


def float32_bound(readout) -> torch.Tensor:
    """``[batch]``: ``FLOAT32_RTOL * max(1, |logit|)``, the bound of a float32 model (the old fixed tolerance)."""
    return relative_bound(readout.logit, FLOAT32_RTOL)


def _nonfinite(readout, labels, plan, dtype, total: torch.Tensor) -> None:
    """Raise ``NonFiniteError`` at the first non-finite number, in forward order; ``total`` ``[batch]`` is the parts'
    sum plus the constant (``values.sum(-1) + constant``), the number the logit is checked against.

    ``first_nonfinite`` (read in the trace) finds a component whose score is not finite before the frozen scale
    multiplies it; the values themselves are tested too, since a finite score times a finite scale can still
    overflow float32 (and two such overflows of opposite sign sum to NaN, which no comparison with a bound fails).
    They are tested through ``total``: a NaN or an infinity among a row's values makes its sum NaN or infinite, so
    the pass costs ``[batch]`` numbers, not a pass over ``[batch, n_components]`` (2.3M columns by neuron on a
    70B model); only a failure looks at the values themselves, to name the first bad one."""
    where = None
    first = readout.first_nonfinite
    rows = torch.cat([t.reshape(-1) for t in (total, readout.stream_noise, readout.scale, readout.logit,
                                              readout.output_logit)])
    if bool(readout.finite_head.all() & (first < 0).all() & finite(rows).all()):
        return  # all finite: one check (the cases below name the first place a NaN or inf appears)
    if not bool(readout.finite_head.all()):
        where = "the head direction (the final norm's gain or lm_head's rows for the target and contrast)"
    elif bool((first >= 0).any()):
        label = _label(labels, int(first[first >= 0].min()))
        where = f"{label!r}, the first component whose write into the residual stream is not finite"
    elif not bool(finite(readout.stream_noise).all()):
        where = "the residual stream entering the final norm"
    elif not bool(finite(readout.scale).all()):
        where = "the frozen norm's scale (the final norm, or the norm a direction is read through)"
    elif bool((bad := finite(readout.values).logical_not().any(0)).any()):  # [n_components]: any row's value bad
        label = _label(labels, int(bad.int().argmax()))
        where = (f"{label!r}, the first component whose value overflows float32 once the frozen norm's scale "
                 "multiplies it (its write is finite)")
    elif not bool(finite(readout.logit).all() & finite(readout.output_logit).all()):
        where = "the model's own logits"
    elif not bool(finite(readout.constant).all()):
        where = "the final norm's bias or lm_head's bias"
    elif not bool(finite(total).all()):
        where = "the parts' float32 sum (every part is finite; their sum overflows float32)"
    if where is None:
        return
    if dtype == torch.float16:
        fix = ("float16 overflows on this model (its activations exceed 65504): load it in bfloat16 or float32, e.g. "
               "dla_recipes.load(path, dtype=torch.bfloat16)")
    else:
        fix = f"check the model's weights for NaN / inf, or load it in float32 (it runs in {dtype})"
    raise NonFiniteError(
        f"family {plan.family.name!r}: a NaN or inf first appears in {where}; dla_recipes refuses to return "
        f"non-finite values. {fix}."
    )


def _label(labels, column: int) -> str:
    """Component ``column`` as the user knows it: ``labels[column]`` (``"L1.mlp"``), else ``"component {column}"``."""
    return labels[column] if labels is not None and column < len(labels) else f"component {column}"


def _where(names, row: int) -> str:
    """The row as the user knows it: ``names[row]`` (``"prompt 3, position 5"``), else ``"prompt {row}"``."""
    return names[row] if names is not None and row < len(names) else f"prompt {row}"


class Held(NamedTuple):
    """What a readout is held to, as ``self_check`` was asked: the ``plan``, the granularity ``by``, the ``dtype``
    the model computed in, the user's ``tolerance`` (None: the derived bound), whether the call may carry an edit
    (``edits``) and each row's name for the messages (``names``)."""

    plan: object
    by: str
    dtype: torch.dtype = torch.float32
    tolerance: float | None = None
    edits: bool = False
    names: object = None


def self_check(readout, held: Held, labels: list[str] | None = None) -> tuple[float, dict]:
    """Check ``readout`` (see the module docstring); return ``(error, diagnostics)`` or raise.

    Args:
        readout: the concatenated ``Readout`` of all batches.
        held: what it is held to (``Held``): the plan and granularity; the dtype the model computes in; a user's
            relative tolerance (replaces the bound); whether the call may carry an edit of the forward pass (it has
            ``.edit`` columns; the messages say so); each row as the user knows it (``"prompt 3, position 5"``),
            for the messages (default its index).
        labels: the components' labels (to name the first non-finite one).

    Returns:
        ``error``: max |sum - logit|; ``diagnostics``: ``bound`` ``[batch]`` (what the check allowed),
        ``split_rounding`` ``[batch]`` (the split terms' own low-precision rounding, read along the logit) and, with
        ``check="adds"``, ``add_rounding`` ``[batch]`` (the largest ratio of an add's gap to its own rounding).
    """
    dtype = computed_dtype(readout, held.dtype)
    held = held._replace(dtype=dtype)
    total = readout.values.sum(-1) + readout.constant
    _nonfinite(readout, labels, held.plan, dtype, total)
    try:
        return _checked(readout, held, total)
    except ExactnessError as error:
        cause = autocast(readout, dtype)
        if cause is None:
            raise
        raise ExactnessError(f"{cause}. {error}") from None


def autocast(readout, dtype: torch.dtype) -> str | None:
    """``"the forward ran under autocast to bfloat16 ..."`` when the activations' dtype (``dtype``) is coarser
    than the parameters' (``Readout.weight_roundoff``, read in the trace), else None."""
    weight = float(readout.weight_roundoff.max()) if readout.weight_roundoff.numel() else 0.0
    if weight <= 0 or unit_roundoff(dtype) <= weight:
        return None
    params = min(UNIT_ROUNDOFF, key=lambda d: abs(UNIT_ROUNDOFF[d] - weight))
    return (f"The forward ran under autocast to {str(dtype).removeprefix('torch.')} (the parameters are "
            f"{str(params).removeprefix('torch.')}; the bound is {str(dtype).removeprefix('torch.')}'s rounding)")


def _checked(readout, held: Held, total: torch.Tensor):
    """Steps 2 to 5 of the module docstring (``self_check``'s, after the finite check); ``total`` ``[batch]`` the
    parts' sum plus the constant."""
    plan, by, dtype, tolerance, edits, names = held
    error = float((total - readout.logit).abs().max())
    u = unit_roundoff(dtype)
    floor = float32_bound(readout)
    precision = precision_bound(readout, dtype)
    derived = floor + precision
    bound = derived if tolerance is None else relative_bound(readout.logit, tolerance)
    diagnostics = {"bound": bound, "split_rounding": readout.split_gap}
    if bool((readout.add_where.reshape(-1) >= 0).any()):  # check="adds": each row's worst add, over its rounding
        diagnostics["add_rounding"] = readout.add_ratio.reshape(-1).expand_as(bound)
    _check_head(readout, plan, u, tolerance)
    if by == "source":
        _check_pattern(readout, plan, u, edits)
    _check_split(readout, held, u, floor, bound)
    if tolerance is None:
        _check_adds(readout, plan, dtype, edits, names)
    gaps = (total + readout.split_gap - readout.logit).abs()
    if bool((gaps > bound).any()):
        worst = int(torch.argmax(gaps / bound))
        gap, allowed, own = float(gaps[worst]), float(bound[worst]), float(precision[worst])
        held = float(derived[worst])
        if tolerance is not None and gap <= held:
            cause = (
                f"The gap is within what the model's own {dtype} rounding and the recipe's float32 arithmetic "
                f"explain ({held:.3g}): the tolerance={tolerance:g} you passed allows only {allowed:.3g} here, below "
                f"this dtype's own rounding. Pass tolerance=None (the derived bound) or at least "
                f"{held / max(1.0, abs(float(readout.logit[worst]))):.2g}."
            )
        elif u > UNIT_ROUNDOFF[torch.float32] and gap <= PRECISION_LIKELY * held:
            cause = (
                f"The gap is {gap / held:.3g}x the bound of the model's own {dtype} rounding ({own:.3g}; "
                f"a float32 model would be held to {float(floor[worst]):.3g}): precision is a possible cause, "
                "not the only one. Attribute the model in float32 to tell "
                "(dla_recipes.load(..., dtype=torch.float32)): a gap that stays is a write no component accounts for "
                + ("(an edit of the stream itself, a torch hook, or a write the family table does not describe)."
                   if edits else "(a torch hook, or a write the family table does not describe).")
            )
        else:
            cause = (
                f"The gap is far beyond ({gap / held:.3g}x) what {dtype} rounding and float32 arithmetic explain "
                f"({held:.3g}): "
                "something wrote into the residual stream that no component accounts for"
                + (" (an edit of the stream itself, or " if edits else " (")
                + "a write the family table entry does not describe)."
            )
        raise ExactnessError(
            f"family {plan.family.name!r}: the parts sum to {float(total[worst] + readout.split_gap[worst]):.6g} but "
            f"the model's own logit is {float(readout.logit[worst]):.6g} ({_where(names, worst)}, error {gap:.3g} > "
            f"tolerance {allowed:.3g}, by={by!r}, {dtype}). {cause} dla_recipes refuses to return a wrong attribution."
        )
    return error, diagnostics


def _check_adds(readout, plan, dtype: torch.dtype, edits: bool, names) -> None:
    """Each checked block's adds are explained by its terms' writes, to their own rounding (step 4), or raise."""
    ratio = readout.add_ratio.reshape(-1)
    if not bool((ratio > 1).any()):
        return
    worst = int(torch.argmax(ratio))
    code = float(readout.add_where.reshape(-1).expand_as(ratio)[worst])
    gap, norm = float(readout.add_gap.reshape(-1).expand_as(ratio)[worst]), float(readout.add_norm.reshape(-1).expand_as(ratio)[worst])
    block, between = divmod(int(code), 2)
    reader = "the final norm" if block == len(plan.layers) - 1 else f"block {block + 1}"
    held = (f"where {reader} must read block {block}'s output unchanged" if between else
            f"{float(ratio[worst]):.3g}x what the adds' own {dtype} rounding allows channel by channel")
    raise ExactnessError(
        f"family {plan.family.name!r}: a write no component made is in {add_site(code, len(plan.layers))}: a vector "
        f"of norm {gap:.3g} ({gap / max(norm, 1e-30):.3%} of the stream's norm {norm:.3g} there, "
        f"{_where(names, worst)}), {held}. Either the forward pass was edited at block {block} without dla_recipes "
        "knowing (a torch hook on the block or one of its modules, or nnsight code outside the call: pass the edit "
        "as attribute(..., intervene=fn)" + (", and edit a sublayer's output, not the stream itself" if edits else "")
        + "), or the family table entry does not describe what this block writes (dla_recipes/families/). "
        "dla_recipes refuses to return a wrong attribution."
    )


def _check_head(readout, plan, u: float, tolerance: float | None) -> None:
    """The family table's final head (logit scale, soft-cap) reproduces the model's output logits, or raise."""
    head_error = float(readout.head_error)
    size = torch.maximum(readout.logit_size, readout.output_logit.abs())
    head_bound = float(((FLOAT32_RTOL if tolerance is None else tolerance) + SIGMAS * u) * torch.clamp(size, min=1.0).max())
    if head_error > head_bound:
        raise ExactnessError(
            f"family {plan.family.name!r}: the family table's final head (logit scale {plan.logit_scale}, soft-cap "
            f"{plan.softcap}) does not reproduce the model's output logits (off by {head_error:.3g} > "
            f"{head_bound:.3g}); fix its logits_times / logits_over / softcap entry in the family table (dla_recipes/families/)"
        )


PATTERN_RTOL_FLOAT32 = 1e-3  # the heads rebuilt from pattern and values, against the model's, in float32 ...
PATTERN_ROUNDINGS = 32  # ... and in low precision, in units of u (each rebuilt element is off by ~u, measured <= 2u)


def _check_pattern(readout, plan, u: float, edits: bool) -> None:
    """``by="source"``: the heads rebuilt from each block's attention pattern and values are what its output
    projection reads (``Readout.pattern_error``), or the split is refused naming the block and the likely cause."""
    error = float(getattr(readout, "pattern_error", 0.0))
    allowed = PATTERN_RTOL_FLOAT32 if u <= UNIT_ROUNDOFF[torch.float32] else PATTERN_ROUNDINGS * u
    if error <= allowed:
        return
    layer = int(readout.pattern_layer)
    edit = (" Either the forward pass was edited between the pattern and the output projection (an edit of "
            "o_proj's input, such as zeroing a head's slice, is after the values: edit the values "
            "(self_attn.v_proj.output) or the pattern to split an edited head by source, or use by='head'), or"
            if edits else "")
    raise DLAError(
        f"by='source' cannot split block {layer}'s heads ({plan.family.name}): the heads its output projection "
        f"reads are not its attention pattern times its values (rebuilt, they are off by {error:.3g} of the heads' "
        f"largest value; allowed {allowed:.2g}).{edit}{' t' if edits else ' T'}his family computes its heads otherwise "
        "(a gate, a norm or a scale after the pattern), which the split does not describe. Use by='head'."
    )


def _term_label(plan, code: float) -> str:
    """The label of the split term ``Readout.split_worst_term`` names (``layer * 1024 + index``)."""
    layer, k = divmod(int(code), 1024)
    try:
        return f"L{layer}.{plan.layers[layer][k].term.name}"
    except IndexError:
        return f"block {layer}'s term {k}"


def _check_split(readout, held: Held, u, floor, bound) -> None:
    """Each checked split term's parts and bias explain what it wrote, to its own rounding (step 3), or raise."""
    plan, by, dtype, tolerance, _, names = held
    parts = {"head": "heads", "neuron": "neurons"}.get(by, "parts")
    if tolerance is None:
        gap, allowed = readout.split_worst_gap.abs(), floor + readout.split_worst_allowed
        if bool((gap > allowed).any()):
            worst = int(torch.argmax(gap / allowed))
            term = _term_label(plan, float(readout.split_worst_term[worst]))
            raise ExactnessError(
                f"family {plan.family.name!r}: by={by!r}, {term} wrote {float(readout.split_worst_gap[worst]):+.3g} "
                f"into the residual stream (along the logit, {_where(names, worst)}) that its {parts} and bias do not "
                f"explain, more than its {dtype} rounding allows ({float(allowed[worst]):.3g}). Either the forward "
                f"pass was edited after {term}'s projection without dla_recipes knowing (a torch hook, or nnsight "
                f"code outside the call: pass the edit as attribute(..., intervene=fn), where it is attributed as "
                f"{term}.edit), or the family table's split entry does not describe what this sublayer writes. "
                "dla_recipes refuses to return a wrong attribution."
            )
    split_bound = split_sum_bound(floor, u, readout.split_noise, SIGMAS) if tolerance is None else bound
    split = readout.split_gap.abs()
    if bool((split > split_bound).any()):
        worst = int(torch.argmax(split / split_bound))
        raise ExactnessError(
            f"family {plan.family.name!r}: by={by!r}, the split terms' {parts} and biases differ from what the terms "
            f"wrote into the residual stream by {float(split[worst]):.3g} in all ({_where(names, worst)}), more than "
            + (f"their {dtype} rounding allows" if tolerance is None else f"tolerance={tolerance:g} allows")
            + f" ({float(split_bound[worst]):.3g}): an edit after a projection that dla_recipes does not know of (pass "
            "it as intervene=fn) or a family table split entry that does not describe what these terms write; "
            "dla_recipes refuses to return a wrong attribution."
        )
