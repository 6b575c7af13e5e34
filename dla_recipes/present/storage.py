"""``Attribution.save`` / ``Attribution.load``: an attribution's fields as one ``torch.save`` file, and back.

The file holds plain data only (tensors, strings, numbers, lists, dicts), so ``torch.load(..., weights_only=True)``
reads it: nothing in it runs code when loaded. The components are kept as they are, not re-read from the labels
(a label does not say everything a ``Component`` does, e.g. a head's term): a plan's ``Components`` as its runs
(``by="neuron"`` on a large model: a few hundred runs for ~10^6 columns), any other sequence one record a column;
the labels are stored as ``None`` when they are those components' own (``Labels``), rebuilt from them when read.

    {"format": "dla_recipes.Attribution", "version": 1, "fields": {...}, "components": {"runs": [...]}}

A ``PositionAttribution`` (several positions a prompt) keeps its flat per-site attribution that way, next to its
layout: ``{"format": "dla_recipes.PositionAttribution", "version": 1, "sites": {...}, "index": ..., "prompts":
[...], "tokens": [[...], ...]}`` (``save_positions`` / ``load_positions``).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import torch

from ..components import Component, Components, Labels, Run
from ..errors import InputError

FORMAT = "dla_recipes.Attribution"
POSITIONS_FORMAT = "dla_recipes.PositionAttribution"
VERSION = 1


def state_of(attr) -> dict:
    """The ``torch.save``-able state of an ``Attribution`` (plain data, see the module docstring)."""
    fields = {f.name: plain(getattr(attr, f.name)) for f in dataclasses.fields(attr)
              if f.name not in ("components", "labels")}
    components = attr.components
    labels = attr.labels  # None: the components' own labels (a plan's ``Labels``), rebuilt when read
    own = isinstance(labels, Labels) and isinstance(components, Components) and labels.components == components
    fields["labels"] = None if own else list(labels)
    if isinstance(components, Components):
        stored = {"runs": [[encode(field) for field in run] for run in components.runs]}
    else:
        stored = {"items": [list(component) for component in components]}
    return {"format": FORMAT, "version": VERSION, "fields": fields, "components": stored}


def fields_of(state) -> dict:
    """The keyword arguments of ``Attribution(...)`` that ``state_of`` saved."""
    if isinstance(state, dict) and state.get("format") == POSITIONS_FORMAT:
        raise InputError("this file is a saved PositionAttribution (several positions a prompt): read it with "
                         "dla_recipes.PositionAttribution.load(path)")
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise InputError("this file is not a saved dla_recipes Attribution (write one with attr.save(path))")
    if state.get("version") != VERSION:
        raise InputError(f"this Attribution was saved in format version {state.get('version')}; this dla_recipes "
                         f"reads version {VERSION}")
    fields = dict(state["fields"])
    for name in ("prompts", "target_tokens", "positions", "contrast_tokens"):
        if fields.get(name) is not None:
            fields[name] = tuple(tuple(v) if isinstance(v, list) else v for v in fields[name])  # sum(): nested
    stored = state["components"]
    if "runs" in stored:
        fields["components"] = Components([Run(*(decode(field) for field in run)) for run in stored["runs"]])
    else:
        fields["components"] = tuple(Component(*item) for item in stored["items"])
    if fields.get("labels") is None:
        fields["labels"] = Labels(fields["components"])
    return fields


def save(attr, path) -> Path:
    """Write ``attr`` to ``path`` (parent folders made); return the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(state_of(attr), path)
    return path


def load(path) -> dict:
    """The fields of the ``Attribution`` saved at ``path`` (read with ``weights_only=True``: plain data only)."""
    return fields_of(torch.load(Path(path), map_location="cpu", weights_only=True))


def save_positions(attr, path) -> Path:
    """Write a ``PositionAttribution`` to ``path`` (parent folders made); return the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {"format": POSITIONS_FORMAT, "version": VERSION, "sites": state_of(attr.sites),
             "index": attr.index.detach().cpu(), "prompts": plain(attr.prompts), "tokens": plain(attr.tokens)}
    torch.save(state, path)
    return path


def load_positions(path) -> dict:
    """The fields of the ``PositionAttribution`` saved at ``path``: ``sites`` as ``Attribution`` keyword arguments
    (``fields_of``), ``index``, ``prompts``, ``tokens`` (read with ``weights_only=True``)."""
    state = torch.load(Path(path), map_location="cpu", weights_only=True)
    if isinstance(state, dict) and state.get("format") == FORMAT:
        raise InputError("this file is a saved Attribution (one position a prompt): read it with "
                         "dla_recipes.Attribution.load(path)")
    if not isinstance(state, dict) or state.get("format") != POSITIONS_FORMAT:
        raise InputError("this file is not a saved dla_recipes PositionAttribution (write one with attr.save(path))")
    if state.get("version") != VERSION:
        raise InputError(f"this PositionAttribution was saved in format version {state.get('version')}; this "
                         f"dla_recipes reads version {VERSION}")
    return {"sites": fields_of(state["sites"]), "index": state["index"], "prompts": tuple(state["prompts"]),
            "tokens": tuple(tuple(t) for t in state["tokens"])}


def encode(field):
    """A ``Run`` field as plain data: a ``range`` as ``[start, stop, step]``, anything else as it is."""
    return [field.start, field.stop, field.step] if isinstance(field, range) else field


def decode(field):
    return range(*field) if isinstance(field, list) else field


def plain(value):
    """A diagnostics value as plain data (tensors on the CPU; containers rebuilt as lists and dicts)."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {key: plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(item) for item in value]
    return value


def same(a, b) -> bool:
    """``a == b`` for an attribution's fields: tensors equal in dtype, shape and every value (NaN equal to NaN),
    containers item by item, floats with NaN equal to NaN."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or (a.dtype, a.shape) != (b.dtype, b.shape):
            return False
        a, b = a.detach().cpu(), b.detach().cpu()
        return torch.equal(a, b) or a.is_floating_point() and bool(((a == b) | (a.isnan() & b.isnan())).all())
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[key], b[key]) for key in a)
    if isinstance(a, Labels) or isinstance(b, Labels):  # a plan's labels: compared by their runs where they can be
        return a == b
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return bool(a == b)
