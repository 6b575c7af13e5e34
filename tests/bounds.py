"""Tolerances from a stated error model, not from one machine.

A test that compares two floating-point results holds them to a bound computed here from the dtype's unit roundoff
``u``, the number of terms the computation summed and the magnitudes of those terms (read from the tensors the test
has), never to a constant that one machine measured. The bound then holds on any machine that rounds to nearest,
whatever order its kernels sum in (AVX2, AVX-512 / AMX, a GPU), and each test's comment names the model in one line.

The models (Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed., sections 2.2 and 3.1):

- one operation: ``fl(x op y) = (x op y)(1 + d)``, ``|d| <= u`` (``unit_roundoff``);
- a sum of ``n`` terms, in any order or blocking: ``|fl(sum x) - sum x| <= gamma_n * sum |x|`` with
  ``gamma_n = n u / (1 - n u)`` (``sum_bound``); a dot product of ``n`` terms the same with ``|a_i b_i|``
  (``dot_bound``); FMA only lowers the real error;
- a value two computations (another batch, kernel or attention implementation) both compute: each is within its
  own rounding of the exact value, so they differ by at most the sum of the two (``rounded_bound``: one side's,
  a test adds both).

These are worst cases, typically 10-100x the errors a machine shows (rounding errors mostly cancel); a test whose
gap comes near its bound is a finding, not noise. Where the worst case exceeds what a test promises (the float32
promise ``1e-4 * max(1, |logit|)``: a logit is a ``d_model``-term dot, and ``gamma_576`` times its terms is
already above it on SmolLM2-135M), the promise is the bound and the comment says so.

One model is not a worst case: ``random_bound``, for many elementwise roundings carried along a direction (a
bfloat16 residual stream's adds, a stored norm output read by the unembedding), where the worst case exceeds the
logit itself. Each rounding is independent with mean zero (the self-check's model, ``dla_recipes.selfcheck``), so
their sum is within ``SIGMAS`` of its scale; elementwise roundings have no order to depend on a machine.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

SIGMAS = 4.0  # random_bound's allowance, in units of the scale of a sum of independent roundings (the self-check's)


def unit_roundoff(dtype: torch.dtype = torch.float32) -> float:
    """``u = eps / 2``: the largest relative error of one rounding to nearest in ``dtype`` (2^-24 in float32,
    2^-8 in bfloat16, 2^-11 in float16, 2^-53 in float64)."""
    return torch.finfo(dtype).eps / 2


def gamma(n: int, dtype: torch.dtype = torch.float32) -> float:
    """``gamma_n = n u / (1 - n u)``: the relative error of ``n`` roundings in a row (Higham's Lemma 3.1)."""
    nu = n * unit_roundoff(dtype)
    if nu >= 1:
        raise ValueError(f"gamma_{n} in {dtype} is not defined: n * u = {nu} >= 1")
    return nu / (1 - nu)


def sum_bound(terms: torch.Tensor, dtype: torch.dtype = torch.float32, dim: int = -1, n: int | None = None):
    """Model: a float32 (``dtype``) sum of the ``n`` terms along ``dim``, in any order: its error is at most
    ``gamma_n * sum |terms|`` (``n`` defaults to the terms' count; pass more where the sum had more roundings,
    such as terms that were themselves rounded). Returns that bound, in float64, with ``dim`` summed away."""
    count = terms.shape[dim] if n is None else n
    return gamma(count, dtype) * terms.detach().double().abs().sum(dim)


def dot_bound(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype = torch.float32, dim: int = -1):
    """Model: a dot product ``a . b`` along ``dim`` (``n`` products, each rounded, summed in any order, as in a
    matmul ``stream @ W_U``) in ``dtype``: its error is at most ``gamma_n * sum |a_i b_i|``. Broadcasts ``a`` and
    ``b``; returns the bound in float64, with ``dim`` summed away."""
    products = a.detach().double() * b.detach().double()
    return gamma(products.shape[dim], dtype) * products.abs().sum(dim)


def half_ulp(value, dtype: torch.dtype = torch.float32):
    """Model: storing ``value`` in ``dtype`` moves it by at most half its ulp, ``u * 2^floor(log2 |value|)`` (0 at
    0; normal numbers). A tensor in, a float64 tensor out; a float in, a float out."""
    x = torch.as_tensor(value, dtype=torch.float64)
    _, exponent = torch.frexp(x)
    bound = torch.where(x == 0, torch.zeros_like(x), torch.ldexp(torch.ones_like(x), exponent - 1))
    bound = unit_roundoff(dtype) * bound
    return float(bound) if not isinstance(value, torch.Tensor) else bound


def rounded_bound(value, magnitude, n: int, dtype: torch.dtype = torch.float32, out_dtype: torch.dtype | None = None):
    """Model: ``value`` as one computation rounded it, to compare with another computation of it (another batch,
    kernel or attention implementation): a sum or dot of ``n`` terms in ``dtype`` whose ``|terms|`` sum to
    ``magnitude``, then stored in ``out_dtype`` (default ``dtype``): ``gamma_n * magnitude + half_ulp(value)``.
    Each side of the comparison has its own; a test adds the two."""
    return gamma(n, dtype) * magnitude + half_ulp(value, out_dtype or dtype)


def random_bound(terms: torch.Tensor, dtype: torch.dtype, sigmas: float = SIGMAS) -> float:
    """Model: each of ``terms`` (every entry: a value rounded once in ``dtype``, times the weight it is read with) is
    off by an independent, mean-zero error of at most ``u`` of itself; their sum is then off by at most ``sigmas *
    u * sqrt(sum terms^2)`` except with probability ``2 exp(-sigmas^2 / 2)`` (Hoeffding; 7e-4 at 4, far less for
    real roundings, whose spread is under ``u / sqrt(3)``)."""
    return sigmas * unit_roundoff(dtype) * float(terms.detach().double().pow(2).sum().sqrt())


def read_rounding(d: int, adds: int, dtype: torch.dtype = torch.float32) -> float:
    """Model, relative to ``sum_j |v_j y_j|``: a residual stream of ``d`` channels rounded by ``adds`` adds (each at
    most ``u`` at the stream's own size), normed (a mean of ``d`` squares and a root, ``gamma_{d+1} / 2 + 2u`` of
    the scale; the scale and gain applied and stored, ``3u`` a channel) to ``y`` and read along a direction ``v``
    by a ``d``-term dot (``gamma_d``). Reductions accumulate in float32 for a lower ``dtype`` (as torch's matmuls
    and norms do); the adds and stores round in ``dtype``."""
    accumulated = torch.float32 if torch.finfo(dtype).bits < 32 else dtype
    return (gamma(d, accumulated) + gamma(d + 1, accumulated) / 2 + 2 * unit_roundoff(accumulated)
            + (adds + 3) * unit_roundoff(dtype))


_ABSOLUTE: dict[int, tuple] = {}  # id(weight) -> (weight, |weight| in float32): the last weight's only (a copy kept
# per model would hold every real model's unembedding for the whole session: 1.3 GB a Gemma-3 load)


def absolute_product(y: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``|y| @ |weight|^T`` in float64 (``[pos, d]`` by ``[vocab, d]``): computed in float32 with a cached ``|weight|``
    (a 262k-row unembedding is 0.7 GB), then divided by ``1 - gamma_d`` (a float32 sum of positive terms is at least
    ``1 - gamma_d`` of the exact one), so it stays an upper bound of the exact sums."""
    if id(weight) not in _ABSOLUTE:
        _ABSOLUTE.clear()
        _ABSOLUTE[id(weight)] = (weight, weight.detach().float().abs())
    product = y.detach().float().abs() @ _ABSOLUTE[id(weight)][1].T
    return product.double() / (1 - gamma(y.shape[-1]))


def logit_rounding(model, ids) -> torch.Tensor:
    """``[pos, vocab]`` float64: how far a plain forward of the token ids ``ids`` (one prompt, no padding) may have
    rounded each logit before the family's soft-cap (what the tests undo the cap to). Model: the logit
    ``z = logit_scale * (W_U[t] . y + b_t)`` is the final norm's output ``y`` read along ``W_U[t]``
    (``read_rounding`` times ``sum_j |W_U[t, j] y_j|``, ``adds`` the components of ``by="block"``), then stored
    (half its ulp). A soft-cap ``c tanh(z / c)`` rounds ``3u`` of the capped value more, and undoing it divides that
    by ``1 - (y / c)^2``. ``y`` is read on a forward pre-hook of the output embedding."""
    from dla_recipes.plan import build_plan

    plan = build_plan(model)
    head = model._module.get_output_embeddings()
    seen = {}
    handle = head.register_forward_pre_hook(lambda module, args: seen.update(y=args[0][0].detach()))
    try:
        ids = torch.as_tensor(ids).reshape(1, -1)
        with torch.no_grad():
            logits = model._module(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0].double()
    finally:
        handle.remove()
    weight = head.weight.detach()
    y = seen["y"].double()
    magnitude = abs(plan.logit_scale) * absolute_product(y, weight)  # [pos, vocab]: sum_j |W_U[t, j] y_j|
    if head.bias is not None:
        magnitude = magnitude + abs(plan.logit_scale) * head.bias.detach().double().abs()
    bound = read_rounding(y.shape[-1], len(plan.components("block")), weight.dtype) * magnitude
    stored = half_ulp(logits, weight.dtype)
    if plan.softcap is None:
        return bound + stored
    capped = logits / plan.softcap
    return bound + (stored + 3 * unit_roundoff(weight.dtype) * logits.abs()) / (1 - capped * capped)


class Moments(NamedTuple):
    """``[C]`` float64 each: how far two computations of the rows' mean, ``m2`` and std may differ."""

    mean: torch.Tensor
    m2: torch.Tensor
    std: torch.Tensor


def moments_bound(x) -> Moments:
    """How far two float64 computations of the mean, ``m2 = sum (x - mean)^2`` and std of the rows ``x`` (``[n, C]``;
    chunks merged by Chan's formula in any grouping, or numpy's) may differ. Model: each side takes every sample
    through at most ``4n`` roundings (a chunk's sum and division, each merge's delta, product and add):
    ``gamma_4n * max |x|`` for the mean; ``m2`` to ``gamma_4n * sum (|x| + |mean|)^2``; and ``std = sqrt(m2 / (n -
    1))`` moves by that over ``2 (n - 1) std``, plus ``2u`` of it. Both sides: twice each."""
    x = torch.as_tensor(x, dtype=torch.float64)
    n = x.shape[0]
    g = gamma(4 * n, torch.float64)
    mean = g * x.abs().amax(0)
    m2 = g * ((x.abs() + x.mean(0).abs()) ** 2).sum(0)
    std = x.std(0)
    u = unit_roundoff(torch.float64)
    std_bound = torch.where(std > 0, m2 / (2 * max(n - 1, 1) * std.clamp(min=1e-300)) + 2 * u * std, m2.sqrt())
    return Moments(2 * mean, 2 * m2, 2 * std_bound)
