"""``AttributionStats``: per-component statistics of an attribution over a dataset (``reduce="stats"``).

``attribute(model, prompts, target, by="head", reduce=Stats())`` reduces every attributed site (one per prompt with
one int position; with several positions every (prompt, position) site is a sample of its own, pooled) inside the
trace, and returns one ``AttributionStats``: per component (and for the constant and the logit), the count, mean
and spread (Chan's parallel moments, merged exactly across batches), the share of samples where it is positive,
``R`` Poisson-bootstrap replicate means and ``R`` sign-flip replicate sums. ``summary(ci=0.95)`` is the table:

    n, mean, std, sem, ci_low, ci_high (Student t), share_positive, boot_low, boot_high (percentile), p_signflip

The t quantile is scipy's (``scipy.stats.t.ppf``). The bootstrap and sign-flip replicates are not scipy's
resamplers (``scipy.stats.bootstrap``, ``permutation_test``): those need every sample on the client at once, while
these are drawn per sample and summed in the trace (on the server remotely) and merged across chunks; the tests
hold them to scipy's within the Monte-Carlo error.

``merge`` combines the statistics of two disjoint sets of samples (chunks of a dataset) exactly. ``Stats`` is the
typed choice passed as ``reduce=`` (its replicates, its seed, paired prompts).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from ..errors import InputError
from ..math.stats import merged

ACCUMULATORS = ("mean", "m2", "positive", "boot", "weight", "flip")
EXTRA = ("constant", "logit")  # the two columns after the components


@dataclass(frozen=True)
class Stats:
    """``reduce=Stats(...)``: per-component statistics reduced in the trace (``reduce="stats"``: the defaults).

    Attributes:
        replicates: bootstrap and sign-flip replicates (``R``); what comes back is ``O(components x R)``.
        seed: the random weights' seed (a deterministic function of seed, sample and replicate: the same in any
            batching, locally and remotely).
        paired: the prompts are ``clean + corrupted`` (two halves of equal length): row ``i`` pairs with row
            ``i + n/2``, and the samples are the per-site differences clean - corrupted (both run in one batch).
        start: the dataset index of ``prompts[0]`` (a dataset reduced in chunks draws the weights one call would).
        keep: the worst sites of each batch whose full rows come back for the self-check.
    """

    replicates: int = 200
    seed: int = 0
    paired: bool = False
    start: int = 0
    keep: int = 4

    def __post_init__(self):
        for name, low in (("replicates", 1), ("seed", 0), ("start", 0), ("keep", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise InputError(f"Stats({name}={value!r}): {name} must be an int >= {low}")
        if self.seed >= 2**63 or self.start >= 2**31:
            raise InputError(f"Stats(seed={self.seed}, start={self.start}): seed < 2**63, start < 2**31")
        if not isinstance(self.paired, bool):
            raise InputError(f"Stats(paired={self.paired!r}): paired is True or False")


def check_reduce(reduce) -> None:
    """``reduce=``: None, ``"sum"``, ``"stats"`` or a ``Stats``, else an ``InputError`` naming the choices."""
    if not (reduce is None or isinstance(reduce, Stats) or isinstance(reduce, str) and reduce in ("sum", "stats")):
        raise InputError(f"reduce={reduce!r}: use None (one row a position), 'sum' (each prompt's positions summed), "
                         "'stats' or dla_recipes.Stats(...) (per-component statistics over the sites, in the trace)")


def as_stats(reduce) -> Stats | None:
    """``reduce`` as a ``Stats`` record (``"stats"``: the defaults), or None for the other choices."""
    if isinstance(reduce, Stats):
        return reduce
    return Stats() if isinstance(reduce, str) and reduce == "stats" else None


@dataclass(frozen=True)
class AttributionStats:
    """Per-component statistics over a dataset's sites (see the module docstring).

    Attributes:
        labels: the components' labels (the columns are these, then ``constant`` and ``logit``).
        count: the samples.  mean, m2, positive: ``[C]`` float64 (``m2``: the sum of squared deviations).
        boot: ``[R, C]`` Poisson-bootstrap replicate sums, ``weight [R]`` their weight totals.
        flip: ``[R, C]`` sign-flip replicate sums.  seed: the weights' seed.
        error: the largest ``|parts + constant - logit|`` over the samples' sites.
        by, family, read_by, paired: what was attributed (as on ``Attribution``).
    """

    labels: tuple
    count: int
    mean: torch.Tensor
    m2: torch.Tensor
    positive: torch.Tensor
    boot: torch.Tensor
    weight: torch.Tensor
    flip: torch.Tensor
    seed: int = 0
    error: float = 0.0
    by: str = ""
    family: str = ""
    read_by: str = ""
    paired: bool = False

    @classmethod
    def from_accumulators(cls, labels, accumulators: Mapping, **meta) -> AttributionStats:
        """From one batch's (or any set of samples') accumulators: ``count`` and ``ACCUMULATORS`` by name
        (``math.stats.accumulate``'s names); ``meta``: the other fields."""
        def f64(value):
            return torch.as_tensor(value, dtype=torch.float64).cpu()

        stats = cls(tuple(labels), round(float(accumulators["count"])),
                    **{name: f64(accumulators[name]) for name in ACCUMULATORS}, **meta)
        if stats.mean.shape != (len(stats.labels) + len(EXTRA),) or stats.boot.shape != stats.flip.shape:
            raise InputError(f"accumulators of {tuple(stats.mean.shape)} columns for {len(stats.labels)} labels "
                             f"(+ {', '.join(EXTRA)}); boot {tuple(stats.boot.shape)}, flip {tuple(stats.flip.shape)}")
        return stats

    @property
    def n(self) -> int:
        """The number of samples."""
        return self.count

    @property
    def replicates(self) -> int:
        return int(self.boot.shape[0])

    @property
    def columns(self) -> list[str]:
        """The summary's rows: the components' labels, then ``constant`` and ``logit``."""
        return list(self.labels) + list(EXTRA)

    def merge(self, other: AttributionStats) -> AttributionStats:
        """The statistics of both sets of samples (disjoint: the same samples twice would count twice), exactly:
        counts and sums add, means and ``m2`` by Chan's parallel formula."""
        if not isinstance(other, AttributionStats):
            raise InputError(f"merge takes an AttributionStats, not {type(other).__name__}")
        same = (self.labels == other.labels and self.replicates == other.replicates and self.seed == other.seed
                and (self.by, self.family, self.read_by, self.paired) ==
                (other.by, other.family, other.read_by, other.paired))
        if not same:
            raise InputError(
                f"cannot merge statistics of different attributions: {len(self.labels)} vs {len(other.labels)} "
                f"components (labels equal: {self.labels == other.labels}), replicates {self.replicates} vs "
                f"{other.replicates}, seed {self.seed} vs {other.seed}, by {self.by!r} vs {other.by!r}, paired "
                f"{self.paired} vs {other.paired}")
        if other.count == 0:
            return self
        if self.count == 0:
            return other
        return replace(self, **merged(self, other), error=max(self.error, other.error))

    def summary(self, ci: float = 0.95):
        """A pandas DataFrame indexed by component label (then ``constant``, ``logit``): ``n, mean, std, sem,
        ci_low, ci_high`` (the Student t interval at ``ci``), ``share_positive``, ``boot_low, boot_high`` (the
        percentile interval of the bootstrap replicates' means) and ``p_signflip`` (two-sided,
        ``(1 + #{|flip sum| >= |sum|}) / (R + 1)``)."""
        import pandas as pd
        from scipy import stats as scipy_stats  # here, not at the top: ``import dla_recipes`` need not load scipy

        if not 0.0 < float(ci) < 1.0:
            raise InputError(f"ci={ci!r}: a confidence level between 0 and 1, e.g. 0.95")
        n = self.count
        std = (self.m2 / (n - 1)).sqrt() if n > 1 else torch.full_like(self.mean, float("nan"))
        sem = std / math.sqrt(n) if n > 0 else std
        t = float(scipy_stats.t.ppf(0.5 + 0.5 * float(ci), n - 1))  # NaN for n <= 1 (no degrees of freedom)
        means = self.boot / self.weight.unsqueeze(-1)  # [R, C]
        low_q, high_q = 0.5 - 0.5 * float(ci), 0.5 + 0.5 * float(ci)
        boot = torch.quantile(means, torch.tensor([low_q, high_q], dtype=torch.float64), dim=0)
        observed = (self.mean * n).abs()
        p = (1.0 + (self.flip.abs() >= observed).double().sum(0)) / (self.replicates + 1.0)
        return pd.DataFrame({
            "n": [n] * len(self.columns), "mean": self.mean.numpy(), "std": std.numpy(), "sem": sem.numpy(),
            "ci_low": (self.mean - t * sem).numpy(), "ci_high": (self.mean + t * sem).numpy(),
            "share_positive": (self.positive / max(n, 1)).numpy(), "boot_low": boot[0].numpy(),
            "boot_high": boot[1].numpy(), "p_signflip": p.numpy(),
        }, index=pd.Index(self.columns, name="component"))

    def top(self, k: int = 10, ci: float = 0.95):
        """The summary's ``k`` components with the largest ``|mean|`` (the constant and the logit left out)."""
        table = self.summary(ci).iloc[:len(self.labels)]
        return table.reindex(table["mean"].abs().sort_values(ascending=False).index[:k])

    def __repr__(self) -> str:
        return (f"AttributionStats({self.family} by={self.by!r}, {len(self.labels)} components, n={self.count}, "
                f"R={self.replicates}{', paired' if self.paired else ''})")

    def save(self, path) -> Path:
        """Write the statistics as one ``torch.save`` file of plain data (``AttributionStats.load`` reads it)."""
        path = Path(path)
        state = {name: getattr(self, name) for name in ("count", "seed", "error", "by", "family", "read_by", "paired")}
        state |= {name: getattr(self, name) for name in ACCUMULATORS}
        torch.save({"format": "dla_recipes.AttributionStats", "version": 1, "labels": list(self.labels),
                    "fields": state}, path)
        return path

    @classmethod
    def load(cls, path) -> AttributionStats:
        """Read what ``save`` wrote."""
        state = torch.load(path, weights_only=True)
        if not isinstance(state, dict) or state.get("format") != "dla_recipes.AttributionStats":
            raise InputError(f"{path}: not a file AttributionStats.save wrote")
        fields = dict(state["fields"])
        return cls.from_accumulators(state["labels"], {name: fields.pop(name) for name in ("count",) + ACCUMULATORS},
                                     **fields)
