"""The term kinds: how a split term's parts are read in the trace and scored, one module per kind.

Each module has a reads record, ``read(layer, planned, mode, sites)`` returning it (in forward order) and
``score(term, reads, u, rest, split)`` returning ``(parts [batch, parts], rest, rounding)``, ``term`` a ``TermAt``
(the block's module, the planned term and its mode). ``trace.terms.KINDS`` maps ``PlannedTerm.kind`` to its module,
``trace.terms.MODE_KINDS`` the modes that choose their own (``"sources"``, ``"features"``); a kind whose parts are
read along the direction on the term's write itself, not through its projection, says ``ON_WRITE = True`` (its reads
carry the write whole as ``value``: ``features``). A new kind is one module here, one record in
``families.schema`` and one case in ``plan.build.kind_of``.
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
