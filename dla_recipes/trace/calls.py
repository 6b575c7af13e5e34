"""One batch's in-trace call, what a trace (local, or server side on NDIF) runs as ``call.run(model)``.

``LogitCall`` holds ``direct_logit_attribution``'s arguments (its readout leaves the trace as the sparse wire of
``trace.sparse``: only each dictionary's kept latents), ``DirectionCall`` ``direction_attribution``'s, and
``TopCall`` reads the model's own top token at each site (``target=None``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..plan.plan import Plan
from . import sparse
from .prepared import Prepared
from .reading import Reading, Where
from .readout import Readout
from .recipe import direct_logit_attribution, direction_attribution


@dataclass(frozen=True)
class LogitCall:
    """``direct_logit_attribution``'s arguments for one batch: what a trace computes, ``call.run(model)``.

    ``where``: the batch's sites (``Where``: positions, rows, offsets); ``targets`` ``[n]`` long token ids or a
    ``LinearTarget``, ``contrasts`` ``[n]`` or None; ``reading``: what the trace reads (``Reading``); ``prepared``:
    local calls only, an earlier call's record (``transport.reuse``)."""

    plan: Plan
    where: Where
    targets: object
    contrasts: torch.Tensor | None = None
    reading: Reading = field(default_factory=Reading)
    prepared: Prepared | None = None

    def run(self, model) -> Readout:
        """The attribution of this batch's logits, inside the running trace of ``model``."""
        r, w = self.reading, self.where
        readout = direct_logit_attribution(model, self.plan, w.positions, self.targets, self.contrasts, r.by,
                                           reading=r, rows=w.rows, offsets=w.offsets, prepared=self.prepared)
        return sparse.wired(readout, self.plan, r.by, r.sources, r.edits)  # only kept latents leave

    def unpack(self, packed: torch.Tensor) -> Readout:
        """The ``Readout`` this call's ``pack()`` sent (dictionaries' latents scattered back: ``sparse.dense``)."""
        r = self.reading
        return sparse.dense(packed, self.plan, r.by, r.sources, r.edits)


@dataclass(frozen=True)
class DirectionCall:
    """``direction_attribution``'s arguments for one batch: what a trace computes, ``call.run(model)``.

    ``where``: the sites and the stop (``Where``); ``direction`` ``[n, d_model]``; ``reads``: the norm's
    ``Term.reads``; ``reading``: what the trace reads."""

    plan: Plan
    where: Where
    direction: torch.Tensor
    reads: str
    reading: Reading = field(default_factory=Reading)

    def run(self, model) -> Readout:
        """The attribution of this batch's direction, inside the running trace of ``model``."""
        readout = direction_attribution(model, self.plan, self.where, self.direction, self.reads, self.reading)
        r = self.reading
        return sparse.wired(readout, self.plan, r.by, r.sources, r.edits, self.where.stop)

    def unpack(self, packed: torch.Tensor) -> Readout:
        """The ``Readout`` this call's ``pack()`` sent (dictionaries' latents scattered back: ``sparse.dense``)."""
        r = self.reading
        return sparse.dense(packed, self.plan, r.by, r.sources, r.edits, self.where.stop)


@dataclass
class TopTokens:
    """``ids`` ``[n]``: the model's own top token at each site; ``pack()`` is what a trace sends back."""

    ids: torch.Tensor

    def pack(self) -> torch.Tensor:
        """``[n, 1]`` float32 (ids below 2^24 are exact)."""
        return self.ids.float().reshape(-1, 1)


@dataclass(frozen=True)
class TopCall:
    """The model's own top token at each site (``target=None``): ``call.run(model)`` in a trace reads the output
    logits there (``positions`` ``[n]`` into the padded sequence of length ``seq``, ``rows`` ``[n]`` each site's
    prompt); ``TopCall.unpack`` of what comes back is ``[n]`` long token ids."""

    positions: torch.Tensor
    rows: torch.Tensor
    seq: int

    def run(self, model) -> TopTokens:
        """Inside the running trace of ``model``: the argmax of the output logits at each site."""
        with torch.no_grad():
            logits = model.output.logits  # [batch, kept, vocab]: the last `kept` positions (logits_to_keep)
            kept = self.positions - (self.seq - logits.shape[1])
            return TopTokens(logits[self.rows.to(logits.device), kept.to(logits.device)].argmax(-1).cpu())

    @staticmethod
    def unpack(packed: torch.Tensor) -> torch.Tensor:
        """``[n]`` long: the ids ``TopTokens.pack`` sent."""
        return packed.reshape(-1).long()
