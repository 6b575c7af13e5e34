"""The rounding the model itself did, measured in the trace for the self-check, and where a NaN or inf starts.

``rounding_scales`` turns what the recipe read (the stream, the final norm's output, the split projections' own
outputs) into the ``Readout`` fields that ``selfcheck`` bounds the model's own low-precision rounding with.
Tensors in, tensors out.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

UNIT_ROUNDOFF = {torch.float64: 2.0**-53, torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
SIGMAS = 4.0  # allowance on a sum of independent roundings, in units of its scale (each rounding is <= u |x_i|)


def unit_roundoff(dtype: torch.dtype) -> float:
    """``u``: the largest relative rounding error of one operation in ``dtype`` (round to nearest)."""
    if dtype in UNIT_ROUNDOFF:
        return UNIT_ROUNDOFF[dtype]
    return 2.0 ** -(torch.finfo(dtype).nmant + 1) if dtype.is_floating_point else UNIT_ROUNDOFF[torch.float32]


@dataclass
class Rounding:
    """What the model's own rounding is bounded with, collected in the trace (unscaled, each ``[batch]``).

    Attributes:
        split_gaps: per checked split term (heads or neurons through one projection), what it wrote into the
            residual stream (read where it is added) along the term's direction, minus its parts and bias: the
            rounding of its low-precision output (and of any post-norm or multiplier after the projection).
        split_noise: per checked split term, ``k * sum_i (w_i u_i)^2`` of that write ``w`` (``k`` its roundings
            after the projection): the squared scale of that rounding.
        split_terms: per checked split term, ``(layer, index of the term in its block)`` (names it in an error).
        stream_noise: after each whole block, the stream around its adds, ``max(|before|, |after|)`` per channel read
            along the direction there, squared, times the number of adds.
    """

    split_gaps: list = field(default_factory=list)
    split_noise: list = field(default_factory=list)
    split_terms: list = field(default_factory=list)
    stream_noise: list = field(default_factory=list)

    def worst_term(self, u: float, scale: torch.Tensor, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(gap, allowed, term)`` ``[batch]`` of the checked split term whose gap most exceeds its own rounding
        (``SIGMAS * u * sqrt(noise)``), scaled by the final ``scale``; ``term`` is ``layer * 1024 + index`` as a
        float (-1: no term checked). The self-check holds ``|gap|`` to ``allowed`` plus its float32 floor."""
        batch = scale.shape[0]
        if not self.split_gaps:
            zero = torch.zeros(batch, device=device)
            return zero, zero, torch.full((batch,), -1.0, device=device)
        gaps = torch.stack([g.to(device) for g in self.split_gaps], -1) * scale.to(device).unsqueeze(-1)
        allowed = SIGMAS * u * torch.stack([n.to(device) for n in self.split_noise], -1).sqrt()
        allowed = allowed * scale.to(device).abs().unsqueeze(-1)
        worst = torch.argmax(gaps.abs() - allowed, -1, keepdim=True)
        names = torch.tensor([float(layer * 1024 + k) for layer, k in self.split_terms], device=device)
        return gaps.gather(-1, worst)[:, 0], allowed.gather(-1, worst)[:, 0], names[worst[:, 0]]

