"""The term kinds: how a split term's parts are read in the trace and scored, one module per kind.

Each module has a reads record, ``read(layer, planned, mode, sites)`` returning it (in forward order) and
``score(term, reads, u, rest, split)`` returning ``(parts [batch, parts], rest, rounding)``, ``term`` a ``TermAt``
(the block's module, the planned term and its mode). ``trace.terms.KINDS`` maps ``PlannedTerm.kind`` to its module;
a new kind is one module here, one record in ``families.schema`` and one case in ``plan.build.kind_of``.
"""

from __future__ import annotations

from typing import NamedTuple

from ...plan.plan import PlannedTerm


class TermAt(NamedTuple):
    """The term a kind scores: ``layer`` (its block's module, in the running trace), ``planned`` (its
    ``PlannedTerm``) and ``mode`` (``planned.mode(by)``: ``"heads"``, ``"neurons"``, ``"sources"``, ...)."""

    layer: object
    planned: PlannedTerm
    mode: str | None
