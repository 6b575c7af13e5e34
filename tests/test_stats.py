"""``reduce="stats"`` (issue 20): per-component statistics reduced in the trace, against numpy and scipy.

The reference is the per-site rows of ``reduce=None`` on the same prompts (whose parts the other suites check
against the model's own logits; here the self-check on every row holds them to it too): the mean, std and sem are
numpy's on them, the t interval ``scipy.stats.t.ppf`` times numpy's sem, the share positive exactly; the bootstrap
interval against ``scipy.stats.bootstrap(method="percentile")`` and the sign-flip p-value against
``scipy.stats.permutation_test(permutation_type="samples")`` (one sample: its signs flipped) of those rows (20,000
resamples each, theirs and ours), within their Monte-Carlo error. Also: the same statistics with any
``batch_size``, merged chunks equal one call, remote == local on the loopback server, paired differences, positions
pooled, ``attribute_direction``, a planted fault still raises the same ``ExactnessError`` (and a NaN the same
``NonFiniteError``), bytes back flat in the number of prompts, and bad input named.
"""

from __future__ import annotations

import math
import random

import bounds
import numpy as np
import pytest
import scipy.stats
import torch
from conftest import CONTRAST, PROMPTS, TARGET, serve_tiny, single_threaded, tiny_model
from mutants import MUTANTS
from test_positions import batch_bound, difference, ids_of

import dla_recipes
from dla_recipes import AttributionStats, ExactnessError, InputError, NonFiniteError, Stats
from dla_recipes.testing import tiny
from dla_recipes.trace import plain, terms
from dla_recipes.trace import stats as trace_stats

FAMILIES = ("llama", "gpt2", "gemma2", "gpt_neox", "mixtral", "deepseek_v3", "recurrent_gemma", "inkling")


def dataset(n: int, seed: int = 0) -> list[str]:
    """``n`` prompts of 2..6 tiny-vocabulary words (different lengths: padded batches)."""
    rng = random.Random(seed)
    return [" ".join(f"w{rng.randrange(5, 40)}" for _ in range(rng.randrange(2, 7))) for _ in range(n)]


def rows(attr) -> np.ndarray:
    """``[n_sites, C]`` float64: each site's parts, constant and logit (a ``PositionAttribution``: its sites)."""
    flat = getattr(attr, "sites", attr)
    return torch.cat([flat.values, flat.constant[:, None], flat.logit[:, None]], -1).double().numpy()


def by_hand(x: np.ndarray, ci: float = 0.95) -> dict:
    n = x.shape[0]
    std = x.std(0, ddof=1)
    sem = std / math.sqrt(n)
    t = scipy.stats.t.ppf(0.5 + ci / 2, n - 1)
    mean = x.mean(0)
    return {"n": n, "mean": mean, "std": std, "sem": sem, "ci_low": mean - t * sem, "ci_high": mean + t * sem,
            "share_positive": (x > 0).mean(0)}


def over(gap: np.ndarray, limit: np.ndarray) -> float:
    """The largest ``gap / limit``; a limit of 0 (a column that is 0 in every row) allows only a gap of exactly 0."""
    gap, limit = np.broadcast_arrays(np.asarray(gap, dtype=np.float64), np.asarray(limit, dtype=np.float64))
    ratio = np.where(limit > 0, gap / np.where(limit > 0, limit, 1.0), np.where(gap == 0, 0.0, np.inf))
    return float(ratio.max()) if ratio.size else 0.0


def interval_bound(moments: bounds.Moments, n: int, ci: float = 0.95) -> torch.Tensor:
    """``[C]``: how far two computations of ``mean -+ t sem`` may differ when their means and stds differ by
    ``moments`` (the same ``t``: scipy's, bit for bit): the mean's, plus ``t`` times the sem's (``std / sqrt n``).
    The endpoint's own float64 multiply-add (``2u`` of it, each side) is the caller's to add: it needs the endpoint."""
    t = float(scipy.stats.t.ppf(0.5 + ci / 2, n - 1))
    return moments.mean + t * moments.std / math.sqrt(n)


