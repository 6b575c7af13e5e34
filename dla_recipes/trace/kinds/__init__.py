"""The term kinds: how a split term's parts are read in the trace and scored, one module per kind.

Each module has a reads record, ``read(layer, planned, mode, rows, positions)`` returning it (in forward
order) and ``score(layer, planned, mode, reads, u, rest, split)`` returning ``(parts [batch, parts], rest,
rounding)``. ``trace.terms.KINDS`` maps ``PlannedTerm.kind`` to its module; a new kind is one module here, one
record in ``families.schema`` and one case in ``plan.build.kind_of``.
"""
