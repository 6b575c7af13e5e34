"""One batch's in-trace call, what a trace (local, or server side on NDIF) runs as ``call.run(model)``.

``LogitCall`` holds ``direct_logit_attribution``'s arguments (its readout leaves the trace as the sparse wire of
``trace.sparse``: only each dictionary's kept latents), ``DirectionCall`` ``direction_attribution``'s, and
``TopCall`` reads the model's own top token at each site (``target=None``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..args import Check, Granularity
from ..plan.plan import Plan, Sources, Stop
from . import sparse
from .prepared import Prepared
from .readout import Readout
from .recipe import direct_logit_attribution, direction_attribution


@dataclass(frozen=True)
class LogitCall:
    """``direct_logit_attribution``'s arguments for one batch: what a trace computes, ``call.run(model)``."""

    plan: Plan
    positions: torch.Tensor
    targets: object  # [n] long token ids, or a LinearTarget
    contrasts: torch.Tensor | None
    by: Granularity
    sources: Sources | None = None
    offsets: torch.Tensor | None = None
    edits: bool = False
    rows: torch.Tensor | None = None
    check: Check = "logit"
    prepared: Prepared | None = None  # local calls only: an earlier call's record (transport.reuse)

    def run(self, model) -> Readout:
        """The attribution of this batch's logits, inside the running trace of ``model``."""
        readout = direct_logit_attribution(model, self.plan, self.positions, self.targets, self.contrasts, self.by,
                                           self.sources, self.offsets, self.edits, self.rows,
                                           self.check, self.prepared)
        return sparse.wired(readout, self.plan, self.by, self.sources, self.edits)  # only kept latents leave

    def unpack(self, packed: torch.Tensor) -> Readout:
        """The ``Readout`` this call's ``pack()`` sent (dictionaries' latents scattered back: ``sparse.dense``)."""
        return sparse.dense(packed, self.plan, self.by, self.sources, self.edits)


@dataclass(frozen=True)
class DirectionCall:
    """``direction_attribution``'s arguments for one batch: what a trace computes, ``call.run(model)``."""

    plan: Plan
    positions: torch.Tensor
    direction: torch.Tensor
    stop: Stop
    reads: str
    by: Granularity
    rows: torch.Tensor | None = None
    check: Check = "logit"

    def run(self, model) -> Readout:
        """The attribution of this batch's direction, inside the running trace of ``model``."""
        return direction_attribution(model, self.plan, self.positions, self.direction, self.stop, self.reads, self.by,
                                     self.rows, self.check)


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
