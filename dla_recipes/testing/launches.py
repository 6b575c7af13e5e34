"""What a block of code costs a device, counted on any device: its aten ops (a GPU's kernel launches), its host
synchronisations and its float32 widenings of low-precision tensors, each split by who issued it.

``Launches(model)`` is a context manager: around a trace it records every aten op (``TorchDispatchMode``) and every
tensor call that makes the host wait for the device (``TorchFunctionMode``: ``.item()``, ``.cpu()``, ``.tolist()``,
``bool(t)``, ``float(t)``, ``nonzero``, ``unique``, a boolean mask index, ...), and names the issuer: the innermost
frame of the package (``"recipe"``), of transformers or ``torch.nn`` (``"model"``), else ``"other"`` (nnsight).

A sync is counted only on a tensor that lives "on the device" (a boolean mask index: only a mask on the device): a parameter or buffer of ``model``, or anything
computed from one (tracked op by op), so on the CPU the count is the one a GPU would see; a host tensor the client
built (positions, token ids) is free to read. A widening is a ``bfloat16`` / ``float16`` -> ``float32`` copy
(``.float()``, ``.to(float32)``, a promoting op), recorded with its number of elements.

Used by ``tests/test_costs.py`` (the recipe never synchronises inside the trace, no full-width float32 copy of an
activation) and ``benchmarks/launches.py`` (the device-independent profile of one call).
"""

from __future__ import annotations

import collections
import os
import sys
from dataclasses import dataclass, field
from typing import Self

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # .../dla_recipes
TESTING = os.path.join(PACKAGE, "testing")
MODEL_MARKS = (os.sep + "transformers" + os.sep, os.sep + "torch" + os.sep + "nn" + os.sep)
TAG = "_dla_on_device"

# Tensor calls that make the host wait for the device's result (on a CUDA tensor).
SYNC_METHODS = {
    torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.cpu, torch.Tensor.numpy, torch.Tensor.__bool__,
    torch.Tensor.__float__, torch.Tensor.__int__, torch.Tensor.__index__, torch.Tensor.nonzero, torch.nonzero,
    torch.Tensor.unique, torch.unique, torch.unique_consecutive, torch.masked_select, torch.Tensor.masked_select,
    torch.equal, torch.allclose, torch.Tensor.allclose, torch.argwhere, torch.Tensor.argwhere, torch.bincount,
    torch.Tensor.bincount, torch.Tensor.repeat_interleave, torch.repeat_interleave,
}
LOW = (torch.bfloat16, torch.float16)


def issuer(depth: int = 2) -> tuple[str, str]:
    """``(who, where)`` of the innermost package / model frame above this call: who is ``"recipe"``, ``"model"``
    or ``"other"``; where is ``file:line`` of that frame."""
    frame = sys._getframe(depth)
    while frame is not None:
        name = frame.f_code.co_filename
        if name.startswith(PACKAGE) and not name.startswith(TESTING):
            return "recipe", f"{os.path.relpath(name, os.path.dirname(PACKAGE))}:{frame.f_lineno}"
        if any(mark in name for mark in MODEL_MARKS) and "torch" + os.sep + "utils" not in name:
            return "model", f"{os.path.basename(name)}:{frame.f_lineno}"
        frame = frame.f_back
    return "other", ""


def on_device(value) -> bool:
    return isinstance(value, torch.Tensor) and getattr(value, TAG, False)


@dataclass
class Counts:
    """What one ``Launches`` block recorded.

    Attributes:
        ops: ``Counter`` of aten ops per issuer (``"recipe"``, ``"model"``, ``"other"``).
        syncs: ``(issuer, where, call)`` of every host synchronisation on a device tensor.
        widenings: ``(issuer, where, numel)`` of every low-precision -> float32 copy.
        by_op: ``Counter`` of ``(issuer, op name)``.
    """

    ops: collections.Counter = field(default_factory=collections.Counter)
    syncs: list = field(default_factory=list)
    widenings: list = field(default_factory=list)
    by_op: collections.Counter = field(default_factory=collections.Counter)

    def recipe_syncs(self) -> list:
        return [s for s in self.syncs if s[0] == "recipe"]

    def largest_widening(self, who: str = "recipe") -> int:
        return max((n for w, _, n in self.widenings if w == who), default=0)


class _Dispatch(TorchDispatchMode):
    def __init__(self, counts: Counts):
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        who, where = issuer(2)
        self.counts.ops[who] += 1
        self.counts.by_op[who, func.__name__.split(".")[0]] += 1
        if out is not None and isinstance(out, torch.Tensor) and out.dtype == torch.float32:
            inputs = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
            if any(a.dtype in LOW and a.numel() == out.numel() for a in inputs):
                self.counts.widenings.append((who, where, out.numel()))
        return out


class _Function(TorchFunctionMode):
    def __init__(self, counts: Counts):
        super().__init__()
        self.counts = counts

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat = tree_flatten((args, kwargs))[0]
        tainted = any(on_device(a) for a in flat)
        if tainted and func in SYNC_METHODS:
            who, where = issuer(2)
            self.counts.syncs.append((who, where, getattr(func, "__name__", str(func))))
        elif (func is torch.Tensor.__getitem__ and len(args) > 1
              and any(on_device(a) and a.dtype == torch.bool for a in tree_flatten(args[1])[0])):
            who, where = issuer(2)
            self.counts.syncs.append((who, where, "boolean mask index"))
        out = func(*args, **kwargs)
        if tainted and func is torch.Tensor.cpu and out is args[0]:
            # On a CPU "device" .cpu() returns the tensor itself, tag and all, so every later read of the host copy
            # would count as a sync; a GPU returns a new host tensor: stand in for it with a view of its own
            # (one aten op, where the GPU issues one device-to-host copy).
            out = out.view_as(out)
        if tainted and func not in (torch.Tensor.cpu, torch.Tensor.numpy, torch.Tensor.tolist):
            for o in tree_flatten(out)[0]:
                if isinstance(o, torch.Tensor):
                    try:
                        setattr(o, TAG, True)
                    except (AttributeError, RuntimeError):  # a tensor subclass that refuses attributes
                        pass
        return out


class Launches:
    """Count what the code inside costs a device (see the module docstring); ``.counts`` after the block."""

    def __init__(self, model=None):
        self.counts = Counts()
        self.model = model

    def __enter__(self) -> Self:
        module = getattr(self.model, "_model", self.model)
        tagged = list(module.parameters()) + list(module.buffers()) if module is not None else []
        self._tagged = tagged
        for t in tagged:
            setattr(t, TAG, True)
        self._modes = [_Function(self.counts), _Dispatch(self.counts)]
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc):
        for mode in reversed(self._modes):
            mode.__exit__(*exc)
        for t in self._tagged:
            if hasattr(t, TAG):
                delattr(t, TAG)
        return False
