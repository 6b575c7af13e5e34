"""``reduce="stats"`` in the trace: a batch's sites reduced to per-component statistics, plus its few worst rows.

``StatsCall(inner, index, seed, replicates, ...)`` wraps a batch's ``LogitCall`` / ``DirectionCall``: its
``run(model)`` runs the recipe, then ``reduce_readout`` turns the ``Readout`` (one row a site) into a
``StatsReadout``: the accumulators of ``math.stats.accumulate`` over the columns ``[parts..., constant, logit]``,
``O(C x R)`` numbers whatever the batch size, and the full ``Readout`` rows of the ``keep`` sites the self-check
would fail first (``math.checks.site_ratios``, the bounds ``selfcheck`` holds every site to) and of every site with
a non-finite number, so the client's unchanged ``self_check`` on those rows raises as it would on all of them.

``pairs`` ``[m, 2]`` (local site indices: a clean site and its corrupted twin, both in this batch): the samples
are the differences of the two sites' columns, named by the clean site's ``index``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..math.checks import Sizes, SplitGaps, nonfinite_sites, site_ratios
from ..math.stats import accumulate, merged
from .readout import Readout

ACCUMULATORS = ("mean", "m2", "positive", "boot", "weight", "flip")


@dataclass
class StatsReadout:
    """What a ``reduce="stats"`` trace returns for one batch.

    Attributes:
        count, mean, m2, positive, boot, weight, flip: ``math.stats.accumulate``'s, over ``C`` columns (the
            components, then the constant and the logit), float64.
        error: ``[]`` the batch's largest ``|parts + constant - logit|``.
        sites: ``[k]`` long, the local index (into the batch's sites) of each row kept.
        rows: the ``Readout`` of those ``k`` sites (every field; its scalars the batch's).
        n_sites: ``[]`` the batch's sites (several batches merged: all of theirs, ``sites`` counting from the
            first batch's first site).
    """

    count: torch.Tensor
    mean: torch.Tensor
    m2: torch.Tensor
    positive: torch.Tensor
    boot: torch.Tensor
    weight: torch.Tensor
    flip: torch.Tensor
    error: torch.Tensor
    sites: torch.Tensor
    rows: Readout
    n_sites: torch.Tensor

    def merge(self, other: StatsReadout) -> StatsReadout:
        """The statistics of this batch's samples and of the batch after it (in a session, server side): counts
        and sums add, the means and ``m2`` merge by Chan's parallel formula, the kept rows are joined."""
        return StatsReadout(
            **merged(self, other), error=torch.maximum(self.error, other.error),
            sites=torch.cat([self.sites, other.sites + self.n_sites.long()]),
            rows=Readout.concat([self.rows, other.rows]), n_sites=self.n_sites + other.n_sites,
        )

    def pack(self) -> torch.Tensor:
        """One 1-D float64 tensor: ``[C, R, k, count, error, n_sites]``, then the accumulators, the sites and the
        rows."""
        columns, replicates = self.boot.shape[1], self.boot.shape[0]
        head = torch.tensor([float(columns), float(replicates), float(self.sites.shape[0]), float(self.count),
                             float(self.error), float(self.n_sites)], dtype=torch.float64)
        body = [getattr(self, name).double().reshape(-1).cpu() for name in ACCUMULATORS]
        return torch.cat([head, *body, self.sites.double().cpu(), self.rows.pack().double().reshape(-1).cpu()])

    @classmethod
    def unpack(cls, packed: torch.Tensor) -> StatsReadout:
        """The inverse of ``pack``."""
        packed = packed.double().cpu()
        columns, replicates, k = (int(v) for v in packed[:3].tolist())
        count, error, n_sites = packed[3], packed[4], packed[5]
        sizes = {"mean": columns, "m2": columns, "positive": columns, "boot": replicates * columns,
                 "weight": replicates, "flip": replicates * columns}
        out, at = {}, 6
        for name in ACCUMULATORS:
            out[name] = packed[at:at + sizes[name]]
            at += sizes[name]
        out["boot"] = out["boot"].reshape(replicates, columns)
        out["flip"] = out["flip"].reshape(replicates, columns)
        sites = packed[at:at + k].long()
        rows = packed[at + k:].float().reshape(k, -1)
        return cls(count=count, error=error, sites=sites, rows=Readout.unpack(rows), n_sites=n_sites, **out)


def stat_columns(readout: Readout) -> torch.Tensor:
    """``[n, C]``: each site's parts, then its constant and its logit (the columns the statistics are of)."""
    return torch.cat([readout.values, readout.constant.reshape(-1, 1), readout.logit.reshape(-1, 1)], -1)


def worst_sites(readout: Readout, keep: int, tolerance: float | None) -> torch.Tensor:
    """``[k]`` long, sorted: the ``keep`` sites whose self-check ratio is largest, and every non-finite site."""
    r = readout
    total = r.values.sum(-1) + r.constant
    n = total.shape[0]
    u = r.unit_roundoff.reshape(-1).expand(n)
    split = SplitGaps(r.split_gap, r.split_noise, r.split_worst_gap, r.split_worst_allowed)
    ratio = site_ratios(total, r.logit, split, Sizes(r.logit_size.reshape(-1).expand(n), r.head_noise, r.stream_noise),
                        u, tolerance)
    if tolerance is None:  # check="adds": a site whose adds fail is kept too (selfcheck holds them then)
        ratio = torch.maximum(ratio, r.add_ratio.reshape(-1).expand(n).to(ratio.device))
    bad = nonfinite_sites((r.values, r.constant, r.logit, r.output_logit, r.scale, r.stream_noise, r.head_noise,
                           ratio)) | (r.first_nonfinite.reshape(-1).expand(n) >= 0)
    bad = bad | (r.finite_head.reshape(-1).expand(n) < 1)
    ratio = torch.where(bad, torch.full_like(ratio, float("inf")), ratio)
    chosen = bad.clone()
    chosen[torch.topk(ratio, min(keep, n)).indices] = True
    return chosen.nonzero()[:, 0]


def reduce_readout(readout: Readout, call: StatsCall, device=None) -> StatsReadout:
    """A batch's ``Readout`` (one row a site) reduced as ``call`` asks (its ``index`` ``[n]`` int64, each site's
    sample, its ``seed``, ``replicates``, ``keep``, ``tolerance`` and ``pairs``): see the module docstring.
    ``device``: where the replicate sums are computed (the model's: ``[R, n] @ [n, C]`` in float64)."""
    index, pairs = call.index, call.pairs
    columns = stat_columns(readout)
    if pairs is not None:
        columns = columns[pairs[:, 0]] - columns[pairs[:, 1]]
        index = index[pairs[:, 0]]
    if device is not None:
        columns = columns.to(device)
    acc = accumulate(columns, index, call.seed, call.replicates)
    error = (readout.values.sum(-1) + readout.constant - readout.logit).abs().max()
    sites = worst_sites(readout, call.keep, call.tolerance)
    rows = Readout.unpack(Readout.pack(readout)[sites])  # dense (a LogitCall's own pack is the sparse wire)
    acc = {name: value.cpu() for name, value in acc.items()}
    return StatsReadout(error=error.double(), sites=sites, rows=rows,
                        n_sites=torch.tensor(float(readout.values.shape[0]), dtype=torch.float64), **acc)


@dataclass(frozen=True)
class StatsCall:
    """A batch's in-trace call (``LogitCall`` / ``DirectionCall``) reduced to statistics: ``call.run(model)``.

    Attributes:
        inner: the batch's call.  index: ``[n]`` int64, each site's sample (``math.stats``).
        seed, replicates: the random weights' seed and count.  keep: the worst rows sent back.
        tolerance: the user's relative tolerance (ranks the sites as the self-check will hold them).
        pairs: ``[m, 2]`` local site indices (clean, corrupted), or None.
    """

    inner: object
    index: torch.Tensor
    seed: int
    replicates: int
    keep: int = 4
    tolerance: float | None = None
    pairs: torch.Tensor | None = None

    def run(self, model) -> StatsReadout:
        """The batch's statistics, inside the running trace of ``model``."""
        with torch.no_grad():
            readout = self.inner.run(model)
            device = model.lm_head.weight.device  # a GPU's float64 matmul; elsewhere (MPS has no float64) the CPU
            return reduce_readout(readout, self, device if device.type == "cuda" else None)

    @staticmethod
    def unpack(packed: torch.Tensor) -> StatsReadout:
        """The ``StatsReadout`` a trace's ``pack()`` sent."""
        return StatsReadout.unpack(packed)
