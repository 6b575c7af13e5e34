"""What ``attribute`` prepares on the host before its trace, kept for the same question asked again.

Before its trace runs, a call checks and tokenizes its prompts, resolves its target and contrast tokens, places its
positions, groups its prompts into batches (``transport.batches``) and lays out its result (``result.layout_of``):
at batch 1 on the CPU 0.5-0.9 ms on the wide benchmark model (2-3% of its forward pass), the same every time a
notebook asks the same question again (a cell run again, a loop that edits the model and asks again,
``by="block"`` then ``by="head"``). ``prepared`` keeps the last ``CALLS`` preparations per plan (one plan a model),
keyed on the host by the arguments themselves:

- the prompts as text (token-id prompts: not kept), the target and contrast as a token (text or an ``int`` id), one
  per prompt, ``"next"`` or ``"mean"`` (a weighted set, a tensor or array, ``None``: not kept), the position (an
  int, a list of ints, a slice, ``"all"``, a slice per prompt) and ``batch_size``, each by its exact type (``True``
  is not ``1``);
- the plan (the object: a new plan, as ``dictionaries=`` makes, starts afresh) and the tokenizer (the object itself,
  held by the key so that no other tokenizer can take its place, its length, which a token added to it changes, its
  padding side and whether it adds a BOS or EOS token).

What is kept is immutable (``Batch`` records of tuples and tensors no stage edits in place), so a call that finds
its preparation runs the same trace on the same inputs: the same numbers bit for bit
(``tests/test_fast_paths.py`` runs each family with ``fast=Fast(memo=False)`` too). A preparation that warned (a word
without its leading space, ``spacing.space_warning``) is not kept, so the call warns again each time it is asked.
A call asked with ``fast=Fast(memo=False)`` (or ``fast=False``) neither finds nor keeps one.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict

from .spacing import warned

CALLS = 8  # preparations kept per model: the most recently asked

_KEPT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # plan -> OrderedDict(key -> preparation)
_NONE = object()  # a value no key describes


def _token(value):
    """A key for a target or contrast: a token (text or an exact ``int``), ``None``, or a list / tuple of tokens
    (one per prompt); ``_NONE`` for anything else (not kept)."""
    if value is None or type(value) in (str, int):
        return (type(value).__name__, value)
    if type(value) in (list, tuple) and all(type(v) in (str, int) for v in value):
        return ("list", tuple((type(v).__name__, v) for v in value))
    return _NONE


def _slice(value):
    if all(v is None or type(v) is int for v in (value.start, value.stop, value.step)):
        return ("slice", value.start, value.stop, value.step)
    return _NONE


def _position(value):
    """A key for ``position``: an int, ``"all"``, a slice, or a list / tuple of ints or of slices; ``_NONE``
    otherwise."""
    if type(value) in (int, str):
        return (type(value).__name__, value)
    if type(value) is slice:
        return _slice(value)
    if type(value) in (list, tuple) and all(type(v) is int for v in value):
        return ("ints", type(value).__name__, tuple(value))
    if type(value) in (list, tuple) and all(type(v) is slice for v in value):
        spans = tuple(_slice(v) for v in value)
        return _NONE if _NONE in spans else ("spans", type(value).__name__, spans)
    return _NONE


def key_of(model, prompts, logits, batch_size) -> tuple | None:
    """The host key of a call's preparation, or None when it is not kept (see the module docstring). ``prompts``:
    the checked list (``args.check_prompts``); ``logits``: ``(target, contrast, position)`` as the user gave them."""
    target, contrast, position = logits
    if not all(type(p) is str for p in prompts):
        return None
    tokenizer = getattr(model, "tokenizer", None)
    if tokenizer is None:
        return None
    parts = (_token(target), _token(contrast), _position(position))
    if _NONE in parts or target is None or (batch_size is not None and type(batch_size) is not int):
        return None
    try:
        state = (tokenizer, len(tokenizer), getattr(tokenizer, "padding_side", None),  # the object: held, compared
                 getattr(tokenizer, "add_bos_token", None), getattr(tokenizer, "add_eos_token", None))
        hash(state)
    except TypeError:  # a tokenizer without a length, or unhashable
        return None
    return (tuple(prompts), *parts, batch_size, state)


def prepared(plan, key: tuple | None, make):
    """The preparation kept for ``key`` with this plan, else ``make()``'s, kept for the next call unless it warned
    (``spacing.warned``) or ``key`` is None."""
    found = recall(plan, key)
    if found is not None:
        return found
    before = warned()
    made = make()
    if warned() == before:
        keep(plan, key, made)
    return made


def recall(plan, key: tuple | None):
    """The preparation kept for ``key`` with this plan, or None."""
    if key is None:
        return None
    kept = _KEPT.get(plan)
    found = None if kept is None else kept.get(key)
    if found is not None:
        kept.move_to_end(key)
    return found


def keep(plan, key: tuple | None, preparation) -> None:
    """Keep ``preparation`` for ``key`` (None: nothing), the last ``CALLS`` per plan."""
    if key is None:
        return
    kept = _KEPT.setdefault(plan, OrderedDict())
    kept[key] = preparation
    while len(kept) > CALLS:
        kept.popitem(last=False)

