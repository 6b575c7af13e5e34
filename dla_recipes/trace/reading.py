"""What an in-trace call reads beside its target and sites: one small frozen record, ``Reading``, and the sites'
places, ``Where``.

A ``Reading`` is the part of a user's question (``dla_recipes.question``) the trace needs: the granularity, the heads
split by source, whether the forward pass may be edited, the self-check's reads, and whether the common case's lane
(``trace.plain``) may be taken. It travels with the call into a remote trace (by value), so it holds only plain
values and the plan's ``Sources``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..args import Check, Granularity
from ..plan.plan import Sources, Stop


@dataclass(frozen=True)
class Reading:
    """What the trace reads: ``by`` (the granularity), ``sources`` (``by="source"``: which heads split into how
    many sources), ``edits`` (the forward pass may be edited: each split term gets an ``.edit`` column), ``check``
    (``"adds"``: also what the per-add check needs) and ``lane`` (the common case may be scored in a few products
    after the forward pass; False: the general path, the same numbers)."""

    by: Granularity = "block"
    sources: Sources | None = None
    edits: bool = False
    check: Check = "logit"
    lane: bool = True


@dataclass(frozen=True)
class Where:
    """Where a call reads: ``positions`` ``[n]`` (indices into the padded sequence), ``rows`` ``[n]`` (each site's
    prompt; None: one site per prompt), ``offsets`` ``[n]`` (``by="source"``: where each site's prompt's own tokens
    start) and ``stop`` (a direction read before a block's sublayer; None: the final norm's input)."""

    positions: torch.Tensor
    rows: torch.Tensor | None = None
    offsets: torch.Tensor | None = None
    stop: Stop | None = None
