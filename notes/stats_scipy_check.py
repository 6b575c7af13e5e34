"""The docs' dataset (notebooks/a-dataset.ipynb) through ``AttributionStats.summary`` before and after scipy.

Before: the t interval with the hand-written t quantile the package had (bisection on a continued fraction of the
incomplete beta function, copied here and nowhere else); after: ``scipy.stats.t.ppf``, as ``summary`` now calls
it. The rows are the notebook's own (its cell that builds ``data`` is run as it stands: 100 IOI prompts) on its
model, SmolLM2-135M-Instruct (about a minute on a CPU, so the real model, not a tiny one), attributed as the
notebook does (``by="head"``, ``reduce="stats"``, and the paired ``compare="corrupted"``). Printed: the largest
relative difference of ``ci_low`` / ``ci_high`` (expected <= 1e-12), and the streamed bootstrap interval and
sign-flip p of the statistics against ``scipy.stats.bootstrap(method="percentile")`` and
``scipy.stats.permutation_test(permutation_type="samples")`` on the same per-prompt rows, in units of their
Monte-Carlo standard error (the error model of tests/test_stats.py, with the normal density for the quantiles').

Run from the repository root (``PYTHONPATH=.``: this checkout's package, not another one installed editable):
``PYTHONPATH=. OMP_NUM_THREADS=1 .venv/bin/python notes/stats_scipy_check.py > notes/stats_scipy_check.txt``.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import time
from pathlib import Path

import numpy as np
import pandas as pd
import scipy.stats
import torch

import dla_recipes
from dla_recipes import Stats, models
from dla_recipes.present import stats as present_stats

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "a-dataset.ipynb"
SCIPY_RESAMPLES = 20_000
K = 5


# -- before: the package's hand-written t quantile, as it was (dla_recipes/present/stats.py before scipy) -----------
def t_quantile(p: float, df: float) -> float:
    """Student's t quantile (inverse CDF) at ``p`` with ``df`` degrees of freedom (bisection on the CDF)."""
    if not df > 0:
        return float("nan")
    if p == 0.5:
        return 0.0
    if p < 0.5:
        return -t_quantile(1.0 - p, df)
    low, high = 0.0, 1.0
    while t_cdf(high, df) < p:
        high *= 2.0
    for _ in range(200):
        middle = 0.5 * (low + high)
        low, high = (middle, high) if t_cdf(middle, df) < p else (low, middle)
        if high - low <= 1e-15 * high:
            break
    return 0.5 * (low + high)


def t_cdf(t: float, df: float) -> float:
    """Student's t CDF at ``t >= 0``: ``1 - I_x(df/2, 1/2) / 2``, ``x = df / (df + t^2)``."""
    return 1.0 - 0.5 * beta_inc(0.5 * df, 0.5, df / (df + t * t))