def assert_matches_rows(stats: AttributionStats, x: np.ndarray) -> tuple[float, float]:
    """The summary's moments are numpy's on the rows and its t interval scipy's t quantile times them, within two
    float64 computations' rounding (``bounds.moments_bound``: ``gamma_4n`` of the rows' magnitudes); the share
    positive exactly. Returns the largest gaps over their bounds (moments, interval)."""
    table, hand = stats.summary(), by_hand(x)
    assert stats.n == hand["n"] and (table["n"] == hand["n"]).all()
    moments = bounds.moments_bound(x)
    u = bounds.unit_roundoff(torch.float64)
    limits = {"mean": moments.mean, "std": moments.std, "sem": moments.std / math.sqrt(hand["n"])}
    interval = interval_bound(moments, hand["n"])
    for name in ("ci_low", "ci_high"):
        limits[name] = interval + 4 * u * torch.as_tensor(np.abs(hand[name]))

    def worst(names):
        return max(over(np.abs(table[name].to_numpy() - hand[name]), limits[name].numpy()) for name in names)

    ratios = worst(("mean", "std", "sem")), worst(("ci_low", "ci_high"))
    assert ratios[0] <= 1, ratios
    assert ratios[1] <= 1, ratios
    np.testing.assert_array_equal(table["share_positive"].to_numpy(), hand["share_positive"])
    return ratios


def row_limits(model, prompts) -> torch.Tensor:
    """``[n]``: how far prompt ``b``'s row (each part, the constant and the logit) may move between two batchings
    or processes: both forwards' rounding of its logit difference at its last token (``test_positions.batch_bound``:
    bounds.py's model of a logit's rounding)."""
    return batch_bound(model, prompts, difference(model), [len(ids_of(model, p)) - 1 for p in prompts])


def moved_bounds(x: np.ndarray, limits: torch.Tensor, reference: AttributionStats) -> dict:
    """What two reductions of the same samples may differ by when sample ``b``'s row (``x [n, C]``) moves by at
    most ``limits[b]`` between them (another batching, process or pairing), plus both sides' float64 rounding
    (``bounds.moments_bound``). Model, by the triangle inequality: the mean by ``mean(limits)``; the std by
    ``sqrt(sum limits^2 / (n - 1))`` (a norm of the centred rows); ``m2`` by ``2 sqrt(m2) |limits| + |limits|^2``;
    a bootstrap replicate sum by its weight total times ``max(limits)`` (each sample enters it ``w`` times), a
    sign-flip sum by ``sum(limits)``, each plus ``gamma_n`` of its terms in float64 (both sides); the percentile
    endpoints (quantiles of the replicates' means) by ``max(limits)``; a share or p-value (counts) by the samples
    or replicates within their bound of the threshold, over the count."""
    n = x.shape[0]
    limits = limits.double()
    x64 = torch.as_tensor(x, dtype=torch.float64)
    scale = x64.abs().amax(0)  # [C]
    moments = bounds.moments_bound(x)
    g = 2 * bounds.gamma(4 * n, torch.float64)
    norm = float(limits.pow(2).sum().sqrt())
    mean = float(limits.mean()) + moments.mean
    std = norm / math.sqrt(max(n - 1, 1)) + moments.std
    weight = reference.weight.double()[:, None]  # [R, 1]
    boot = weight * (float(limits.max()) + g * scale)  # [R, C]
    flip = float(limits.sum()) + g * x64.abs().sum(0)  # [C]
    total = x64.sum(0)
    near = ((reference.flip.abs() - total.abs()).abs() <= 2 * flip).double().sum(0)
    return {
        "mean": mean, "m2": 2 * reference.m2.clamp(min=0).sqrt() * norm + norm ** 2 + moments.m2,
        "boot": boot, "flip": flip.expand_as(reference.flip),
        "summary": {"mean": mean, "std": std, "sem": std / math.sqrt(n), "ci_low": interval_bound(
            bounds.Moments(mean, moments.m2, std), n), "share_positive": (x64.abs() <= limits[:, None]).double().sum(0)
            / n, "boot_low": float(limits.max()) + g * scale, "p_signflip": near / (reference.replicates + 1)},
    }


