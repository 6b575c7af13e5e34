"""The rounding the model itself did, measured in the trace for the self-check, and where a NaN or inf starts.

``rounding_scales`` turns what the recipe read (the stream, the final norm's output, the split projections' own
outputs) into the ``Readout`` fields that ``selfcheck`` bounds the model's own low-precision rounding with.
Tensors in, tensors out.
"""

from __future__ import annotations

import torch


def stream_sumsq(before: torch.Tensor, after: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``[batch]``: ``sum((max(|before|, |after|) * v)^2)`` in float64 (streams ``[batch, (streams,) d_model]``)."""
    size = torch.maximum(before.abs(), after.to(before.device).abs()).double()
    v = v.to(size.device).double()
    return ((size * (v.unsqueeze(-2) if size.dim() == 3 else v)) ** 2).flatten(1).sum(-1).float()

def binade(x: torch.Tensor) -> torch.Tensor:
    """``2^floor(log2 |x|)`` (0 at 0): a value read in a low precision is off by at most ``u`` times this."""
    mantissa, exponent = torch.frexp(x.float())
    return torch.where(x == 0, torch.zeros_like(mantissa), torch.ldexp(torch.ones_like(mantissa), exponent - 1))

def rounding_scales(stream, direction, scale, output, head, splits, size, scores, extra_adds: int = 0,
                    computed_in: torch.dtype = torch.float32) -> dict:
    """The ``Readout`` fields the self-check bounds the model's own rounding with (all ``[batch]``, on the CPU).

    ``stream`` ``[batch, d_model]`` entering the frozen norm, read along ``direction`` times ``scale``; ``output``
    the norm's output read along ``head``; ``splits`` the split terms' unscaled ``(gap, squared noise)``; ``size``
    the logits' own magnitude; ``scores`` ``[batch, n_components]`` unscaled (where a non-finite number starts);
    ``extra_adds`` the adds after the last whole block (before a direction's norm), bounded with ``stream``;
    ``computed_in`` the dtype the model computed in (``unit_roundoff``).
    """
    def norm2(a, b):  # in float64: squares of large finite activations must not overflow
        return ((a.double() * b.to(a.device).double()) ** 2).sum(-1).sqrt().float()

    scale = scale.to(stream.device)
    zero = torch.zeros(stream.shape[0], device=stream.device)
    splits = splits or []
    gap = sum((e[1].to(stream.device) for e in splits if e[0] == "split"), zero) * scale
    noise = sum((e[2].to(stream.device) for e in splits if e[0] == "split"), zero).sqrt() * scale.abs()
    adds = sum((e[1].to(stream.device) for e in splits if e[0] == "stream"), zero)
    adds = adds + extra_adds * norm2(stream, direction).to(adds.device) ** 2  # adds after the last whole block
    finite = torch.isfinite(direction).all(-1) & torch.isfinite(head.to(direction.device)).all(-1)
    return {
        "unit_roundoff": torch.full((stream.shape[0],), torch.finfo(computed_in).eps / 2),
        "logit_size": torch.as_tensor(size, dtype=torch.float32).expand(stream.shape[0]).cpu(),
        "head_noise": norm2(output, head).cpu(),
        "stream_noise": (adds.sqrt() * scale.abs()).cpu(),
        "split_gap": gap.cpu(),
        "split_noise": noise.cpu(),
        "finite_head": finite.float().cpu(),
        "first_nonfinite": first_nonfinite(scores).cpu(),
    }

def first_nonfinite(scores: torch.Tensor) -> torch.Tensor:
    """``[batch]`` float: the first column of ``scores`` that is not finite, or -1."""
    bad = ~torch.isfinite(scores)
    first = torch.argmax(bad.to(torch.uint8), -1).float()  # argmax returns the first maximum
    return torch.where(bad.any(-1), first, torch.full_like(first, -1.0))