def stream_sumsq(before: torch.Tensor, after: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``[batch]``: ``sum((max(|before|, |after|) * v)^2)`` in float64 (streams ``[batch, (streams,) d_model]``)."""
    size = torch.maximum(before.abs(), after.to(before.device).abs()).double()
    v = v.to(size.device).double()
    return ((size * (v.unsqueeze(-2) if size.dim() == 3 else v)) ** 2).flatten(1).sum(-1).float()


def binade(x: torch.Tensor) -> torch.Tensor:
    """``2^floor(log2 |x|)`` (0 at 0): a value read in a low precision is off by at most ``u`` times this."""
    mantissa, exponent = torch.frexp(x.float())
    return torch.ldexp((mantissa != 0).float(), exponent - 1)  # 0 at 0, whose mantissa is 0 (a NaN's or inf's is not)


class NormRead(NamedTuple):
    """The frozen norm the attribution is read through, as the self-check bounds it: ``stream`` ``[batch,
    d_model]`` entering it, read along ``direction`` times ``scale``; ``output`` its output, read along ``head``;
    ``finite`` ``[batch]`` float, 1 where ``direction`` and ``head`` are finite, when known already (else read
    by ``rounding_scales``)."""

    stream: torch.Tensor
    direction: torch.Tensor
    scale: torch.Tensor
    output: torch.Tensor
    head: torch.Tensor
    finite: torch.Tensor | None = None


def rounding_scales(norm: NormRead, rounding: Rounding | None, size, scores, extra_adds: int = 0,
                    computed_in: torch.dtype = torch.float32) -> dict:
    """The ``Readout`` fields the self-check bounds the model's own rounding with (``[batch]`` tensors on the
    device, or floats; ``Readout.gathered`` brings them to the host with the values).

    ``norm``: the frozen norm read (``NormRead``); ``rounding`` what the trace collected (``Rounding``; None in
    float32); ``size`` the logits' own magnitude; ``scores`` ``[batch, n_components]`` unscaled (where a non-finite
    number starts); ``extra_adds`` the adds after the last whole block (before a direction's norm), bounded with
    the stream; ``computed_in`` the dtype the model computed in (``unit_roundoff``).
    """
    stream, direction, scale, output, head, finite = norm
    def norm2(a, b):  # in float64: squares of large finite activations must not overflow
        return ((a.double() * b.to(a.device).double()) ** 2).sum(-1).sqrt().float()

    def summed(terms):  # [batch] in order, or 0.0 for no terms (a float: written into the readout, not computed)
        if not terms:
            return 0.0
        total = terms[0].to(stream.device)
        for term in terms[1:]:
            total = total + term.to(stream.device)
        return total

    scale = scale.to(stream.device)
    rounding = rounding or Rounding()
    gap, noise, adds = summed(rounding.split_gaps), summed(rounding.split_noise), summed(rounding.stream_noise)
    if extra_adds:  # the adds after the last whole block, bounded with the stream entering the norm
        adds = adds + extra_adds * norm2(stream, direction) ** 2
    if finite is None:
        finite = (torch.isfinite(direction).all(-1) & torch.isfinite(head.to(direction.device)).all(-1)).float()
    u = torch.finfo(computed_in).eps / 2
    return {
        "unit_roundoff": u,
        "logit_size": size if isinstance(size, torch.Tensor) else float(size),
        "head_noise": norm2(output, head),
        "stream_noise": adds.sqrt() * scale.abs() if isinstance(adds, torch.Tensor) else 0.0,
        "split_gap": gap * scale if isinstance(gap, torch.Tensor) else 0.0,
        "split_noise": noise.sqrt() * scale.abs() if isinstance(noise, torch.Tensor) else 0.0,
        **(dict(zip(("split_worst_gap", "split_worst_allowed", "split_worst_term"),
                    rounding.worst_term(u, scale, stream.device))) if rounding.split_gaps else {}),
        "finite_head": finite,
        "first_nonfinite": first_nonfinite(scores),
    }


def finite(x: torch.Tensor) -> torch.Tensor:
    """``torch.isfinite(x)`` (a float tensor) in two ops where ``isfinite`` issues four (abs, ne, eq, mul): ``x - x``
    is exactly 0 for every finite ``x`` and NaN for an infinity or a NaN."""
    return (x - x) == 0


def first_nonfinite(scores: torch.Tensor) -> torch.Tensor:
    """``[batch]`` float: the first column of ``scores`` that is not finite, or -1 (on the device: no read of which
    rows are bad, so the host never waits for it)."""
    ok = finite(scores)
    first = torch.argmin(ok.to(torch.uint8), -1).float()  # argmin returns the first minimum: the first 0
    return torch.where(ok.all(-1), -1.0, first)
