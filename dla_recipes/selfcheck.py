"""The self-check: the parts must sum to the model's own logit within the rounding the model itself did, or raise.

``self_check(readout, plan, by, dtype)`` runs on the client after every attribution, in this order:

1. **Finite.** Any NaN or inf (in the head direction, a component's value, the stream entering the final norm, the
   frozen norm's scale, the model's own logits) raises ``NonFiniteError`` naming the first place it appears in
   forward order and what to do (a float16 model that overflows: load it in bfloat16 or float32).
2. **The final head** (logit scale, soft-cap from the family table) reproduces the model's output logits.
3. **Split terms.** Where a term is split into heads or neurons, its parts plus bias are compared with the
   projection's own output read along the same direction (``Readout.split_gap``): in low precision that output was
   rounded, the parts were not. The gap must be within the projection's rounding; it is reported as
   ``diagnostics["split_rounding"]`` and not counted against step 4.
4. **The sum.** ``|values.sum(-1) + constant + split_gap - logit|`` must be within ``bound``, derived from the
   precision the model computed in (its unit roundoff ``u``: 2^-8 in bfloat16, 2^-11 in float16, 2^-24 in float32):

   - each logit rounded at its own size: ``u * (b(z_target) + b(z_contrast))``, ``b(z) = 2^floor(log2 |z|)`` (a
     logit difference is rounded at the size of each logit, not at the size of the difference);
   - the final norm's output rounded per channel, carried along the head direction: ``u * head_noise``;
   - every residual add rounded per channel, carried along the direction the stream is read in:
     ``u * stream_noise`` (the stream around each add, read after each block);

   the last two are sums of many independent roundings, allowed ``SIGMAS`` times their scale. On top comes the
   float32 bound of the recipe's own arithmetic, ``FLOAT32_RTOL * max(1, |logit|)``. A user ``tolerance`` replaces
   the derived bound by ``tolerance * max(1, |logit|)``.

The error message says whether precision or the family table is the likely cause: a gap within a few times the
precision bound is the model's own rounding; a gap far beyond it is a write the family table does not describe.
"""

from __future__ import annotations

import torch

from .errors import ExactnessError, NonFiniteError

