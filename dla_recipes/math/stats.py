"""Per-component statistics of a batch of sites, reduced in the trace: moments, signs, bootstrap and sign-flip sums.

``accumulate(values [n, C], index [n], seed, replicates)`` returns what one batch contributes to a dataset's
statistics, ``O(C x R)`` numbers whatever ``n``: the count, the mean and ``M2`` (the sum of squared deviations from
the batch's mean: merged across batches with Chan's parallel formula), the count of positive values, and ``R``
replicate sums of two resampling schemes:

- a Poisson bootstrap: site ``i`` weighs ``w_ir ~ Poisson(1)`` in replicate ``r``; ``boot [R, C] = w^T values`` and
  ``weight [R] = sum_i w_ir`` (a replicate's mean is ``boot / weight``);
- a sign flip: ``flip [R, C] = s^T values`` with ``s_ir = +-1`` (the null distribution of the sum of a symmetric
  variable centred at 0).

The random numbers are a deterministic function of ``(seed, index[i], r)`` computed with integer tensor
arithmetic (splitmix64 on int64, then Poisson(1) by its inverse CDF from a small table): no ``torch.Generator``,
so any batching of the same sites, locally or on a server, draws the same weights. ``index`` names each sample
(``trace.stats``: the prompt's index in the dataset times ``2**32`` plus its position column).
"""

from __future__ import annotations

import math

import torch

from .linalg import exact

_MASK64 = (1 << 64) - 1


def _signed(value: int) -> int:
    """A 64-bit unsigned constant as the int64 it is stored as."""
    value &= _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


GOLDEN = _signed(0x9E3779B97F4A7C15)
MIX1 = _signed(0xBF58476D1CE4E5B9)
MIX2 = _signed(0x94D049BB133111EB)
POISSON_MAX = 24  # Poisson(1) above this has probability < 1e-25, far below the 2^-53 resolution of the uniforms
POISSON_CDF = tuple(math.exp(-1.0) * sum(1.0 / math.factorial(i) for i in range(k + 1)) for k in range(POISSON_MAX))


def shift_right(x: torch.Tensor, k: int) -> torch.Tensor:
    """The logical right shift of int64 ``x`` by ``k`` (torch's ``>>`` is arithmetic on signed integers)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def splitmix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's output function of int64 ``x`` (wrapping two's complement arithmetic, as uint64 bits)."""
    z = x + GOLDEN
    z = (z ^ shift_right(z, 30)) * MIX1
    z = (z ^ shift_right(z, 27)) * MIX2
    return z ^ shift_right(z, 31)


def hashes(index: torch.Tensor, seed: int, replicates: int) -> torch.Tensor:
    """``[n, R]`` int64: the hash of ``(seed, index[i], r)``, a counter-based random stream."""
    index = index.to(torch.int64)
    key = splitmix64(torch.full_like(index, _signed(seed)))
    site = splitmix64(index ^ key)  # [n]
    reps = splitmix64(torch.arange(replicates, dtype=torch.int64, device=index.device) * GOLDEN + key[:1])  # [R]
    return splitmix64(site[:, None] ^ reps[None, :])


def uniforms(h: torch.Tensor) -> torch.Tensor:
    """``[...]`` float64 in ``[0, 1)``: the top 53 bits of the hashes ``h``."""
    return shift_right(h, 11).double() * 2.0**-53


def poisson_weights(index: torch.Tensor, seed: int, replicates: int) -> torch.Tensor:
    """``[n, R]`` float64: site ``i``'s Poisson(1) bootstrap weight in replicate ``r`` (inverse CDF)."""
    u = uniforms(hashes(index, seed, replicates))
    counts = torch.zeros_like(u)
    for c in POISSON_CDF:  # k = #{j : u >= P(K <= j)}
        counts += (u >= c).double()
    return counts


def flip_signs(index: torch.Tensor, seed: int, replicates: int) -> torch.Tensor:
    """``[n, R]`` float64: site ``i``'s sign (+1 / -1) in sign-flip replicate ``r`` (a second hash's low bit)."""
    bit = splitmix64(hashes(index, seed, replicates)) & 1
    return 1.0 - 2.0 * bit.double()


def accumulate(values: torch.Tensor, index: torch.Tensor, seed: int, replicates: int) -> dict:
    """One batch's statistics of ``values`` ``[n, C]`` (one row a sample, named by ``index`` ``[n]`` int64), in
    float64 on ``values``' device: ``count []``, ``mean [C]``, ``m2 [C]``, ``positive [C]``, ``boot [R, C]``,
    ``weight [R]``, ``flip [R, C]`` (see the module docstring)."""
    index = index.to(values.device)
    with exact():
        x = values.double()
        mean = x.mean(0)
        m2 = ((x - mean) ** 2).sum(0)
        w = poisson_weights(index, seed, replicates)
        s = flip_signs(index, seed, replicates)
        return {
            "count": torch.tensor(float(x.shape[0]), dtype=torch.float64),
            "mean": mean,
            "m2": m2,
            "positive": (x > 0).double().sum(0),
            "boot": w.T @ x,
            "weight": w.sum(0),
            "flip": s.T @ x,
        }


def merged(a, b) -> dict:
    """The accumulators of two disjoint sets of samples (``a``, ``b``: anything with ``accumulate``'s fields as
    attributes, ``count`` a number or a ``[]`` tensor), as one: counts and replicate sums add, the means and ``m2``
    merge by Chan's parallel formula (``m2 = m2_a + m2_b + delta^2 n_a n_b / n``)."""
    na, nb = a.count, b.count
    total = na + nb
    delta = b.mean - a.mean
    return {"count": total, "mean": a.mean + delta * (nb / total), "m2": a.m2 + b.m2 + delta**2 * (na * nb / total),
            "positive": a.positive + b.positive, "boot": a.boot + b.boot, "weight": a.weight + b.weight,
            "flip": a.flip + b.flip}

