"""The common case's in-trace arithmetic: every term written straight into the stream, scored in a few products.

On most families (Llama, Qwen, Mistral, ...) nothing acts on the stream after a term is written (no stream norm,
scale, bias or multiplier, no parallel streams) and nothing stands between a term's read and its add (no post-norm,
outer norm, scale, bias or multiplier on its write). A term's score is then its read at the sites times one
direction, summed over its parts: a term read whole, its write dotted with the direction on the stream; heads or
neurons through one projection with no bias anywhere (``kinds.linear``, a ``bare`` mode), the projection's input
times the direction pulled back onto it (``kinds.linear.static``), summed over each head's slice.

``lane(model, plan, by, stop, per_layer, work)`` is that plan for one call (None where any term, or the
call, is not of this kind: ``decompose`` then goes the general way, ``trace.terms``). ``decompose`` reads each term
at the sites in forward order (``Lane.read``, the reads ``trace.terms.read_term`` makes) and, after the last block,
``Lane.score`` scores them all in one product per shape of term (whole terms, each block's heads, each block's
neurons), its columns put in the plan's order by one index: a handful of ops a call in place of a few per term. In
low precision (``low``: the call bounds the model's own rounding, ``math.rounding.Rounding``) the lane also reads
each split term's write and each block's output, as the general way does, and computes each split term's gap and
noise and each block's stream noise in the same few products (``Checks``).

Each number is the same elementwise product, summed over the same contiguous last axis, as the general way's for
the term alone (``terms.score_term``, ``math.rounding.stream_sumsq``), so the parts and every self-check field are
the same bit for bit (``tests/test_fast_paths.py``, ``fast=Fast(lane=False)``). A lane holds every read until the forward
pass ends, so it runs only where the recipe defers its arithmetic (``trace.recipe.DEFER_SITES``: a small call).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..args import Granularity
from ..math.rounding import Rounding
from ..plan.plan import Plan, PlannedTerm, Stop
from .kinds import linear
from .readers import Sites, at, read_site
from .terms import projected, roundings, write_direction

GRANULARITIES = ("block", "head", "neuron")
# the stream's noise is taken a few blocks at once, in float64: at most this many rows of d_model widened at once
# (sites x blocks; 1 MiB at d_model 4096), so no float64 copy grows with the depth times the sites
STREAM_ROWS = 32


class Group(NamedTuple):
    """The terms of one shape, scored in one product: ``mode`` (None: read whole; ``"heads"`` / ``"neurons"``),
    ``members`` their ``(block, index in the block)`` in forward order, ``parts`` / ``part_width`` (split terms'),
    ``directions`` ``[n, members, width]`` each member's direction on what it reads (float32). In low precision a
    split group's ``writes`` ``[n, members, d_model]`` are its members' directions on their writes and
    ``roundings`` ``[members]`` their roundings after the projection (``terms.roundings``); else None."""

    mode: str | None
    members: tuple
    parts: int
    part_width: int
    directions: torch.Tensor
    writes: torch.Tensor | None = None
    roundings: torch.Tensor | None = None


class Checks(NamedTuple):
    """What a low-precision call collects for the self-check (``math.rounding.Rounding``), as the general way does:
    ``split`` each split term's ``(group, member, (block, index))`` in forward order (its gap and noise); ``blocks``
    the blocks after whose adds the stream's noise is taken, ``adds`` ``[blocks]`` their terms' count (float32) and
    ``directions`` ``[n, blocks, d_model]`` the direction on the stream there (the block's last term's)."""

    split: tuple
    blocks: tuple
    adds: torch.Tensor
    directions: torch.Tensor


class Lane(NamedTuple):
    """One call's plan of the common case: ``modes[i][k]`` how term ``k`` of block ``i`` is read (None: whole),
    ``groups`` the products, ``order`` ``[columns]`` long (on the device) the column of the groups' joined scores
    each of the plan's columns after the embedding takes, or None where they are in the plan's order already;
    ``checks``: in low precision, what the self-check collects (``Checks``), else None."""

    modes: tuple
    groups: tuple
    order: torch.Tensor | None
    checks: Checks | None = None

    def read(self, layer, i: int, terms: tuple[PlannedTerm, ...], sites: Sites, reads: dict) -> None:
        """Read block ``i``'s terms at the sites, in forward order, into ``reads[(i, k)]`` (``[n, width]``, the
        model's dtype): a whole term's write, a split term's projection input (heads flattened); in low precision
        a split term's write too (``reads[(i, k, "written")]``) and the block's output (``reads[(i, "stream")]``)."""
        checks = self.checks
        for k, planned in enumerate(terms):
            mode = self.modes[i][k]
            if mode is None:
                reads[i, k] = at(read_site(layer, planned.term.output, sites.batch), sites, keep=True)
                continue
            reads[i, k] = linear.read(layer, planned, mode, sites).inputs
            if checks is not None:  # what it really wrote: its gap to its parts is its own rounding
                reads[i, k, "written"] = at(read_site(layer, planned.term.output, sites.batch), sites, keep=True)
        if checks is not None and i in checks.blocks:
            reads[i, "stream"] = at(read_site(layer, "output"), sites, keep=True)

    def score(self, reads: dict, rounding: Rounding | None = None, embed: torch.Tensor | None = None) -> torch.Tensor:
        """``[n, columns]``: every term's parts in the plan's order (the embedding's column not included). In low
        precision ``rounding`` collects each split term's gap and noise and each block's stream noise, in forward
        order, as ``terms.layer_scores`` and ``recipe.decompose`` do (``embed`` ``[n, d_model]``: the stream entering
        the first block)."""
        out, gaps = [], {}
        for g, group in enumerate(self.groups):
            parts = products(group, torch.stack([reads[member] for member in group.members], 1))
            if rounding is not None and group.writes is not None:  # terms.score_term's written, noise and gap
                along = torch.stack([reads[(*member, "written")] for member in group.members], 1) * group.writes
                written = along.sum(-1) + 0.0  # the rest of a term with no bias: 0.0
                noise = (along ** 2).sum(-1) * group.roundings
                gaps[g] = (written - parts.sum(-1) - 0.0, noise)
            out.append(parts.flatten(1))
        if rounding is not None and self.checks is not None:
            self.collect(reads, rounding, embed, gaps)
        joined = out[0] if len(out) == 1 else torch.cat(out, -1)
        return joined if self.order is None else joined.index_select(-1, self.order.to(joined.device))

    def collect(self, reads: dict, rounding: Rounding, embed: torch.Tensor, gaps: dict) -> None:
        """``rounding``'s lists, in forward order: each split term's gap, noise and name, then each block's stream
        noise, ``adds * sum((max(|before|, |after|) * v)^2)`` (``math.rounding.stream_sumsq``, in float64)."""
        checks = self.checks
        for g, j, name in checks.split:
            gap, noise = gaps[g]
            rounding.split_gaps.append(gap[:, j])
            rounding.split_noise.append(noise[:, j])
            rounding.split_terms.append(name)
        previous = embed.double()  # [n, d_model]: the stream before the next block taken
        step = max(1, STREAM_ROWS // previous.shape[0])
        for start in range(0, len(checks.blocks), step):  # a few blocks at once, each in float64
            blocks = checks.blocks[start:start + step]
            after = torch.stack([reads[i, "stream"] for i in blocks], 1).double()  # [n, blocks, d_model]
            before = torch.cat([previous.unsqueeze(1), after[:, :-1]], 1)
            size = torch.maximum(before.abs(), after.abs())
            directions = checks.directions[:, start:start + step].to(size.device).double()
            noise = ((size * directions) ** 2).sum(-1).float() * checks.adds[start:start + step]
            rounding.stream_noise.extend(noise.unbind(-1))
            previous = after[:, -1]


def products(group: Group, values: torch.Tensor) -> torch.Tensor:
    """One group's parts from its members' reads ``values`` ``[n, members, width]``: ``[n, members]`` (whole terms)
    or ``[n, members, parts]`` (each member's heads or neurons)."""
    parts = values * group.directions.to(values.device)
    if group.mode is None:
        return parts.sum(-1)
    if group.part_width != 1:
        return parts.unflatten(-1, (group.parts, group.part_width)).sum(-1)
    return parts


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


def lane(model, plan: Plan, by: Granularity, stop: Stop | None, per_layer: list, work) -> Lane | None:
    """The call's ``Lane``, or None where a term or the plan is not of the common case (module docstring);
    ``per_layer``: ``terms.term_directions``'s; ``work``: the call's ``recipe.Work``: its ``prepared`` record
    (``trace.prepared``) keeps the lane (its directions stacked) for a later call with the same targets and
    weights, and where it collects the model's own rounding (``work.rounding``, ``math.rounding.Rounding``) the
    lane holds its ``Checks``. A call that may not take the lane (``Reading.lane`` False) does not ask."""
    if by not in GRANULARITIES or plan.stream_dictionary is not None or plan.family.collapse is not None \
            or plan.family.layer_scale is not None:
        return None
    low = work.rounding is not None
    return work.prepared.get(("lane", stop, by, low), lambda: made(model, plan, by, stop, per_layer, low), keep=True)


def made(model, plan: Plan, by: Granularity, stop: Stop | None, per_layer: list, low: bool = False) -> Lane | None:
    """``lane``'s value, made: each term's mode checked, its direction on what it reads made (``write_direction``,
    then ``kinds.linear.static`` for a split term), the directions stacked by shape, and the plan's column order;
    with ``low``, the ``Checks``."""
    modes, shapes, columns = [], {}, []  # columns: (group key, member, its width in columns), in the plan's order
    writes: dict = {}  # a split term's direction on its write, by group key (low precision: its gap's)
    split: list = []  # (group key, member, (block, index)) of each split term, in forward order
    before = plan.terms_before(stop)
    for i, terms in enumerate(before):
        layer, block = model.layers[i], []
        for k, planned in enumerate(terms):
            plain, mode = plain_mode(planned, by)
            if not plain:
                return None
            u, _ = write_direction(layer, planned, per_layer[i][k][0])  # no bias: the rest is 0
            written = u
            if mode is not None:
                u = linear.static(layer, planned, mode, projected(layer, planned, u), 0.0)[0]
            parts, width = (planned.parts, planned.part_width) if mode is not None else (1, 0)
            key = (mode, parts, width, int(u.shape[-1]))
            shapes.setdefault(key, []).append(((i, k), u))
            columns.append((key, len(shapes[key]) - 1, parts))
            if low and mode is not None:
                writes.setdefault(key, []).append((written, roundings(planned)))
                split.append((key, len(shapes[key]) - 1, (i, k)))
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
                         torch.stack([u for _, u in shapes[key]], 1),
                         *((torch.stack([w for w, _ in writes[key]], 1),
                            filled([float(r) for _, r in writes[key]], device)) if key in writes else ()))
                   for key in keys)
    checks = checks_of(before, stop, per_layer, [(keys.index(key), j, name) for key, j, name in split], device) \
        if low else None
    if len(runs) == 1:  # the plan's order already (runs[0] starts at 0)
        return Lane(tuple(modes), groups, None, checks)
    # made on the device, run by run: no host list copied up while the forward pass runs
    order = torch.cat([torch.arange(first, first + count, device=device) for first, count in runs])
    return Lane(tuple(modes), groups, order, checks)


def checks_of(before: list, stop: Stop | None, per_layer: list, split: list, device) -> Checks:
    """The lane's ``Checks``: the blocks whose stream noise ``recipe.decompose`` takes (every block with a term,
    before ``stop``'s; ``before``: ``Plan.terms_before(stop)``), their terms' count and the direction there."""
    blocks = tuple(i for i in range(len(before)) if per_layer[i] and (stop is None or i < stop[0]))
    adds = filled([float(len(before[i])) for i in blocks], device)
    directions = torch.stack([per_layer[i][-1][0] for i in blocks], 1) if blocks else None
    return Checks(tuple(split), blocks, adds, directions)


def filled(values: list[float], device) -> torch.Tensor:
    """``[len(values)]`` float32 on ``device``, filled there run by run of equal values (a few small counts): no
    host data is copied up while the forward pass runs."""
    runs: list = []
    for value in values:
        if runs and runs[-1][0] == value:
            runs[-1][1] += 1
        else:
            runs.append([value, 1])
    if not runs:
        return torch.zeros(0, device=device)
    return torch.cat([torch.full((count,), value, device=device) for value, count in runs])