UNIT_ROUNDOFF = {torch.float64: 2.0**-53, torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
SIGMAS = 4.0  # allowance on a sum of independent roundings, in units of its scale (each rounding is <= u |x_i|)
FLOAT32_RTOL = 1e-4  # the recipe's own float32 arithmetic: the float32-style bound, FLOAT32_RTOL * max(1, |logit|)
PRECISION_LIKELY = 4.0  # a gap within this many precision bounds is called rounding in the error message


def model_dtype(model) -> torch.dtype:
    """The dtype the model computes in (its ``lm_head`` weight's); float32 when it cannot be read."""
    try:
        return model.lm_head.weight.dtype
    except AttributeError:
        return torch.float32


def unit_roundoff(dtype: torch.dtype) -> float:
    """``u``: the largest relative rounding error of one operation in ``dtype`` (round to nearest)."""
    if dtype in UNIT_ROUNDOFF:
        return UNIT_ROUNDOFF[dtype]
    return 2.0 ** -(torch.finfo(dtype).nmant + 1) if dtype.is_floating_point else UNIT_ROUNDOFF[torch.float32]


def computed_dtype(readout, dtype: torch.dtype) -> torch.dtype:
    """The dtype the model really computed in: what the trace measured (``Readout.unit_roundoff``, read where the
    model ran: on NDIF the client's model has no weights), else ``dtype``."""
    measured = getattr(readout, "unit_roundoff", None)
    if measured is None or not bool(torch.isfinite(measured).all()) or float(measured.max()) <= 0:
        return dtype
    u = float(measured.max())
    return min(UNIT_ROUNDOFF, key=lambda d: abs(UNIT_ROUNDOFF[d] - u))


def precision_bound(readout, dtype: torch.dtype) -> torch.Tensor:
    """``[batch]``: what the model's own rounding in ``dtype`` can move the logit by (see the module docstring)."""
    u = unit_roundoff(dtype)
    spread = readout.head_noise + readout.stream_noise
    return u * (readout.logit_size + SIGMAS * spread)


def float32_bound(readout) -> torch.Tensor:
    """``[batch]``: ``FLOAT32_RTOL * max(1, |logit|)``, the bound of a float32 model (the old fixed tolerance)."""
    return FLOAT32_RTOL * torch.clamp(readout.logit.abs(), min=1.0)


def _nonfinite(readout, labels, plan, dtype) -> None:
    """Raise ``NonFiniteError`` at the first non-finite number, in forward order."""
    where = None
    first = readout.first_nonfinite
    if not bool(readout.finite_head.bool().all()):
        where = "the head direction (the final norm's gain or lm_head's rows for the target and contrast)"
    elif bool((first >= 0).any()):
        column = int(first[first >= 0].min())
        label = labels[column] if labels is not None and column < len(labels) else f"component {column}"
        where = f"{label!r}, the first component whose write into the residual stream is not finite"
    elif not bool(torch.isfinite(readout.stream_noise).all()):
        where = "the residual stream entering the final norm"
    elif not bool(torch.isfinite(readout.scale).all()):
        where = "the frozen norm's scale (the final norm, or the norm a direction is read through)"
    elif not bool(torch.isfinite(readout.logit).all() & torch.isfinite(readout.output_logit).all()):
        where = "the model's own logits"
    elif not bool(torch.isfinite(readout.constant).all()):
        where = "the final norm's bias or lm_head's bias"
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


def self_check(readout, plan, by: str, dtype: torch.dtype = torch.float32, tolerance: float | None = None,
               labels: list[str] | None = None) -> tuple[float, dict]:
    """Check ``readout`` (see the module docstring); return ``(error, diagnostics)`` or raise.

    Args:
        readout: the concatenated ``Readout`` of all batches.
        dtype: the dtype the model computes in.  tolerance: a user's relative tolerance (replaces the bound).
        labels: the components' labels (to name the first non-finite one).

    Returns:
        ``error``: max |sum - logit|; ``diagnostics``: ``bound`` ``[batch]`` (what the check allowed),
        ``split_rounding`` ``[batch]`` (the split projections' own low-precision rounding, read along the logit).
    """
    dtype = computed_dtype(readout, dtype)
    _nonfinite(readout, labels, plan, dtype)
    total = readout.values.sum(-1) + readout.constant
    error = float((total - readout.logit).abs().max())
    u = unit_roundoff(dtype)
    floor = float32_bound(readout)
    precision = precision_bound(readout, dtype)
    bound = floor + precision if tolerance is None else tolerance * torch.clamp(readout.logit.abs(), min=1.0)
    split_bound = floor + u * SIGMAS * readout.split_noise if tolerance is None else bound
    diagnostics = {"bound": bound, "split_rounding": readout.split_gap}

    head_error = float(readout.head_error)
    size = torch.maximum(readout.logit_size, readout.output_logit.abs())
    head_bound = float(((FLOAT32_RTOL if tolerance is None else tolerance) + SIGMAS * u) * torch.clamp(size, min=1.0).max())
    if head_error > head_bound:
        raise ExactnessError(
            f"family {plan.family.name!r}: the family table's final head (logit scale {plan.logit_scale}, soft-cap "
            f"{plan.softcap}) does not reproduce the model's output logits (off by {head_error:.3g} > "
            f"{head_bound:.3g}); fix its logits_times / logits_over / softcap entry in the family table (dla_recipes/families/)"
        )
    split = readout.split_gap.abs()
    if bool((split > split_bound).any()):
        worst = int(torch.argmax(split / split_bound))
        raise ExactnessError(
            f"family {plan.family.name!r}: by={by!r}, the parts of the split terms (heads, neurons) differ from "
            f"their output projections' own output by {float(split[worst]):.3g} (prompt {worst}), more than the "
            f"projections' {dtype} rounding allows ({float(split_bound[worst]):.3g}): the family table's "
            "projection / split entry does not describe what these terms write; dla_recipes refuses to return a "
            "wrong attribution."
        )
    gaps = (total + readout.split_gap - readout.logit).abs()
    if bool((gaps > bound).any()):
        worst = int(torch.argmax(gaps / bound))
        gap, allowed = float(gaps[worst]), float(bound[worst])
        own = float(precision[worst])
        if tolerance is None and u > UNIT_ROUNDOFF[torch.float32] and gap <= PRECISION_LIKELY * (own + float(floor[worst])):
            cause = (
                f"The gap is within {PRECISION_LIKELY:g}x of what the model's own {dtype} rounding explains "
                f"({own:.3g}; a float32 model would be held to {float(floor[worst]):.3g}): precision is the likely "
                "cause. Attribute the model in float32 to confirm (dla_recipes.load(..., dtype=torch.float32)), or "
                "pass a larger tolerance=."
            )
        else:
            cause = (
                f"The gap is far beyond what {dtype} rounding explains ({own:.3g}; float32 bound "
                f"{float(floor[worst]):.3g}): the family table entry does not describe what this model's blocks add "
                "to the residual stream (a write no component accounts for)."
            )
        raise ExactnessError(
            f"family {plan.family.name!r}: the parts sum to {float(total[worst] + readout.split_gap[worst]):.6g} but "
            f"the model's own logit is {float(readout.logit[worst]):.6g} (prompt {worst}, error {gap:.3g} > "
            f"tolerance {allowed:.3g}, by={by!r}). {cause} dla_recipes refuses to return a wrong attribution."
        )
    return error, diagnostics
