"""Which ``Prepared`` record a local call starts from: the one an earlier call with the same targets left, while no
parameter or buffer of the model changed since.

What a call's in-trace work needs that depends only on the weights and the targets (``trace.prepared``: the final
head's direction, every term's direction, the pull-backs through ``W_O`` and ``W_down``) is the same for every call
that attributes the same targets with the same weights: at batch 1 its pull-backs re-read a whole weight a block
(on the CPU 5-8% of the forward pass, ``benchmarks/cost.py``). A local call is handed the record of the last calls
(``RECORDS`` of them per model) whose key matches, so its in-trace work is only what reads the forward pass.

The key is computed on the host before the trace, so the trace never compares tensors (a read of a device tensor
on the host waits for the device): the plan (the object; a new plan, as ``dictionaries=`` makes, starts afresh), the
targets' token ids, weights and mean weights (host tensors), and a stamp of every parameter and buffer of the model
(its identity, storage address and in-place version, torch's ``_version``, which every in-place op, optimizer step
and ``load_state_dict`` raises; a parameter or a module replaced, a model moved or dispatched changes the identity
or the address), found by a walk of the modules every call (0.03-0.15 ms on the benchmarks' models: a model's own
forward may rebuild a ``ModuleList`` of its blocks every call, so no registration hook can tell when to walk
again). What no stamp sees is an in-place edit through ``.data`` (a tensor of its own sharing the storage, with a
version of its own): a record left from before it gives parts that no longer sum to the edited model's logit, the
self-check raises, and ``api`` runs the call again without any record (``forget``) before it lets an error through.

Remote calls take no record (the server keeps nothing between requests; the record's tensors are the client's), nor
do calls that edit the forward pass (``intervene=``), which may edit a weight inside the trace. A record keeps at
most ``KEEP_BYTES``: one made for a large call (many sites) keeps its directions for the call only and is dropped
after it (``settle``), so between calls a model holds at most ``RECORDS * KEEP_BYTES``. A call asked with ``fast=Fast(reuse=False)``
takes none (``tests/test_fast_paths.py``: the same numbers bit for bit).
"""

from __future__ import annotations

import weakref
from collections import OrderedDict

import torch

from ..trace.prepared import Prepared
from ..trace.targets import LinearTarget

RECORDS = 4  # records kept per model: the most recently used targets
KEEP_BYTES = 32 << 20  # the most a record holds between calls (RECORDS of them: at most 128 MiB a model)

_STORES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # torch module -> Store


def stamp(module: torch.nn.Module) -> list[tuple]:
    """Each parameter and buffer below ``module`` (a walk of its submodules, a ``None`` slot passed over) as its
    ``(identity, storage address, in-place version)``: an in-place edit, a move to another device or dtype, or
    another tensor or module in its place changes it. One loop, no generator per module: the walk runs every call
    (about 40 us on the wide benchmark model, where a walk then a stamp of its tensors took 70)."""
    out: list = []
    add = out.append
    stack = [module]
    pop, extend = stack.pop, stack.extend
    while stack:
        current = pop()
        if current is None:
            continue
        for t in current._parameters.values():
            if t is not None:
                add((id(t), t.data_ptr(), t._version))
        if current._buffers:
            for t in current._buffers.values():
                if t is not None:
                    add((id(t), t.data_ptr(), t._version))
        if current._modules:
            extend(current._modules.values())
    return out


def target_key(target) -> tuple | None:
    """The host key of a batch's ``LinearTarget`` (its ids, weights and mean weights, as bytes); None for anything
    else (nothing is reused)."""
    if not isinstance(target, LinearTarget):
        return None
    parts = [target.ids, target.weights, target.mean]
    if any(t.device.type != "cpu" for t in parts):
        return None
    return tuple((tuple(t.shape), str(t.dtype), t.contiguous().numpy().tobytes()) for t in parts)


class Store:
    """One model's records: the plan and the weights' stamp they were made with, and up to ``RECORDS`` records by
    target."""

    def __init__(self, plan, weights: list):
        self.plan, self.weights = plan, weights
        self.records: OrderedDict = OrderedDict()


class Reuse:
    """The records one ``attribute`` call hands its batches (``for_target``), and what it does after them."""

    def __init__(self, model, plan):
        self.module = getattr(model, "_module", model)
        self.given: list[tuple[Prepared, int]] = []  # each record handed out, and how often it had served before
        self.store = None
        try:
            weights = stamp(self.module)
        except RuntimeError:  # inference tensors (made under torch.inference_mode) keep no version: nothing reused
            return
        store = _STORES.get(self.module)
        if store is None or store.plan is not plan or store.weights != weights:
            store = _STORES[self.module] = Store(plan, weights)
        self.store = store

    def for_target(self, target) -> Prepared | None:
        """The record for a batch attributing ``target``: the one kept for the same key, or a new one kept for the
        next call (None: nothing is reused, the trace makes its own)."""
        key = None if self.store is None else target_key(target)
        if key is None:
            return None
        records = self.store.records
        record = records.get(key)
        if record is None:
            record = records[key] = Prepared(KEEP_BYTES)
            while len(records) > RECORDS:
                records.popitem(last=False)
        records.move_to_end(key)
        self.given.append((record, record.served))
        return record

    def served(self) -> bool:
        """Whether any batch of this call took a value an earlier call made."""
        return any(record.served > before for record, before in self.given)

    def settle(self) -> None:
        """After the call: drop the records that grew past ``KEEP_BYTES`` (made for a large call)."""
        if self.store is None:
            return
        for key in [k for k, record in self.store.records.items() if record.kept > KEEP_BYTES]:
            del self.store.records[key]

    def forget(self) -> None:
        """Drop every record of this model (a record gave parts that did not sum: a weight edited unseen)."""
        _STORES.pop(self.module, None)
        self.store = None
