"""What a call's in-trace work needs that depends only on the weights and the targets, made once and kept.

The recipe's arithmetic splits in two. One part reads the forward pass (a term's write at the sites, a norm's real
input). The other depends only on the weights and on what is attributed: the final head's direction
(``head.final_direction``), every term's direction on the stream (``terms.term_directions``), a term's direction on
its write (``terms.write_direction``) and, for a term split through one projection with nothing input-dependent
between it and the stream, the pull-back of that direction onto the projection's input (``kinds.linear.static``:
``u @ W_O``, ``u @ W_down``, which re-reads a whole weight). ``Prepared`` is the memo of the second part:
``get(key, make)`` makes a value once per record and hands the same object back after.

A record lives for one call, in the trace (server side on NDIF too, where nothing outlives the request). A local
call may instead be given the record an earlier call left (``transport.reuse``: per model, keyed on the host by the
targets and a stamp of every parameter), so that its in-trace work is only what reads the forward pass: the same
values, the same objects, so the same numbers bit for bit. ``budget`` bounds what a record keeps past its call:
a value made with ``keep=True`` (a pull-back) is kept only while the record's bytes stay within it, so a record made
for a large call (many sites) keeps no ``[sites, d_mlp]`` per block and holds no more memory than the call without
it (each such value is made, used and dropped, as before); the values every call needs whole (the directions) are
kept with the record regardless, and the client drops a record whose bytes pass the budget after its call.
"""

from __future__ import annotations

import dataclasses

import torch


def nbytes(value) -> int:
    """The bytes of the tensors in ``value``: a tensor, or a tuple, list, dict or dataclass of them, nested
    (anything else, an envoy, a module, counts 0)."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (tuple, list)):
        return sum(nbytes(v) for v in value)
    if isinstance(value, dict):
        return sum(nbytes(v) for v in value.values())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return sum(nbytes(getattr(value, f.name)) for f in dataclasses.fields(value))
    return 0


class Prepared:
    """A memo of the work that depends only on the weights and the targets (module docstring).

    Attributes:
        budget: bytes of ``keep=True`` values the record may hold (0: none, the record of a remote call).
        kept: bytes held so far (every value the record holds).
        served: values handed back by ``get`` that an earlier call made (the record was reused).
        calls: the calls that used the record.

    A plain class with no ``super()``: a remote trace ships it by its source.
    """

    def __init__(self, budget: int = 0):
        self.values: dict = {}
        self.budget = int(budget)
        self.kept = 0
        self.served = 0
        self.calls = 0
        self.made: dict = {}  # each value's call (``calls`` when it was made): a later call's get is ``served``

    def begin(self) -> Prepared:
        """Mark the start of one call's use of the record (its values made before are then ``served``)."""
        self.calls += 1
        return self

    def get(self, key, make, keep: bool = False):
        """The value of ``key``: made by ``make()`` the first time, the same object after. ``keep``: a value only
        some calls need, kept past this use only while the record stays within ``budget`` (else made anew each
        time it is asked for)."""
        if key in self.values:
            if self.made[key] != self.calls:
                self.served += 1
            return self.values[key]
        value = make()
        if keep and self.kept >= self.budget:  # full (a record made for one call only: 0), nothing more kept
            return value
        size = nbytes(value)
        if keep and self.kept + size > self.budget:
            return value
        self.values[key] = value
        self.made[key] = self.calls
        self.kept += size
        return value