def assert_moved_within(stats: AttributionStats, reference: AttributionStats, allowed: dict, what) -> None:
    """``stats`` against ``reference`` within ``moved_bounds``: the accumulators and every summary column."""
    for name in ("mean", "m2", "boot", "flip"):
        gap = (getattr(stats, name) - getattr(reference, name)).abs()
        assert bool((gap <= allowed[name]).all()), (what, name, over(gap.numpy(), allowed[name].numpy()))
    mine, theirs = stats.summary(), reference.summary()
    columns = {**allowed["summary"], "ci_high": allowed["summary"]["ci_low"], "boot_high": allowed["summary"]["boot_low"]}
    for name, limit in columns.items():
        gap = np.abs(mine[name].to_numpy() - theirs[name].to_numpy())
        limit = np.broadcast_to(np.asarray(limit), gap.shape) + 4 * bounds.unit_roundoff(torch.float64) * np.abs(
            theirs[name].to_numpy())
        assert (gap <= limit).all(), (what, name, over(gap, limit))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("by", ["block", "head", "neuron"])
def test_stats_are_the_rows_statistics(family, by):
    """Padded batches (prompts of 2..6 tokens), every fast family: the moments, t interval and share positive."""
    model = tiny_model(family)
    prompts = dataset(12, seed=1)
    stats = dla_recipes.attribute(model, prompts, TARGET, contrast=CONTRAST, by=by, reduce="stats", batch_size=5)
    attr = dla_recipes.attribute(model, prompts, TARGET, contrast=CONTRAST, by=by, batch_size=5)
    assert list(stats.labels) == list(attr.labels) and stats.by == by and stats.family == attr.family
    assert_matches_rows(stats, rows(attr))
    assert stats.error == attr.error  # the same rows (the same batches), the same largest gap


K = 5  # Monte-Carlo standard errors allowed between the package's resampling and scipy's


def quantile_slope(replicates: np.ndarray, q: float, d: float = 0.01) -> np.ndarray:
    """``dQ/dq`` of the replicates' distribution (axis 0) at ``q``: the difference quotient of two of its quantiles
    (Siddiqui's estimate of 1 / density; ``d = 0.01``: 200 replicates either side at R = 20,000)."""
    high, low = np.quantile(replicates, [q + d, q - d], axis=0)
    return (high - low) / (2 * d)


