"""The exceptions dla_recipes raises, each naming the problem: bad input, an unknown family, a sum that fails."""

from __future__ import annotations


class DLAError(Exception):
    """Base class of every dla_recipes error."""


class InputError(DLAError, ValueError):
    """A bad argument (prompt, token, position, granularity, batch size, tolerance, model, dtype, ...): the message
    names the argument and the fix. Also a ``ValueError``."""


class UnknownFamilyError(DLAError, ValueError):
    """The model's family is not in dla_recipes' family table (the message says how to add it)."""


class FamilyTableError(DLAError, ValueError):
    """The family table does not describe this model (a path is missing or a shape does not fit)."""


class ExactnessError(DLAError, RuntimeError):
    """The parts did not sum to the model's own logit: the family is mis-described, never silently wrong."""


class RemoteError(DLAError, RuntimeError):
    """A remote (NDIF) run failed: key, host, model or a server-side exception, named in the message."""
