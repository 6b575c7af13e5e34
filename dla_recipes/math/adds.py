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
from itertools import pairwise

import torch

from .rounding import UNIT_ROUNDOFF, unit_roundoff

U32 = UNIT_ROUNDOFF[torch.float32]
SLACK = 1.0 + 2.0**-6  # second-order terms of the roundings (products of two u's), with room to spare


@dataclass
class Written:
    """One term's write as the stream receives it: ``value`` ``[n, d_model]`` (the read, in its own ``dtype``, or
    float32 when ``roundings`` ops were applied after it: a bias, a scale, a multiplier, each rounded in ``dtype``)."""

    value: torch.Tensor
    roundings: int = 0
    dtype: torch.dtype = torch.float32


@dataclass
class AddCheck:
    """What the trace collects: ``blocks`` ``(index, before, writes, after)`` and ``joins`` ``(index, out, into)``
    (each stream ``[n, d_model]`` at the sites), reduced all at once after the forward pass (``fields``: a few
    kernels per group of alike blocks, not a dozen per block)."""

    blocks: list = field(default_factory=list)
    joins: list = field(default_factory=list)
    last: tuple | None = None  # (index, output [n, d_model]) of the last block checked, for what reads it next
    dtype: torch.dtype = torch.float64  # the coarsest dtype the streams and writes were in (the activations')

    def block(self, index: int, before: torch.Tensor, writes: list[Written], after: torch.Tensor) -> None:
        """Block ``index``'s adds: ``after`` against ``before`` plus ``writes`` (all ``[n, d_model]``)."""
        self.dtype = coarsest(self.dtype, before.dtype, after.dtype, *(w.dtype for w in writes))
        self.blocks.append((index, before, writes, after))
        self.last = (index, after)

    def between(self, index: int, out: torch.Tensor, into: torch.Tensor) -> None:
        """The stream leaving block ``index`` (``out``) against what reads it next (``into``): equal."""
        self.joins.append((index, out, into))

    def fields(self) -> dict:
        """The ``Readout`` fields (``[n]`` on the device), or ``{}`` when no boundary was checked."""
        groups: dict = {}  # blocks alike in their terms' roundings and dtypes: reduced together
        for entry in self.blocks:
            _, before, writes, after = entry
            key = (before.dtype, after.dtype, tuple((w.roundings, w.dtype, w.value.dtype) for w in writes))
            groups.setdefault(key, []).append(entry)
        parts = [block_gaps(entries) for entries in groups.values()]
        if self.joins:
            out = torch.stack([o for _, o, _ in self.joins]).float()
            into = torch.stack([i for _, _, i in self.joins])
            gap = into.float() - out.to(into.device)
            parts.append(([2 * i + 1 for i, _, _ in self.joins], gap.abs().amax(-1) / tiny(into.dtype), gap, into))
        if not parts:
            return {}
        ratios = torch.cat([p[1] for p in parts])  # [boundaries, n]
        ratios = torch.where(torch.isnan(ratios), torch.zeros_like(ratios), ratios)  # NaN: NonFiniteError's
        code = torch.cat([filled(p[0], ratios.device) for p in parts])  # [boundaries], made on the device
        key = torch.where(ratios > 1, 1e30 - code.unsqueeze(-1), ratios.clamp(max=1))  # the first failing, else worst
        pick = torch.argmax(key, 0)  # [n]
        gaps, streams = (torch.cat([p[k] for p in parts]) for k in (2, 3))  # [boundaries, n, d_model]
        rows = torch.arange(pick.shape[0], device=pick.device)
        gap, stream = gaps[pick, rows].double(), streams[pick, rows].double()  # [n, d_model]: float64, no overflow
        return {"add_ratio": ratios.gather(0, pick.unsqueeze(0))[0], "add_where": code[pick],
                "add_gap": gap.norm(dim=-1).float(), "add_norm": stream.norm(dim=-1).float()}


def block_gaps(entries: list) -> tuple:
    """``(codes, ratios [blocks, n], gaps, streams [blocks, n, d_model])`` of blocks alike (``AddCheck.fields``)."""
    before = torch.stack([b for _, b, _, _ in entries]).float()  # [blocks, n, d_model]
    after = torch.stack([a for _, _, _, a in entries])
    total, size, own = before, before.abs(), 0.0
    for k, write in enumerate(entries[0][2]):
        w = torch.stack([ws[k].value for _, _, ws, _ in entries]).float().to(total.device)
        total, size = total + w, size + w.abs()
        if write.roundings:
            own = own + write.roundings * unit_roundoff(write.dtype) * w.abs()
    adds = len(entries[0][2])
    allowed = (adds * unit_roundoff(after.dtype) * float_binade(size) + (2 * adds + 1) * U32 * size + own) * SLACK
    gap = after.float() - total
    return [2 * i for i, _, _, _ in entries], (gap.abs() / (allowed + adds * tiny(after.dtype))).amax(-1), gap, after


def filled(codes: list[int], device) -> torch.Tensor:
    """``codes`` as a float32 tensor made on ``device`` (an arange, or one fill each): no copy from the host, which
    would make it wait for the device (the forward may still run: ``attribute_direction`` stops inside it)."""
    if len(codes) > 1 and all(b - a == 2 for a, b in pairwise(codes)):
        return torch.arange(codes[0], codes[-1] + 1, 2, dtype=torch.float32, device=device)
    return torch.stack([torch.full((), float(c), device=device) for c in codes])


def float_binade(x: torch.Tensor) -> torch.Tensor:
    """``2^floor(log2 x)`` of a float32 ``x >= 0``: its exponent bits alone (0 for a subnormal: ``tiny`` covers it)."""
    return (x.view(torch.int32) & 0x7F800000).view(torch.float32)


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