def beta_inc(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function ``I_x(a, b)`` (continued fraction, modified Lentz)."""
    if x <= 0.0 or x >= 1.0:
        return 0.0 if x <= 0.0 else 1.0
    if x > (a + 1.0) / (a + b + 2.0):
        return 1.0 - beta_inc(b, a, 1.0 - x)
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)) / a
    tiny, f, c, d = 1e-300, 1.0, 1.0, 0.0
    for i in range(400):
        m = i // 2
        if i == 0:
            num = 1.0
        elif i % 2 == 0:
            num = m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m))
        else:
            num = -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))
        d = 1.0 + num * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + num / c
        c = c if abs(c) > tiny else tiny
        f *= c * d
        if abs(1.0 - c * d) < 1e-16:
            break
    return front * (f - 1.0)


# -- the docs' dataset -------------------------------------------------------------------------------------------------
def docs_data(model) -> pd.DataFrame:
    """The notebook's ``data``: its cell that builds it, run as it stands (the trailing ``data.head(4)`` display
    is an expression, harmless)."""
    cells = json.loads(NOTEBOOK.read_text(encoding="utf-8"))["cells"]
    sources = ["".join(cell["source"]) for cell in cells if cell["cell_type"] == "code"]
    (source,) = [text for text in sources if "templates = [" in text]
    scope = {"model": model, "pd": pd}
    with contextlib.redirect_stdout(io.StringIO()):  # its print of the count
        exec(source, scope)  # noqa: S102 - the repository's own notebook cell
    return scope["data"]


def rows(attr) -> np.ndarray:
    """``[n, C]`` float64: each prompt's parts, constant and logit (the summary's columns)."""
    return torch.cat([attr.values, attr.constant[:, None], attr.logit[:, None]], -1).double().numpy()


# -- the checks --------------------------------------------------------------------------------------------------------
def t_before_after(name: str, stats, ci: float = 0.95) -> float:
    """``summary()`` now (scipy) against the old t quantile's interval on the same moments; returns the largest
    relative difference of ci_low / ci_high."""
    after = stats.summary(ci)
    t_old = t_quantile(0.5 + 0.5 * ci, stats.n - 1)
    t_new = float(scipy.stats.t.ppf(0.5 + 0.5 * ci, stats.n - 1))
    before = {"ci_low": after["mean"] - t_old * after["sem"], "ci_high": after["mean"] + t_old * after["sem"]}
    worst, worst_scaled = 0.0, 0.0
    for column in ("ci_low", "ci_high"):
        gap = (before[column] - after[column]).abs()
        nonzero = after[column] != 0
        worst = max(worst, float((gap[nonzero] / after[column][nonzero].abs()).max()))
        scale = after["mean"].abs() + t_new * after["sem"]
        worst_scaled = max(worst_scaled, float((gap[scale > 0] / scale[scale > 0]).max()))
    print(f"{name}: n = {stats.n}, t(0.975, {stats.n - 1}): before {t_old!r}, after {t_new!r}, relative "
          f"{abs(t_old - t_new) / t_new:.2e}")
    print(f"  ci_low / ci_high, before vs after: max relative difference {worst:.2e} (of the endpoint), "
          f"{worst_scaled:.2e} (of |mean| + t sem); <= 1e-12: {worst <= 1e-12}")
    return worst


def resampling_against_scipy(name: str, stats, x: np.ndarray, ci: float = 0.95) -> None:
    """The streamed bootstrap interval and sign-flip p against scipy's on the rows ``x``, in Monte-Carlo standard
    errors: an endpoint's sd sqrt(q (1 - q) / R) / phi(z) for each method (its replicates' sd, its R; the normal
    density, R = 200 being too few replicates for a difference quotient at q = 0.025), combined; the bias of the
    Poisson bootstrap z sd / (2n) shown apart. The p's: sqrt(p (1 - p) / R) (the package's) and
    sqrt(p (2 - p) / R_scipy) (scipy's 2 min(p_less, p_greater)), combined, plus 1 / (R + 1) for the two +1's."""
    n, replicates = x.shape[0], stats.replicates
    table = stats.summary(ci)
    ours = (stats.boot / stats.weight[:, None]).numpy()
    start = time.perf_counter()
    boot = scipy.stats.bootstrap((x,), np.mean, n_resamples=SCIPY_RESAMPLES, confidence_level=ci,
                                 method="percentile", axis=0, vectorized=True, batch=1000,
                                 rng=np.random.default_rng(0))
    perm = scipy.stats.permutation_test((x,), np.mean, permutation_type="samples", n_resamples=SCIPY_RESAMPLES,
                                        axis=0, vectorized=True, batch=1000, rng=np.random.default_rng(1))
    seconds = time.perf_counter() - start
    theirs = boot.bootstrap_distribution.T
    z = scipy.stats.norm.ppf(0.5 + ci / 2)
    density = math.exp(-z * z / 2) / math.sqrt(2 * math.pi)
    varies = theirs.std(0) > 0
    print(f"{name}: R = {replicates} streamed vs scipy's {SCIPY_RESAMPLES:,} resamples ({seconds:.1f} s), "
          f"{int(varies.sum())} of {x.shape[1]} columns vary")
    q = 0.5 - ci / 2
    error = math.sqrt(q * (1 - q)) / density * np.hypot(ours.std(0) / math.sqrt(replicates),
                                                         theirs.std(0) / math.sqrt(SCIPY_RESAMPLES))
    bias = z * theirs.std(0) / (2 * n)
    for column, reference in (("boot_low", boot.confidence_interval.low),
                              ("boot_high", boot.confidence_interval.high)):
        gap = np.abs(table[column].to_numpy() - reference)[varies]
        units = gap / error[varies]
        print(f"  {column}: |gap| / MC se: max {units.max():.2f}, 99th percentile {np.quantile(units, 0.99):.2f}, "
              f"median {np.median(units):.2f}, > {K}: {int((units > K).sum())}; the bias z sd / (2n) is at most "
              f"{(bias[varies] / error[varies]).max():.2f} se")
    p, p_scipy = table["p_signflip"].to_numpy(), perm.pvalue
    middle = (p + p_scipy) / 2
    p_error = np.sqrt(middle * (1 - middle) / replicates + middle * (2 - middle) / SCIPY_RESAMPLES)
    slack = 1 / (replicates + 1)
    inside = p_error > 0
    units = np.abs(p - p_scipy)[inside] / p_error[inside]
    beyond = int((np.abs(p - p_scipy) > K * p_error + slack).sum())
    print(f"  p_signflip: |gap| / MC se: max {units.max():.2f}, 99th percentile {np.quantile(units, 0.99):.2f}, "
          f"median {np.median(units):.2f}; beyond {K} se + 1/(R+1): {beyond}; max |gap| "
          f"{np.abs(p - p_scipy).max():.4f} (floor 1/(R+1) = {slack:.4f}); p < 0.05: {int((p < 0.05).sum())} "
          f"(scipy {int((p_scipy < 0.05).sum())})")


def main() -> None:
    if hasattr(present_stats, "t_quantile"):
        raise SystemExit(f"{present_stats.__file__} still has its hand-written t quantile: run with PYTHONPATH=.")
    print(f"dla_recipes from {Path(dla_recipes.__file__).parent.parent.name}/, scipy {scipy.__version__}, "
          f"torch {torch.__version__}, {torch.get_num_threads()} thread(s)")
    start = time.perf_counter()
    model = dla_recipes.load(models.default_model_path())
    data = docs_data(model)
    print(f"the docs' dataset: {len(data)} prompts ({NOTEBOOK.name}), SmolLM2-135M-Instruct loaded in "
          f"{time.perf_counter() - start:.1f} s")
    call = {"target": "io", "contrast": "s", "by": "head", "batch_size": 32, "progress": False}
    start = time.perf_counter()
    stats = dla_recipes.attribute_dataset(model, data, reduce="stats", **call)
    paired = dla_recipes.attribute_dataset(model, data, reduce="stats", compare="corrupted", **call)
    many = dla_recipes.attribute_dataset(model, data, reduce=Stats(replicates=10_000), **call)
    clean = rows(dla_recipes.attribute_dataset(model, data, **call))
    corrupted = rows(dla_recipes.attribute_dataset(model, data.assign(prompt=data.corrupted), **call))
    print(f"attributed (3 x statistics, 2 x rows) in {time.perf_counter() - start:.1f} s: {stats}, {paired}\n")

    print("== the t interval: before (hand-written quantile) and after (scipy.stats.t.ppf)")
    worst = max(t_before_after("stats", stats), t_before_after("paired", paired))
    print(f"largest relative difference of ci_low / ci_high over both: {worst:.2e}\n")

    print("== the streamed bootstrap interval and sign-flip p against scipy's on the same rows")
    resampling_against_scipy("stats (the docs' R = 200)", stats, clean)
    resampling_against_scipy("stats, R = 10,000 (the docs' suggestion for a Bonferroni claim)", many, clean)
    resampling_against_scipy("paired (clean - corrupted, the docs' R = 200)", paired, clean - corrupted)


if __name__ == "__main__":
    main()