def test_bootstrap_and_signflip_against_scipy():
    """The bootstrap interval and the sign-flip p-value reduced in the trace against scipy's resampling of the
    per-prompt rows (``scipy.stats.bootstrap``, ``scipy.stats.permutation_test``), 20,000 resamples each, within
    ``K`` Monte-Carlo standard errors of the two estimates' difference; with the power to see an interval at the
    wrong level or a one-sided p."""
    model = tiny_model("llama")
    n, replicates, ci = 80, 20_000, 0.95
    prompts = dataset(n, seed=2)
    stats = dla_recipes.attribute(model, prompts, TARGET, contrast=CONTRAST, by="head",
                                  reduce=Stats(replicates=replicates, seed=7), batch_size=16)
    x = rows(dla_recipes.attribute(model, prompts, TARGET, contrast=CONTRAST, by="head", batch_size=16))
    table = stats.summary(ci)
    ours = (stats.boot / stats.weight[:, None]).numpy()  # [R, C] the replicates' means
    boot = scipy.stats.bootstrap((x,), np.mean, n_resamples=replicates, confidence_level=ci, method="percentile",
                                 axis=0, vectorized=True, batch=1000, rng=np.random.default_rng(0))
    theirs = boot.bootstrap_distribution.T  # [R, C]
    # Error model of an endpoint: the q-quantile of R replicates is off by sqrt(q (1 - q) / R) dQ/dq (one standard
    # error; dQ/dq from each method's own replicates), independently for the two methods. On top, a bias: a Poisson
    # replicate's weights total N ~ Poisson(n), not n, so its means spread sqrt(E[n / N]) ~ 1 + 1/(2n) wider than
    # scipy's multinomial ones, the endpoints z sd / (2n) farther out (at most 0.5 standard errors here). Measured:
    # at most 2.6 standard errors (2.2 less the bias); an interval at ci = 0.90 would be 8.6 to 12.3 away.
    z = scipy.stats.norm.ppf(0.5 + ci / 2)
    bias = z * theirs.std(0) / (2 * n)
    allowed = {}
    for name, q, reference in (("boot_low", 0.5 - ci / 2, boot.confidence_interval.low),
                               ("boot_high", 0.5 + ci / 2, boot.confidence_interval.high)):
        error = math.sqrt(q * (1 - q) / replicates) * np.hypot(quantile_slope(ours, q), quantile_slope(theirs, q))
        allowed[name] = K * error + bias
        gap = np.abs(table[name].to_numpy() - reference)
        assert (gap <= allowed[name]).all(), (name, (gap / np.maximum(error, 1e-300)).max())
        # the power: the endpoint of a 90% interval (a wrong level) would be outside what is allowed
        wrong = np.quantile(ours, 0.5 - 0.45 if q < 0.5 else 0.5 + 0.45, axis=0)
        varies = error > 0  # the constant of a model without biases is 0 at every prompt
        assert (np.abs(wrong - reference) > allowed[name])[varies].all(), name
    # the bootstrap interval is an interval of the mean: it covers it, about as wide as the t interval
    assert (table["boot_low"] <= table["mean"]).all() and (table["mean"] <= table["boot_high"]).all()
    varies = table["std"] > 0
    width = ((table["boot_high"] - table["boot_low"]) / (table["ci_high"] - table["ci_low"]))[varies]
    assert len(width) > 10 and width.between(0.7, 1.3).all(), width.describe()
    # The sign flip: scipy's one-sample "samples" permutation flips each row's sign (scipy/stats/_resampling.py,
    # _calculate_null_samples: data becomes (x, -x), each pair swapped at random); with the signed mean as the
    # statistic its two-sided p is 2 min(p_less, p_greater), each (1 + count) / (R + 1). The null is symmetric, so
    # it estimates P(|T| >= |t|) as the package's (1 + #{|flip| >= |sum|}) / (R + 1) does. Error model: the
    # package's a binomial share, sqrt(p (1 - p) / R); scipy's twice one of p / 2, sqrt(p (2 - p) / R);
    # independent; and the two +1's differ by at most 1 / (R + 1). Measured: at most 1.4 standard errors; a
    # one-sided p would be 12 to 49 away on the 10 components with 0.05 < p < 0.9.
    perm = scipy.stats.permutation_test((x,), np.mean, permutation_type="samples", n_resamples=replicates, axis=0,
                                        vectorized=True, batch=1000, rng=np.random.default_rng(1))
    p, p_scipy = table["p_signflip"].to_numpy(), perm.pvalue
    middle = (p + p_scipy) / 2
    p_error = np.sqrt((middle * (1 - middle) + middle * (2 - middle)) / replicates)
    p_allowed = K * p_error + 1 / (replicates + 1)
    assert (np.abs(p - p_scipy) <= p_allowed).all(), (np.abs(p - p_scipy) / np.maximum(p_error, 1e-300)).max()
    assert ((p > 0) & (p <= 1)).all() and p.min() < 0.05 < p.max()  # some components matter, some do not
    # the power: the one-sided p (1 + #{flip >= |sum|}) / (R + 1) would be outside what is allowed where 0.05 < p < 0.9
    one_sided = (1 + (stats.flip.numpy() >= np.abs(x.sum(0))).sum(0)) / (replicates + 1)
    moderate = (p_scipy > 0.05) & (p_scipy < 0.9)
    assert moderate.sum() >= 3 and (np.abs(one_sided - p_scipy) > p_allowed)[moderate].all(), moderate.sum()


