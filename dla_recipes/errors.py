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


class NonFiniteError(ExactnessError):
    """A NaN or inf in the model's numbers (its logits, a block's write, the stream, a frozen norm): the message names
    the first place it appears and what to do (usually: load the model in bfloat16 or float32, not float16)."""


class RemoteError(DLAError, RuntimeError):
    """A remote (NDIF) run failed: key, host, model or a server-side exception, named in the message."""


class LoadError(DLAError, RuntimeError):
    """nnterp could not load the model: the message names its model type, the standardized module nnterp could not
    find (layers, ln_final, lm_head, self_attn, mlp) and the ``rename_config`` that would load it, where one would."""


class TraceUsageError(DLAError, RuntimeError):
    """An in-trace recipe called where it cannot run (outside a trace, inside an invoke, before its prompts): the
    message says where to call it instead."""
