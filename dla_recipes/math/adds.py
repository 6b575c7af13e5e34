"""The per-add check: each block's residual adds, channel by channel, against what its components wrote.

The whole-logit check (``selfcheck``, step 4) must allow the rounding of every residual add and of the logit at
once, so in low precision a write no component made hides below that bound. This check is local: at each checked
block the stream leaving it (``after`` ``[n, d_model]``, the model's own, read at the sites) must equal the stream
entering it (``before``) plus what each of its ``K`` terms wrote (``w_k`` ``[n, d_model]``, float32, as added),
channel by channel, within the rounding of the adds themselves. Every partial sum of the block has magnitude at
most ``S = |before| + sum_k |w_k|`` (per channel), so each add rounds by at most half an ulp of ``S``,
``u * b(S)`` (``b(x) = 2^floor(log2 |x|)``; ``u`` of the stream's dtype), in whatever order the family adds its
terms (a parallel block, a module that adds the residual itself); a term whose write goes through ``r`` more
roundings in its own dtype (a bias, a scale, a multiplier applied after the read) adds ``r * u_w * |w_k|``; an add
of low-precision numbers computed in float32 and then rounded (PyTorch's, on CPU and GPU) may round twice, ``u32 *
S`` more each, and the recipe's own float32 sum of the ``K + 1`` operands adds ``K * u32 * S``. In all:
``K * u * b(S) + (2K + 1) * u32 * S + sum_k r_k u_w |w_k|``, times ``SLACK`` for the second-order terms. The bound
is attained: in bfloat16 two adds that each round a tie by half an ulp the same way reach it (a healthy model's
largest ratio is then ``1 / SLACK``), and nothing healthy exceeds it. Between two checked blocks the stream is not
touched: the next block's input must be the last one's output bit for bit (a hook on a block's output changes what
the next block reads, not what nnsight read as that output).

Each boundary is reduced on the device to ``[n]`` numbers: the largest ratio of gap to allowed rounding over the
channels, and the gap's and the stream's norms; ``AddCheck.fields`` keeps, per site, the first boundary whose ratio
exceeds 1 (else the worst), as ``Readout`` fields (``add_ratio``, ``add_where``, ``add_gap``, ``add_norm``). The
self-check raises ``ExactnessError`` naming that boundary: ``add_where = 2 * i`` is block ``i``'s adds,
``2 * i + 1`` the stream between block ``i`` and what reads its output next.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .rounding import UNIT_ROUNDOFF, binade, unit_roundoff

U32 = UNIT_ROUNDOFF[torch.float32]
SLACK = 1.0 + 2.0**-6  # second-order terms of the roundings (products of two u's), with room to spare


@dataclass
class Written:
    """One term's write as the stream receives it: ``value`` ``[n, d_model]`` float32, ``roundings`` the roundings
    it goes through after the value read (bias, scale, multiplier), each in ``dtype`` (the read value's)."""

    value: torch.Tensor
    roundings: int = 0
    dtype: torch.dtype = torch.float32


@dataclass
class AddCheck:
    """What the trace collects, per checked boundary (each ``[n]``): ``ratios`` (largest gap over allowed rounding
    over the channels), ``gaps`` (the unexplained write's norm), ``norms`` (the stream's norm there), ``codes``."""

    ratios: list = field(default_factory=list)
    gaps: list = field(default_factory=list)
    norms: list = field(default_factory=list)
    codes: list = field(default_factory=list)
    last: tuple | None = None  # (index, output [n, d_model]) of the last block checked, for what reads it next
    dtype: torch.dtype = torch.float32  # the coarsest dtype the streams and writes were in (the activations')

    def block(self, index: int, before: torch.Tensor, writes: list[Written], after: torch.Tensor) -> None:
        """Block ``index``'s adds: ``after`` against ``before`` plus ``writes`` (all ``[n, d_model]``)."""
        total, size, own = before.float(), before.float().abs(), 0.0
        self.dtype = coarsest(self.dtype, before.dtype, after.dtype, *(w.dtype for w in writes))
        for write in writes:
            w = write.value.to(total.device).float()
            total, size = total + w, size + w.abs()
            if write.roundings:
                own = own + write.roundings * unit_roundoff(write.dtype) * w.abs()
        adds = len(writes)
        allowed = (adds * unit_roundoff(after.dtype) * binade(size) + (2 * adds + 1) * U32 * size + own) * SLACK
        self._gap(2 * index, after.float() - total, allowed + adds * tiny(after.dtype), after)
        self.last = (index, after)

    def between(self, index: int, out: torch.Tensor, into: torch.Tensor) -> None:
        """The stream leaving block ``index`` (``out``) against what reads it next (``into``): equal."""
        self._gap(2 * index + 1, into.float() - out.float().to(into.device), tiny(into.dtype), into)

    def _gap(self, code: int, gap: torch.Tensor, allowed, stream: torch.Tensor) -> None:
        self.ratios.append((gap.abs() / allowed).amax(-1))
        self.gaps.append(gap.double().norm(dim=-1).float())
        self.norms.append(stream.double().norm(dim=-1).float())
        self.codes.append(code)

    def fields(self) -> dict:
        """The ``Readout`` fields (``[n]`` on the device), or ``{}`` when no boundary was checked."""
        if not self.ratios:
            return {}
        ratios = torch.stack(self.ratios, -1)  # [n, boundaries]
        nan = torch.isnan(ratios)  # a non-finite stream: the self-check's NonFiniteError names it, not this
        ratios = torch.where(nan, torch.zeros_like(ratios), ratios)
        failed = ratios > 1
        first = torch.argmax(failed.to(torch.uint8), -1)  # the first boundary that fails, in forward order
        pick = torch.where(failed.any(-1), first, torch.argmax(ratios, -1)).unsqueeze(-1)
        codes = torch.stack([torch.full_like(ratios[:, 0], float(c)) for c in self.codes], -1)  # filled, not copied
        return {"add_ratio": ratios.gather(-1, pick)[:, 0], "add_where": codes.gather(-1, pick)[:, 0],
                "add_gap": torch.stack(self.gaps, -1).gather(-1, pick)[:, 0],
                "add_norm": torch.stack(self.norms, -1).gather(-1, pick)[:, 0]}


def coarsest(*dtypes: torch.dtype) -> torch.dtype:
    """The dtype of ``dtypes`` with the largest unit roundoff (the precision a computation mixing them had)."""
    return max(dtypes, key=unit_roundoff)


def tiny(dtype: torch.dtype) -> float:
    """The rounding of an add whose result is subnormal in ``dtype``: at most half the subnormals' spacing."""
    info = torch.finfo(dtype) if dtype.is_floating_point else torch.finfo(torch.float32)
    return float(info.smallest_normal) * unit_roundoff(dtype) * 2


def where(code: float, layers: int) -> str:
    """The boundary ``code`` names (``AddCheck``), as an error message says it."""
    i, between = divmod(int(code), 2)
    if not between:
        return f"block {i}'s residual adds"
    reader = "the final norm" if i == layers - 1 else f"block {i + 1}"
    return f"the stream between block {i}'s output and {reader}'s input"