def test_same_stats_in_any_batching_and_chunks():
    """batch_size 1, 3 and all give the same statistics (the random weights are a function of the sample, not of
    its batch); two chunks (``Stats(start=...)``) merged equal one call."""
    model = tiny_model("gpt2")
    prompts = dataset(10, seed=3)
    calls = {size: dla_recipes.attribute(model, prompts, TARGET, contrast=CONTRAST, by="head", batch_size=size,
                                         reduce=Stats(replicates=64, seed=3)) for size in (1, 3, None)}
    first = dla_recipes.attribute(model, prompts[:4], TARGET, contrast=CONTRAST, by="head",
                                  reduce=Stats(replicates=64, seed=3))
    second = dla_recipes.attribute(model, prompts[4:], TARGET, contrast=CONTRAST, by="head",
                                   reduce=Stats(replicates=64, seed=3, start=4), batch_size=2)
    calls["chunks"] = first.merge(second)
    reference = calls[None]
    # each prompt's row may move between batchings by both forwards' rounding of its logit (row_limits): the
    # statistics by what that moves them (moved_bounds); the weights are a function of the sample: equal exactly
    x = rows(dla_recipes.attribute(model, prompts, TARGET, contrast=CONTRAST, by="head"))
    allowed = moved_bounds(x, row_limits(model, prompts), reference)
    for key, stats in calls.items():
        assert stats.n == reference.n == 10, key
        assert torch.equal(stats.weight, reference.weight), key
        assert_moved_within(stats, reference, allowed, key)
    other = dla_recipes.attribute(model, prompts[:4], TARGET, contrast=CONTRAST, by="block", reduce="stats")
    with pytest.raises(InputError, match="different attributions"):
        first.merge(other)


def test_positions_pooled_and_direction():
    """Every (prompt, position) site is a sample (``target="next"`` at every position), and ``attribute_direction``
    reduces the same way."""
    model = tiny_model("llama")
    prompts = dataset(8, seed=4)
    stats = dla_recipes.attribute(model, prompts, "next", position="all", by="head", reduce="stats", batch_size=3)
    pattr = dla_recipes.attribute(model, prompts, "next", position="all", by="head", batch_size=3)
    assert stats.n == int(pattr.mask.sum()) == len(pattr.sites)
    assert_matches_rows(stats, rows(pattr))
    direction = torch.randn(model.lm_head.weight.shape[-1], generator=torch.Generator().manual_seed(0))
    kwargs = {"layer": 1, "sublayer": "mlp", "by": "head", "position": "all", "batch_size": 4}
    dstats = dla_recipes.attribute_direction(model, prompts, direction, reduce="stats", **kwargs)
    dattr = dla_recipes.attribute_direction(model, prompts, direction, **kwargs)
    assert dstats.read_by == "L1.ln_2" or dstats.read_by == dattr.sites.read_by
    assert_matches_rows(dstats, rows(dattr))


