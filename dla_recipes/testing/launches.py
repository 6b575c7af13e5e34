"""What a block of code costs a device, counted on any device: its aten ops (a GPU's kernel launches), the times
the host waits for the device, and its float32 copies of low-precision tensors, each split by who issued it.

``Launches(model)`` is a context manager: around a trace it records every aten op (``TorchDispatchMode``) and every
tensor call (``TorchFunctionMode``), and names each one's issuer: the innermost frame of the package
(``"recipe"``), of transformers or ``torch.nn`` (``"model"``), or of nnsight and the rest (``"other"``).

- A *sync* reads a device tensor on the host: ``.item()``, ``.cpu()``, ``.tolist()``, ``bool(t)``, ``float(t)``,
  ``nonzero``, ``unique``, a boolean mask index with a mask on the device, ...
- An *upload* copies host data to the device: ``.to(device)`` of a host tensor, ``torch.tensor(..., device=)``,
  a host tensor of more than one element used with a device tensor. On CUDA a copy from pageable host memory
  synchronises the stream too, so the host waits as it does for a read.
- A *widening* casts a ``bfloat16`` / ``float16`` tensor to float32 (``.float()``, ``.to(float32)``): its number of
  elements, and whether it is a parameter (a type promotion inside an op makes no copy, and is not one).

"On the device" means a parameter or buffer of ``model``, or anything computed from one or made with
``device=`` (tracked op by op), so on the CPU the counts are the ones a GPU would see: a host tensor the client
built (positions, token ids) is free to read. Each sync and upload records how many model ops had run, so
``Counts.mid_forward`` keeps those that happened while the forward pass was running (a wait there stalls it).

Used by ``tests/test_syncs.py`` (the recipe never waits for the device inside the forward pass, and makes no
float32 copy of a whole activation) and ``benchmarks/launches.py`` (the device-independent profile of one call).
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

import dla_recipes

PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # .../dla_recipes
TESTING = os.path.join(PACKAGE, "testing")
MODEL_MARKS = (os.sep + "transformers" + os.sep, os.sep + "torch" + os.sep + "nn" + os.sep)
NNSIGHT = os.sep + "nnsight" + os.sep
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
CASTS = (torch.Tensor.float, torch.Tensor.double, torch.Tensor.to, torch.Tensor.type)


def _widens(func, args, kwargs) -> bool:
    """Whether a cast call copies to float32 / float64."""
    if func in (torch.Tensor.float, torch.Tensor.double):
        return True
    named = list(args[1:]) + [kwargs.get("dtype")]
    return any(a in (torch.float32, torch.float64, "torch.FloatTensor", "torch.DoubleTensor") for a in named)


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
        if NNSIGHT in name:  # nnsight's own work (batching, hooks), even when the package's frame called it
            return "other", f"{os.path.basename(name)}:{frame.f_lineno}"
        frame = frame.f_back
    return "other", ""


def on_device(value) -> bool:
    return isinstance(value, torch.Tensor) and getattr(value, TAG, False)


@dataclass
class Counts:
    """What one ``Launches`` block recorded.

    Attributes:
        ops: ``Counter`` of aten ops per issuer (``"recipe"``, ``"model"``, ``"other"``).
        syncs: ``(issuer, where, call, model ops so far)`` of every host read of a device tensor.
        uploads: ``(issuer, where, what, model ops so far)`` of every copy of host data to the device.
        widenings: ``(issuer, where, numel, of a parameter)`` of every cast of a low-precision tensor to float32 /
            float64 (a type promotion inside an op makes no copy, and is not one).
        by_op: ``Counter`` of ``(issuer, op name)``; by_line: of ``(issuer, file:line)``.
    """

    ops: collections.Counter = field(default_factory=collections.Counter)
    syncs: list = field(default_factory=list)
    uploads: list = field(default_factory=list)
    widenings: list = field(default_factory=list)
    by_op: collections.Counter = field(default_factory=collections.Counter)
    by_line: collections.Counter = field(default_factory=collections.Counter)
    emulating: bool = False
    weights: set = field(default_factory=set)  # the storages of the model's parameters and buffers

    def model_ops(self) -> int:
        return self.ops["model"]

    def recipe_syncs(self) -> list:
        return [s for s in self.syncs if s[0] == "recipe"]

    def mid_forward(self, events: list, who: str = "recipe") -> list:
        """The ``events`` (``syncs`` or ``uploads``) ``who`` issued while the model's forward was running: after
        its first op and before its last (each event records how many model ops had run)."""
        total = self.model_ops()
        return [e for e in events if e[0] == who and 0 < e[-1] < total]

    def largest_widening(self, who: str = "recipe", weights: bool = False) -> int:
        """The most elements ``who`` copied from low precision to float32 at once: of an activation (or, with
        ``weights``, of a parameter)."""
        return max((n for w, _, n, param in self.widenings if w == who and param == weights), default=0)


MOVES = (torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.copy_)
# Made on the device named by ``device=`` (no host data): the result lives there.
FACTORIES = (torch.empty, torch.zeros, torch.ones, torch.full, torch.arange, torch.eye, torch.rand, torch.randn,
             torch.randint, torch.linspace)
MAKERS = (torch.tensor, torch.as_tensor)


def _moves_to_device(func, args, kwargs) -> bool:
    """Whether a ``.to(...)`` / ``.cuda()`` / ``torch.tensor(..., device=)`` call names a device (not a dtype only)."""
    if func is torch.Tensor.cuda:
        return True
    if func in MAKERS:
        return kwargs.get("device") is not None
    named = list(args[1:]) + [kwargs.get("device")]
    return any(isinstance(a, (torch.device, str, torch.Tensor)) for a in named if a is not None)


def upload(func, args, kwargs, flat, tainted: bool) -> str | None:
    """What host data the call copies to the device, or None: a host tensor (or Python data) moved with ``.to`` /
    ``.cuda`` / ``torch.tensor(..., device=)``, or a host tensor of more than one element used as an index or operand
    of a device tensor (on CUDA: a copy that waits for the device, or an error). A CUDA copy from pageable host
    memory synchronises the stream, as a read does."""
    if func in MOVES[:2] or func in MAKERS:
        source = args[0] if args else kwargs.get("data")
        if not on_device(source) and _moves_to_device(func, args, kwargs):
            if func in MOVES[:2] and isinstance(args[0], torch.Tensor) and func is torch.Tensor.to:
                target = next((a for a in list(args[1:]) + [kwargs.get("device")] if a is not None
                               and not isinstance(a, torch.dtype)), None)
                if isinstance(target, torch.Tensor) and not on_device(target):
                    return None  # .to(another host tensor): stays on the host
            return f"{getattr(func, '__name__', func)} of host data"
        return None
    if tainted and func is not torch.Tensor.cpu:
        host = [a for a in flat if isinstance(a, torch.Tensor) and not on_device(a) and a.dim() > 0 and a.numel() > 1]
        if host:
            return f"{getattr(func, '__name__', func)} with a host tensor {tuple(host[0].shape)}"
    return None


class _Dispatch(TorchDispatchMode):
    def __init__(self, counts: Counts):
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.counts.emulating:  # the counter's own stand-in for a copy to the device: not the code's op
            return out
        who, where = issuer(2)
        self.counts.ops[who] += 1
        self.counts.by_op[who, func.__name__.split(".")[0]] += 1
        self.counts.by_line[who, where] += 1
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
            self.counts.syncs.append((who, where, getattr(func, "__name__", str(func)), self.counts.model_ops()))
        elif (func is torch.Tensor.__getitem__ and len(args) > 1
              and any(on_device(a) and a.dtype == torch.bool for a in tree_flatten(args[1])[0])):
            who, where = issuer(2)
            self.counts.syncs.append((who, where, "boolean mask index", self.counts.model_ops()))
        if func in CASTS and args and isinstance(args[0], torch.Tensor) and args[0].dtype in LOW and _widens(func, args, kwargs):
            who, where = issuer(2)
            weight = args[0].untyped_storage().data_ptr() in self.counts.weights  # a parameter, or a slice of one
            self.counts.widenings.append((who, where, args[0].numel(), weight))
        kind = None
        if not (tainted and func in SYNC_METHODS):
            kind = upload(func, args, kwargs, flat, tainted)
            if kind is not None:
                who, where = issuer(2)
                self.counts.uploads.append((who, where, kind, self.counts.model_ops()))
        out = func(*args, **kwargs)
        moved_here = kind is not None and func in MOVES[:2] and out is args[0]
        if moved_here or (tainted and func is torch.Tensor.cpu and out is args[0]):
            # On the CPU a move to the device (.to) or to the host (.cpu) returns the tensor itself, tag and all: on
            # a GPU it is a new tensor on the other side, and the original stays where it was. Stand in for it with
            # a view of its own (not counted: the GPU issues one copy, counted as an upload or a sync).
            self.counts.emulating = True
            try:
                with torch._C.DisableTorchFunction():
                    out = out.view_as(out)
            finally:
                self.counts.emulating = False
        tainted = tainted or kind is not None or (func in FACTORIES and kwargs.get("device") is not None)
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
        for t in tagged:
            self.counts.weights.add(t.untyped_storage().data_ptr())
        # the kept probe of a norm with parameters (frozen_norm.PROBED) was moved to their device when taken: on a
        # CPU run that move returns the host tensor itself, so it is marked as living there too (a norm without
        # parameters is probed on the host, and each move of its probe to the device is a real upload)
        probed = dla_recipes.math.frozen_norm.PROBED
        tagged += [t for m in (module.modules() if module is not None else ()) if probed in m.__dict__
                   and next(m.parameters(), None) is not None
                   for t in (m.__dict__[probed][1].bias, m.__dict__[probed][1].gain)]
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
