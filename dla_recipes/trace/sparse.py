"""The sparse wire of dictionary latents: only the ``keep`` largest latent parts a site leave the trace.

In the trace a dictionary term's latents are ``[sites, d_sae]`` columns (``kinds.features``; an inactive latent an
exact 0). What a ``LogitCall`` sends back keeps, per dictionary and site, the ``k = Dictionary.kept`` parts of
largest ``|part|`` (``torch.topk``: values ``[sites, k]`` float32 and their latent indices ``[sites, k]``, sent as
float32, exact below 2^24 latents) and adds the sum of the others to the dictionary's ``dropped`` column
(``L12.mlp.dropped``: 0 when ``k`` is at least the site's active count), so the columns still sum to the logit.
``k`` is fixed before the forward pass (a TopK encoder's ``k``, else ``min(d_sae, 256)``, ``Dictionary.keep``), so
no count is read on the host. The client scatters the kept parts back into the same dense columns (``dense``): an
unkept latent reads 0. ``reduce="stats"`` reduces the dense columns in the trace (``SparseReadout.pack`` is only the
wire; ``Readout.pack`` of it is the dense one).

Wire ``[sites, n_components - sum(d_sae) + len(FIELDS) + 2 * sum(k)]``: the dense pack without the latent columns,
then each dictionary's ``k`` values, then its ``k`` indices, in component order.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from ..plan.plan import Plan
from .readout import Readout


def spans(plan: Plan, by, sources=None, edits: bool = False, stop=None) -> tuple:
    """``((start, d_sae, k), ...)``: each dictionary's latent columns in the dense values (its ``dropped`` column
    is ``start + d_sae``) and how many of them a site sends back."""
    if plan.stream_dictionary is None and not any(p.dictionary is not None for block in plan.layers for p in block):
        return ()  # no dictionary: the components are not built again
    found, start = [], 0
    for run in plan.components(by, stop, sources, edits).runs:
        if run.part == "feature":
            if run.term == "resid":
                d = plan.stream_dictionary[1]
            else:
                d = next(p.dictionary for p in plan.layers[run.layer] if p.term.name == run.term)
            found.append((start, run.size, d.kept))
        start += run.size
    return tuple(found)


@dataclass
class SparseReadout(Readout):
    """A ``Readout`` whose ``pack()`` is the sparse wire (``spans``: where the latents are); its fields are dense."""

    spans: tuple = ()

    def pack(self) -> torch.Tensor:
        """The wire: the dense pack less its latent columns (each ``dropped`` column plus the unkept parts' sum),
        then each dictionary's kept values and indices."""
        dense = Readout.pack(self)
        keep = torch.ones(dense.shape[1], dtype=torch.bool)
        values, indices = [], []
        dropped = {}
        for start, width, k in self.spans:
            parts = dense[:, start:start + width]
            top = torch.topk(parts.abs(), k, dim=-1, sorted=False).indices  # [n, k]
            kept = parts.gather(-1, top)
            dropped[start + width] = dense[:, start + width] + parts.scatter(-1, top, 0.0).sum(-1)
            values.append(kept)
            indices.append(top.float())
            keep[start:start + width] = False
        out = dense[:, keep]  # a copy: the trace's own buffer stays dense
        positions = torch.cumsum(keep.long(), 0) - 1  # each kept dense column's place on the wire
        for column, value in dropped.items():
            out[:, positions[column]] = value
        return torch.cat([out, *values, *indices], -1)


def wired(readout: Readout, plan: Plan, by, sources=None, edits: bool = False, stop=None) -> Readout:
    """``readout`` as a ``SparseReadout`` when ``plan`` has dictionaries (itself otherwise); ``stop``: the
    components are those written before it (``attribute_direction``)."""
    found = spans(plan, by, sources, edits, stop)
    if not found:
        return readout
    return SparseReadout(**{f.name: getattr(readout, f.name) for f in fields(Readout)}, spans=found)


def dense(packed: torch.Tensor, plan: Plan, by, sources=None, edits: bool = False, stop=None) -> Readout:
    """The ``Readout`` a sparse wire ``packed`` carried, its latents scattered back into dense columns."""
    found = spans(plan, by, sources, edits, stop)
    if not found:
        return Readout.unpack(packed)
    total = sum(k for _, _, k in found)
    rest, values, indices = packed[:, :-2 * total], packed[:, -2 * total:-total], packed[:, -total:]
    width = rest.shape[1] + sum(w for _, w, _ in found)
    out = torch.zeros(packed.shape[0], width, dtype=packed.dtype)
    keep = torch.ones(width, dtype=torch.bool)
    for start, w, _ in found:
        keep[start:start + w] = False
    out[:, keep] = rest
    at = 0
    for start, w, k in found:
        out[:, start:start + w].scatter_(-1, indices[:, at:at + k].long(), values[:, at:at + k])
        at += k
    return Readout.unpack(out)
