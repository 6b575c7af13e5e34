"""The self-check's per-site arithmetic: the bounds each site is held to, and how far each site is from failing.

``selfcheck.self_check`` (client side, on the rows that came back) and ``trace.stats`` (in the trace, to pick the
few sites whose rows come back with ``reduce="stats"``) both size the bounds here, so the site the in-trace
reducer ranks worst is the one the self-check would fail first. Tensors in, tensors out; every input ``[n]`` (one
per site) in logit units, ``u`` the unit roundoff of the dtype the model computed in.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from .rounding import SIGMAS

FLOAT32_RTOL = 1e-4  # the recipe's own float32 arithmetic: the float32-style bound, FLOAT32_RTOL * max(1, |logit|)


def relative_bound(logit: torch.Tensor, rtol: float = FLOAT32_RTOL) -> torch.Tensor:
    """``[n]``: ``rtol * max(1, |logit|)``: by default the bound of a float32 model (the recipe's own arithmetic),
    else a user's relative ``tolerance``."""
    return rtol * torch.clamp(logit.abs(), min=1.0)


def precision_of(u, logit_size: torch.Tensor, head_noise: torch.Tensor, stream_noise: torch.Tensor,
                 sigmas: float = SIGMAS) -> torch.Tensor:
    """``[n]``: what the model's own rounding (unit roundoff ``u``) can move the logit by: each logit at its own
    size, the final norm's output and the residual adds' roundings (``SIGMAS`` times their scale)."""
    return u * (logit_size + sigmas * (head_noise + stream_noise))


def split_sum_bound(floor: torch.Tensor, u, split_noise: torch.Tensor, sigmas: float = SIGMAS) -> torch.Tensor:
    """``[n]``: what the split terms' summed gap may be (their own rounding, ``SIGMAS * u * noise``, plus ``floor``)."""
    return floor + u * sigmas * split_noise


class SplitGaps(NamedTuple):
    """The split terms' per-site gaps, each ``[n]``: ``gap`` and ``noise`` (their summed gap and its squared
    rounding noise), ``worst_gap`` and ``worst_allowed`` (the worst single split term's gap and what it may be)."""

    gap: torch.Tensor
    noise: torch.Tensor
    worst_gap: torch.Tensor
    worst_allowed: torch.Tensor


class Sizes(NamedTuple):
    """What the model's own rounding is sized with at each site, each ``[n]`` (``precision_of``'s): the logit's
    size, the final norm's output noise and the residual adds' noise."""

    logit_size: torch.Tensor
    head_noise: torch.Tensor
    stream_noise: torch.Tensor


def site_ratios(total, logit, split: SplitGaps, sizes: Sizes, u, tolerance: float | None = None) -> torch.Tensor:
    """``[n]``: each site's largest gap over what its check allows (> 1: the self-check fails there), over the
    three per-site checks: the sum (``total`` = parts + constant, against ``logit``), the split terms' summed gap,
    and (derived bound only) the worst single split term. NaN where a number is not finite."""
    floor = relative_bound(logit)
    derived = floor + precision_of(u, sizes.logit_size, sizes.head_noise, sizes.stream_noise)
    bound = derived if tolerance is None else relative_bound(logit, tolerance)
    ratio = (total + split.gap - logit).abs() / bound
    split_bound = split_sum_bound(floor, u, split.noise) if tolerance is None else bound
    ratio = torch.maximum(ratio, split.gap.abs() / split_bound)
    if tolerance is None:
        ratio = torch.maximum(ratio, split.worst_gap.abs() / (floor + split.worst_allowed))
    return ratio


def nonfinite_sites(rows: Sequence[torch.Tensor]) -> torch.Tensor:
    """``[n]`` bool: the sites where any of ``rows`` (each ``[n]`` or ``[n, k]``) is not finite."""
    bad = torch.zeros(rows[0].shape[0], dtype=torch.bool, device=rows[0].device)
    for row in rows:
        finite = torch.isfinite(row.to(bad.device))
        bad = bad | ~(finite.all(-1) if finite.dim() == 2 else finite)
    return bad