def test_paired_differences():
    """``Stats(paired=True)``: prompts ``clean + corrupted``, the statistics of the per-prompt differences."""
    model = tiny_model("llama")
    clean, corrupted = dataset(9, seed=5), dataset(9, seed=6)
    stats = dla_recipes.attribute(model, clean + corrupted, TARGET, contrast=CONTRAST, by="head",
                                  reduce=Stats(paired=True), batch_size=4)
    x = rows(dla_recipes.attribute(model, clean, TARGET, contrast=CONTRAST, by="head"))
    y = rows(dla_recipes.attribute(model, corrupted, TARGET, contrast=CONTRAST, by="head"))
    assert stats.paired and stats.n == 9
    # the paired rows run in other (padded) batches than the two unpaired calls: each difference within both
    # rows' limits (row_limits, clean and corrupted), carried into the summary by moved_bounds
    allowed = moved_bounds(x - y, row_limits(model, clean) + row_limits(model, corrupted), stats)["summary"]
    table, hand = stats.summary(), by_hand(x - y)
    for name in ("mean", "std", "ci_low", "ci_high"):
        limit = allowed["ci_low" if name.startswith("ci") else name]
        assert (np.abs(table[name].to_numpy() - hand[name]) <= np.asarray(limit)).all(), name
    with pytest.raises(InputError, match="two halves"):
        dla_recipes.attribute(model, clean, TARGET, reduce=Stats(paired=True))


def plant(monkeypatch) -> None:
    """A fault the self-check must see, in both ways a term is scored: the mlp term's score negated (the general
    way, ``trace.terms``) and every term read whole negated (the common case's lane, ``trace.plain``)."""
    monkeypatch.setattr(terms, "score_term", MUTANTS["mlp_negated"].wrap(terms.score_term))
    monkeypatch.setattr(plain, "products", MUTANTS["lane_blocks_negated"].wrap(plain.products))


def test_self_check_still_fires(monkeypatch):
    """A planted fault (the mlp term's score negated) raises the same ExactnessError with reduce="stats", naming
    the same prompt; a NaN in one prompt's parts raises the same NonFiniteError."""
    model = tiny_model("llama")
    prompts = dataset(9, seed=7)
    plant(monkeypatch)
    for kwargs in ({}, {"position": "all", "target": "next"}):
        call = {"target": TARGET, "by": "head", "batch_size": 4} | kwargs
        with pytest.raises(ExactnessError) as rows_error:
            dla_recipes.attribute(model, prompts, **call)
        with pytest.raises(ExactnessError) as stats_error:
            dla_recipes.attribute(model, prompts, **call, reduce="stats")
        assert str(stats_error.value) == str(rows_error.value) and "prompt " in str(stats_error.value)
    monkeypatch.undo()
    original, lane = terms.score_term, plain.products

    def poisoned(*args, **kwargs):  # prompt row 1 of each batch: its first score non-finite
        result = original(*args, **kwargs)
        score = result[0].clone()
        if score.shape[0] > 1:
            score[1] = float("nan")
        return (score, *result[1:])

    def poisoned_lane(*args, **kwargs):  # the same in the common case's lane (trace.plain)
        parts = lane(*args, **kwargs).clone()
        if parts.shape[0] > 1:
            parts[1] = float("nan")
        return parts

    monkeypatch.setattr(terms, "score_term", poisoned)
    monkeypatch.setattr(plain, "products", poisoned_lane)
    with pytest.raises(NonFiniteError) as rows_error:
        dla_recipes.attribute(model, prompts, TARGET, by="head", batch_size=4)
    with pytest.raises(NonFiniteError) as stats_error:
        dla_recipes.attribute(model, prompts, TARGET, by="head", batch_size=4, reduce=Stats(keep=1))
    assert str(stats_error.value) == str(rows_error.value)


