"""Make nnterp 1.3.0 import and run on nnsight 0.8.x, and do nothing once nnterp no longer needs it.

nnterp 1.3.0 (the newest on PyPI) was written against nnsight 0.5-0.7 and breaks on 0.8 in two places:

1. it imports ``nnsight.intervention.tracing.globals.Object``; nnsight 0.8 moved that type to ``nnsight.Object``;
2. it reads ``self._model`` on its ``LanguageModel`` subclass; nnsight 0.8 keeps the wrapped model in ``_module``.

``apply()`` installs the smallest fix for each, only when the installed nnsight lacks the old spelling:
an alias module for (1) and a read-only ``_model`` property on ``nnsight.LanguageModel`` for (2). It must run
before anything imports nnterp; ``import dla_recipes`` runs it first thing. It is client side only: a model
built with ``remote=True`` ships nnterp's code by value, and what that code refers to is resolved on the client
before it travels, so the server needs neither nnterp nor this module.
"""

from __future__ import annotations

import importlib
import sys
import types

_OLD_GLOBALS = "nnsight.intervention.tracing.globals"


def _needs_globals_alias() -> bool:
    try:
        importlib.import_module(_OLD_GLOBALS)
    except ImportError:
        return True
    return False


def apply() -> list[str]:
    """Install what nnterp 1.3.0 needs from nnsight 0.8; return the names of the fixes applied (empty: none needed).

    Idempotent: a second call finds the old spellings present and applies nothing.
    """
    import nnsight

    applied = []
    if _needs_globals_alias():
        package = sys.modules.get("nnsight.intervention.tracing")
        if package is None:
            package = types.ModuleType("nnsight.intervention.tracing")
            package.__path__ = []  # a namespace-like package holding only the alias below
            sys.modules[package.__name__] = package
            import nnsight.intervention

            nnsight.intervention.tracing = package
        globals_module = types.ModuleType(_OLD_GLOBALS)
        globals_module.__doc__ = "Alias installed by dla_recipes._compat: nnsight 0.8 moved Object to nnsight.Object."
        globals_module.Object = nnsight.Object
        sys.modules[_OLD_GLOBALS] = globals_module
        package.globals = globals_module
        applied.append("nnsight.intervention.tracing.globals.Object -> nnsight.Object")

    language_model = nnsight.LanguageModel
    if not hasattr(language_model, "_model"):
        language_model._model = property(lambda self: self._module, doc="nnsight<0.8 name of the wrapped model (dla_recipes._compat).")
        applied.append("LanguageModel._model -> LanguageModel._module")
    return applied


APPLIED = apply()
