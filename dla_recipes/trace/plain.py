"""The common case's in-trace arithmetic: every term written straight into the stream, scored in a few products.

On most families (Llama, Qwen, Mistral, ...) nothing acts on the stream after a term is written (no stream norm,
scale, bias or multiplier, no parallel streams) and nothing stands between a term's read and its add (no post-norm,
outer norm, scale, bias or multiplier on its write). A term's score is then its read at the sites times one
direction, summed over its parts: a term read whole, its write dotted with the direction on the stream; heads or
neurons through one projection with no bias anywhere (``kinds.linear``, a ``bare`` mode), the projection's input
times the direction pulled back onto it (``kinds.linear.static``), summed over each head's slice.

``lane(model, plan, by, stop, per_layer, prepared)`` is that plan for one call (None where any term, or the call,
is not of this kind: ``decompose`` then goes the general way, ``trace.terms``). ``decompose`` reads each term at
the sites in forward order (``Lane.read``, the reads ``trace.terms.read_term`` makes) and, after the last block,
``Lane.score`` scores them all in one product per shape of term (whole terms, each block's heads, each block's
neurons), its columns put in the plan's order by one index: a handful of ops a call in place of a few per term.
Each score is the same elementwise product, summed over the same contiguous last axis, as ``terms.score_term``'s
for the term alone, so the numbers are the same bit for bit (``tests/test_fast_paths.py``, ``LANE = False``).

A lane holds every read until the forward pass ends, so it runs only where the recipe defers its arithmetic
(``trace.recipe.DEFER_SITES``: a small call), and only in float32 or float64 (in low precision the general way
also reads each split term's write, for the self-check).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..args import Granularity
from ..plan.plan import Plan, PlannedTerm, Stop
from .kinds import linear
from .readers import Sites, at, read_site
from .terms import projected, write_direction

LANE = True  # False: every call goes the general way (tests/test_fast_paths.py)
GRANULARITIES = ("block", "head", "neuron")


class Group(NamedTuple):
    """The terms of one shape, scored in one product: ``mode`` (None: read whole; ``"heads"`` / ``"neurons"``),
    ``members`` their ``(block, index in the block)`` in forward order, ``parts`` / ``part_width`` (split terms'),
    ``directions`` ``[n, members, width]`` each member's direction on what it reads (float32)."""

    mode: str | None
    members: tuple
    parts: int
    part_width: int
    directions: torch.Tensor


class Lane(NamedTuple):
    """One call's plan of the common case: ``modes[i][k]`` how term ``k`` of block ``i`` is read (None: whole),
    ``groups`` the products, ``order`` ``[columns]`` long (on the device) the column of the groups' joined scores
    each of the plan's columns after the embedding takes, or None where they are in the plan's order already."""

    modes: tuple
    groups: tuple
    order: torch.Tensor | None

    def read(self, layer, i: int, terms: tuple[PlannedTerm, ...], sites: Sites, reads: dict) -> None:
        """Read block ``i``'s terms at the sites, in forward order, into ``reads[(i, k)]`` (``[n, width]``, the
        model's dtype): a whole term's write, a split term's projection input (heads flattened)."""
        for k, planned in enumerate(terms):
            mode = self.modes[i][k]
            if mode is None:
                reads[i, k] = at(read_site(layer, planned.term.output, sites.batch), sites, keep=True)
            else:
                reads[i, k] = linear.read(layer, planned, mode, sites).inputs

    def score(self, reads: dict) -> torch.Tensor:
        """``[n, columns]``: every term's parts in the plan's order (the embedding's column not included)."""
        out = []
        for group in self.groups:
            values = torch.stack([reads[member] for member in group.members], 1)  # [n, members, width]
            parts = values * group.directions.to(values.device)
            if group.mode is None:
                parts = parts.sum(-1)  # [n, members]
            elif group.part_width != 1:
                parts = parts.unflatten(-1, (group.parts, group.part_width)).sum(-1)  # [n, members, heads]
            out.append(parts.flatten(1))
        joined = out[0] if len(out) == 1 else torch.cat(out, -1)
        return joined if self.order is None else joined.index_select(-1, self.order.to(joined.device))


def plain_mode(planned: PlannedTerm, by: Granularity) -> tuple[bool, str | None]:
    """``(plain, mode)``: whether ``planned`` writes straight into the stream with nothing acting on it after, and
    is read whole or split through one projection with no bias (a ``bare`` mode) at ``by``; its mode there."""
    term, write, stream = planned.term, planned.term.write, planned.term.stream
    if (planned.dictionary is not None or term.hyper is not None or planned.multiplier != 1.0
            or planned.stream_multiplier != 1.0
            or any(x is not None for x in (write.post_norm, write.outer_norm, write.scale, write.bias, stream.scale,
                                           stream.bias, stream.multiplier, stream.norm, stream.norm_after))):
        return False, None
    mode = planned.mode(by)
    if mode is None:
        return True, None
    plain = (mode in ("heads", "neurons") and planned.kind == "linear" and mode in planned.bare
             and getattr(planned.term.split, "output_gate", None) is None)
    return plain, mode


def lane(model, plan: Plan, by: Granularity, stop: Stop | None, per_layer: list, prepared) -> Lane | None:
    """The call's ``Lane``, or None where a term or the plan is not of the common case (module docstring);
    ``per_layer``: ``terms.term_directions``'s, ``prepared``: the call's record (``trace.prepared``), which keeps
    the lane (its directions stacked) for a later call with the same targets and weights."""
    if not LANE or by not in GRANULARITIES or plan.stream_dictionary is not None or plan.family.collapse is not None \
            or plan.family.layer_scale is not None:
        return None
    return prepared.get(("lane", stop, by), lambda: made(model, plan, by, stop, per_layer), keep=True)


def made(model, plan: Plan, by: Granularity, stop: Stop | None, per_layer: list) -> Lane | None:
    """``lane``'s value, made: each term's mode checked, its direction on what it reads made (``write_direction``,
    then ``kinds.linear.static`` for a split term), the directions stacked by shape, and the plan's column order."""
    modes, shapes, columns = [], {}, []  # columns: (group key, member, its width in columns), in the plan's order
    for i, terms in enumerate(plan.terms_before(stop)):
        layer, block = model.layers[i], []
        for k, planned in enumerate(terms):
            plain, mode = plain_mode(planned, by)
            if not plain:
                return None
            u, _ = write_direction(layer, planned, per_layer[i][k][0])  # no bias: the rest is 0
            if mode is not None:
                u = linear.static(layer, planned, mode, projected(layer, planned, u), 0.0)[0]
            parts, width = (planned.parts, planned.part_width) if mode is not None else (1, 0)
            key = (mode, parts, width, int(u.shape[-1]))
            shapes.setdefault(key, []).append(((i, k), u))
            columns.append((key, len(shapes[key]) - 1, parts))
            block.append(mode)
        modes.append(tuple(block))
    if not columns:
        return None
    keys, offsets, start = list(shapes), {}, 0
    for key in keys:  # the groups' joined scores: each group's members' columns, member by member
        offsets[key] = start
        start += len(shapes[key]) * key[1]
    runs: list = []  # [first, count]: where each run of the plan's columns lies in the joined scores
    for key, member, parts in columns:
        first = offsets[key] + member * parts
        if runs and runs[-1][0] + runs[-1][1] == first:
            runs[-1][1] += parts
        else:
            runs.append([first, parts])
    device = per_layer[0][0][0].device if per_layer and per_layer[0] else model.lm_head.weight.device
    groups = tuple(Group(key[0], tuple(m for m, _ in shapes[key]), key[1], key[2],
                         torch.stack([u for _, u in shapes[key]], 1)) for key in keys)
    if len(runs) == 1:  # the plan's order already (runs[0] starts at 0)
        return Lane(tuple(modes), groups, None)
    # made on the device, run by run: no host list copied up while the forward pass runs
    order = torch.cat([torch.arange(first, first + count, device=device) for first, count in runs])
    return Lane(tuple(modes), groups, order)