def test_low_precision(monkeypatch):
    """A bfloat16 model: the sites ranked by the model's own rounding pass as every row does, and a planted fault
    still raises the same error (the in-trace ranking reads the unit roundoff the trace measured)."""
    model = dla_recipes.load(tiny.build("llama").to(torch.bfloat16), tokenizer=tiny.tokenizer(), device_map="cpu")
    prompts = dataset(10, seed=11)
    stats = dla_recipes.attribute(model, prompts, TARGET, contrast=CONTRAST, by="head", reduce="stats", batch_size=4)
    attr = dla_recipes.attribute(model, prompts, TARGET, contrast=CONTRAST, by="head", batch_size=4)
    assert_matches_rows(stats, rows(attr))
    plant(monkeypatch)
    with pytest.raises(ExactnessError) as rows_error:
        dla_recipes.attribute(model, prompts, TARGET, by="neuron", batch_size=4)
    with pytest.raises(ExactnessError) as stats_error:
        dla_recipes.attribute(model, prompts, TARGET, by="neuron", batch_size=4, reduce="stats")
    assert str(stats_error.value) == str(rows_error.value)


def test_bytes_back_flat_in_prompts(monkeypatch):
    """What one request returns does not grow with its prompts: the packed statistics of 64 prompts in one batch
    are as long as those of 8 (the kept rows: ``keep`` a batch); ``reduce=None`` grows with them."""
    model = tiny_model("llama")
    sizes = {}
    original = trace_stats.StatsReadout.pack

    def measured(self):
        packed = original(self)
        sizes.setdefault(int(self.count), packed.numel() * packed.element_size())
        return packed

    monkeypatch.setattr(trace_stats.StatsReadout, "pack", measured)
    for n in (8, 64):
        dla_recipes.attribute(model, dataset(n, seed=8), TARGET, by="head", reduce=Stats(replicates=200))
    assert sizes[8] == sizes[64], sizes


def test_summary_top_plot_save(tmp_path):
    model = tiny_model("llama")
    stats = dla_recipes.attribute(model, dataset(12, seed=9), TARGET, contrast=CONTRAST, by="head", reduce="stats")
    table = stats.summary(ci=0.9)
    assert list(table.index) == list(stats.labels) + ["constant", "logit"]
    assert {"n", "mean", "std", "sem", "ci_low", "ci_high", "share_positive", "boot_low", "boot_high",
            "p_signflip"} <= set(table.columns)
    top = stats.top(5)
    assert len(top) == 5 and top["mean"].abs().is_monotonic_decreasing
    assert set(top.index) <= set(stats.labels)
    pytest.importorskip("plotly")
    fig = dla_recipes.plots.stats_bars(stats, k=5)
    assert list(fig.data[0].y) == list(top.index) and fig.layout.meta["dla_plot"] == "stats_bars"
    back = AttributionStats.load(stats.save(tmp_path / "s.pt"))
    assert back.labels == stats.labels and back.n == stats.n and torch.equal(back.boot, stats.boot)


@pytest.mark.parametrize(("reduce", "match"), [("mean", "'stats'"), (3, "'sum'")])
def test_bad_reduce(reduce, match):
    with pytest.raises(InputError, match=match):
        dla_recipes.attribute(tiny_model("llama"), PROMPTS, TARGET, reduce=reduce)


@pytest.mark.parametrize("kwargs", [{"replicates": 0}, {"replicates": 2.5}, {"seed": -1}, {"paired": 1}])
def test_bad_stats(kwargs):
    with pytest.raises(InputError, match=next(iter(kwargs))):
        Stats(**kwargs)


SERVED = ["llama", "gpt2"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with serve_tiny(tmp_path_factory.mktemp("served_stats"), SERVED) as running:
        yield running


@pytest.mark.server
@pytest.mark.parametrize("family", SERVED)
def test_remote_equals_local(server, family, monkeypatch):
    """The statistics reduced on the loopback server equal the local ones (both single-threaded), in batches; a
    session of several batches merges them server side: one ``StatsReadout`` comes back per session."""
    from dla_recipes.transport import session

    sent = []
    original = session.send_session

    def recorded(*args, **kwargs):
        readouts = original(*args, **kwargs)
        sent.append(sum(r is not None for r in readouts))
        return readouts

    monkeypatch.setattr(session, "send_session", recorded)
    remote_model, local_model = server.remote_model(family), server.local_model(family)
    prompts = dataset(10, seed=10)
    kwargs = {"contrast": CONTRAST, "by": "head", "batch_size": 2, "reduce": Stats(replicates=50, seed=1)}
    with server.client():
        remote = dla_recipes.attribute(remote_model, prompts, TARGET, remote=True, **kwargs)
    assert sent == [1, 1], sent  # 5 batches: a first session of one (it times a batch), then one of four
    with single_threaded():
        local = dla_recipes.attribute(local_model, prompts, TARGET, **kwargs)
    assert remote.labels == local.labels and remote.n == local.n == 10
    # the same float32 rows on both sides, but the model's own logit may differ in its last bits between two
    # processes (test_remote): the components' replicate sums equal bit for bit, their means and m2 within two
    # float64 merges in other groupings (bounds.moments_bound); every column, the logit's too, within what rows
    # moving by their logit's rounding move the statistics (moved_bounds, row_limits)
    for name in ("boot", "flip", "positive"):
        assert torch.equal(getattr(remote, name)[:, :-1] if name != "positive" else remote.positive[:-1],
                           getattr(local, name)[:, :-1] if name != "positive" else local.positive[:-1]), name
    with single_threaded():
        x = rows(dla_recipes.attribute(local_model, prompts, TARGET, contrast=CONTRAST, by="head", batch_size=2))
    moments = bounds.moments_bound(x)
    for name in ("mean", "m2"):
        gap = (getattr(remote, name) - getattr(local, name))[:-1].abs()
        assert bool((gap <= getattr(moments, name)[:-1]).all()), name
    assert_moved_within(remote, local, moved_bounds(x, row_limits(local_model, prompts), local), "remote")
    assert torch.equal(remote.weight, local.weight)


@pytest.fixture(scope="module")
def ndif_server(tmp_path_factory):
    """The loopback server run as NDIF runs a request: bfloat16, sdpa, every request under a bfloat16 autocast."""
    with serve_tiny(tmp_path_factory.mktemp("served_stats_ndif"), ["llama"], ndif=True) as running:
        yield running


@pytest.mark.server
def test_ndif_like_autocast_and_handle(ndif_server):
    """Under NDIF's autocast bracket the reducer's float64 arithmetic is untouched: the remote statistics (in one
    session, and through a ``blocking=False`` handle) equal the local ones under the same bracket."""
    remote_model = ndif_server.remote_model("llama")
    local_model = ndif_server.local_model("llama", dispatch=True)
    prompts = dataset(8, seed=12)
    kwargs = {"contrast": CONTRAST, "by": "head", "batch_size": 3, "reduce": Stats(replicates=40, seed=2)}
    with ndif_server.client():
        remote = dla_recipes.attribute(remote_model, prompts, TARGET, remote=True, **kwargs)
        handle = dla_recipes.attribute(remote_model, prompts, TARGET, remote=True, blocking=False, **kwargs)
        later = handle.result()
    with single_threaded(), ndif_server.bracket():
        local = dla_recipes.attribute(local_model, prompts, TARGET, **kwargs)
        x = rows(dla_recipes.attribute(local_model, prompts, TARGET, contrast=CONTRAST, by="head", batch_size=3))
    mean_bound = bounds.moments_bound(x).mean
    for stats in (remote, later):
        assert stats.n == local.n == 8 and stats.boot.dtype == torch.float64
        assert torch.equal(stats.weight, local.weight)
        # the component columns equal bit for bit (the same rows); the logit column's last bits may differ
        # (test_remote); the components' means within two float64 merges in other groupings (bounds.moments_bound)
        assert torch.equal(stats.boot[:, :-1], local.boot[:, :-1]) and torch.equal(stats.flip[:, :-1], local.flip[:, :-1])
        assert bool(((stats.mean - local.mean)[:-1].abs() <= mean_bound[:-1]).all())
