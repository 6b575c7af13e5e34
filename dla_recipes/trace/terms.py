"""One term of one block, inside the trace: its direction, its reads and its score, dispatched on its kind.

``term_directions`` pulls the direction on the stream back to every term written before a point of the stream
(through what later acts on the stream: static scales, stream norms, a per-block scale); ``read_term`` reads, in
forward order, what scoring a term needs at the attributed positions; ``score_term`` reduces those reads to the
term's parts and rest; ``layer_scores`` does both for one block (all its reads first, then the arithmetic). How a
split term's parts are read and scored is its kind's (``PlannedTerm.kind``, fixed by the plan): one module of
``trace.kinds`` per kind, chosen from ``KINDS``; this module never asks which family it runs on.

A split term's parts come from its projection's input, so whatever reaches the stream after that projection is not
in them: an edit of the sublayer's output (steering ``mlp.output``, patching ``self_attn.output``) and, in low
precision, the rounding of what the projection wrote. So a split term also reads what it really wrote, where it is
added (``TermReads.written``), and its gap (that write along the direction, minus its parts and rest) is either a
column of its own (``edits``: the call may carry an edit; labelled ``L3.mlp.edit``) or the rounding the self-check
holds the term to (``checks_split``: heads and neurons through one projection, in low precision).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import NamedTuple

import torch

from ..args import Granularity
from ..math.frozen_norm import FrozenNorm, probe_norm
from ..math.linalg import dot, on
from ..math.rounding import Rounding
from ..plan.build import module_at
from ..plan.plan import Plan, PlannedTerm, Stop
from .adds import written_at
from .kinds import TermAt, conv, experts, features, linear, routed, sources
from .readers import Sites, at, frozen_at, param, read_site

KINDS: dict[str, ModuleType] = {"linear": linear, "conv": conv, "routed": routed, "experts": experts}
# the modes whose kind is the mode's, whatever the term's own: a heads term split by source position
# (``plan.PlannedTerm.mode``: by="source"), a term carrying a dictionary split by its latents
MODE_KINDS: dict[str, ModuleType] = {"sources": sources, "features": features}


def kind_module(planned: PlannedTerm, mode: str) -> ModuleType:
    """The ``trace.kinds`` module reading and scoring ``planned``'s parts at ``mode`` (``MODE_KINDS``, else the
    term's own kind)."""
    return MODE_KINDS.get(mode) or KINDS[planned.kind]


def on_write(kind: ModuleType | None) -> bool:
    """Whether a kind is scored along the direction on the term's write itself, read whole (``kinds.features``),
    rather than through the term's projection; None (the term whole) is."""
    return kind is None or getattr(kind, "ON_WRITE", False)


@dataclass
class TermReads:
    """What scoring one term needs, read in forward order at the attributed positions.

    Attributes:
        value: ``[batch, d_model]`` the term's write, read whole (the term is not split at this granularity), in
            the model's dtype (its products with float32 directions read it in float32).
        written: ``[batch, d_model]`` a split term's write, read whole beside its parts (its gap: an edit, rounding),
            in the model's dtype.
        parts: the term's kind's reads record (``LinearReads``, ``SourceReads``, ...) when it is split.
        hyper: ``(post [batch, streams], comb [batch, streams, streams] or None)`` on parallel-stream families.
        post_norm, stream_norm, stream_norm_after: the norms frozen at their real inputs (``Term.write.post_norm``,
            ``Term.stream.norm``, ``Term.stream.norm_after``).
        post_norm_io: ``(input, output)`` ``[batch, pos, d_model]`` the post-norm's real input and output at every
            position, as read (not copies: ``upstream="head"`` freezes the post-norm at the sources from them right
            after this term is read, before the forward pass moves on; ``trace.kinds.paths``).
    """

    value: torch.Tensor | None = None
    written: torch.Tensor | None = None
    parts: object = None
    hyper: tuple | None = None
    post_norm: FrozenNorm | None = None
    stream_norm: FrozenNorm | None = None
    stream_norm_after: FrozenNorm | None = None
    post_norm_io: tuple | None = None

    def norms(self) -> list[FrozenNorm]:
        """The frozen norms read with the term (their fit errors join the diagnostics)."""
        return [n for n in (self.post_norm, self.stream_norm, self.stream_norm_after) if n is not None]


def term_directions(model, plan: Plan, direction: torch.Tensor, stop: Stop | None = None):
    """Pull ``direction`` ``[batch, d_model]`` on the stream at ``stop`` (None: the final norm's input) back to
    every term written before it.

    Returns ``(embed_direction, per_layer)`` where ``per_layer[i][k]`` is ``(direction, constant, after)`` for term
    ``k`` of block ``i``: the term's write dotted with ``direction`` is its share of ``x @ direction``, ``constant``
    ``[batch]`` is what a stream bias or a stream norm's bias added with it (ZAYA, MiniMax) contributes, and
    ``after`` what the bias of a norm right after it contributes (not scaled by that norm).
    """
    v = direction
    blocks = plan.terms_before(stop)
    per_layer: list[list[tuple[torch.Tensor, torch.Tensor | float]]] = [[] for _ in blocks]
    for i in reversed(range(len(blocks))):
        layer = model.layers[i]
        whole = len(blocks[i]) == len(plan.layers[i]) and (stop is None or i < stop[0])
        if plan.family.layer_scale is not None and whole:
            v = v * param(layer, plan.family.layer_scale).to(v.device)
        entries = []
        for planned in reversed(blocks[i]):
            term = planned.term
            constant: torch.Tensor | float = 0.0
            after: torch.Tensor | float = 0.0  # a norm right after the add: its bias, then its static part
            if term.stream.norm_after is not None:
                probe = probe_norm(module_at(layer, term.stream.norm_after), v.shape[-1]).to(v.device)
                after = dot(v, probe.bias.to(v.device))
                v = probe.center(probe.gain.to(v.device) * v)
            if term.stream.scale is not None:
                v_before = v * param(layer, term.stream.scale).to(v.device)
            else:
                v_before = v
            if planned.stream_multiplier != 1.0:
                v_before = v_before * planned.stream_multiplier
            if term.stream.bias is not None:
                constant = dot(v_before, param(layer, term.stream.bias))
            if term.stream.norm is not None:  # its static part; its scale is read in the trace (decompose)
                probe = probe_norm(module_at(layer, term.stream.norm), v.shape[-1]).to(v.device)
                constant = constant + dot(v_before, probe.bias.to(v_before.device))
                v_before = probe.center(probe.gain.to(v_before.device) * v_before)
            entries.append((v, constant, after))
            v = v_before
        per_layer[i] = entries[::-1]
    return v, per_layer


def write_direction(layer, planned: PlannedTerm, v: torch.Tensor):
    """Pull ``v`` back through the term's multiplier and affine merge: ``(direction on read(output), constant)``."""
    write = planned.term.write
    u = v * planned.multiplier if planned.multiplier != 1.0 else v
    if write.scale is not None:
        u = u * param(layer, write.scale).to(u.device)
    constant = dot(u, param(layer, write.bias)) if write.bias is not None else 0.0
    return u, constant


def checks_split(planned: PlannedTerm, mode: str | None) -> bool:
    """Whether the self-check holds this split term's gap to its own rounding in low precision: heads or neurons
    through one projection, whose parts are the model's own inputs times a float32 pull-back (a recomputed kind's
    parts carry rounding of their own, held by the sum check only)."""
    return planned.kind == "linear" and mode in ("heads", "neurons")


def roundings(planned: PlannedTerm) -> int:
    """How many low-precision roundings a split term's write goes through after its projection's sum (the
    projection's output, a ``then`` map, an output gate, a post-norm's two, a multiplier, a bias)."""
    term, split = planned.term, planned.term.split
    return (1 + (getattr(split, "then", None) is not None) + (getattr(split, "output_gate", None) is not None)
            + 2 * (term.write.post_norm is not None) + (term.write.bias is not None)
            + (planned.multiplier != 1.0 or term.write.scale is not None))


def read_term(term_at: TermAt, sites: Sites, own: bool = True, edits: bool = False, whole: bool = False) -> TermReads:
    """Read, in forward order, what scoring this term (``term_at``: its block, ``PlannedTerm`` and mode) needs at the
    attributed sites (a few ``[n, ...]``).

    ``term_at.mode``: ``planned.mode(by)`` (None: the term whole); ``own``: low precision (a checked split term reads its
    write whole too, for the self-check); ``edits``: every split term reads its write whole (its ``.edit`` column);
    ``whole``: every split term reads its write whole (the per-add check, ``math.adds``)."""
    layer, planned, mode = term_at
    term, batch = planned.term, sites.batch
    reads = TermReads()
    if term.stream.norm is not None:  # the norm on the stream runs before this term's sublayer
        reads.stream_norm = frozen_at(module_at(layer, term.stream.norm), sites)
    if term.hyper is not None:  # parallel streams: the mixing weights this term is written and carried with
        post, comb = module_at(layer, term.hyper).output[:2]  # comb: [b, s, n, n]; HY-V4 has none (its 2nd is [b, s, d])
        comb = at(comb, sites) if comb.dim() == post.dim() + 1 else None  # None: the streams are not mixed
        reads.hyper = (at(post, sites), comb)
    kind = None if mode is None else kind_module(planned, mode)
    if kind is None:
        reads.value = at(read_site(layer, term.output, batch), sites, keep=True)  # read in float32 by its product
    elif on_write(kind):  # its reads in forward order (a transcoder's input, then the write whole)
        reads.parts = kind.read(layer, planned, mode, sites)
        reads.value = reads.parts.value
    else:
        reads.parts = kind.read(layer, planned, mode, sites)
        if term.write.post_norm is not None:  # frozen at the sites; its whole input and output kept for the sources
            norm = module_at(layer, term.write.post_norm)
            reads.post_norm_io = (read_site(norm, "input", batch), read_site(norm, "output", batch))
            reads.post_norm = frozen_at(norm, sites, reads.post_norm_io)
        if edits or whole or (own and checks_split(planned, mode)):  # what it really wrote: an edit, its rounding
            reads.written = at(read_site(layer, term.output, batch), sites, keep=True)
    if term.stream.norm_after is not None:  # ... and a norm right after the add, after it
        reads.stream_norm_after = frozen_at(module_at(layer, term.stream.norm_after), sites)
    return reads


class Outer(NamedTuple):
    """A shared outer norm a term's write goes through (``Term.write.outer_norm``), frozen at its real input, and
    whether this term adds its bias (the first term scored through it does)."""

    norm: FrozenNorm
    biased: bool


class Scoring(NamedTuple):
    """How a block's split terms are scored: ``split`` (``by="source"``: the block's ``SourceSplit``) and ``edits``
    (each split term's gap is a column of its own, before its rest)."""

    split: sources.SourceSplit | None = None
    edits: bool = False


def score_term(term_at: TermAt, reads: TermReads, v: torch.Tensor, outer: Outer | None, how: Scoring,
               memo=None):
    """``(scores [batch, parts + 1], rounding)``: the term's parts (heads, neurons, experts, head sources; none at
    block level), then its rest, along ``v`` on the stream (with ``how.edits``, ``[batch, parts + 2]``: the parts,
    the term's gap, its rest); ``rounding`` is a checked split term's ``(gap, squared noise)`` ``[batch]`` in low
    precision, else None. ``term_at``: the term (its block, ``PlannedTerm`` and mode); ``outer``: the shared outer norm
    its write goes through (None: none); ``how.split``: for ``mode="sources"``, the block's ``SourceSplit``.

    ``memo(name, make)``: the call's ``Prepared`` for this term (``trace.prepared``): what depends only on the
    weights and ``v`` (the direction on the write; the kind's ``static`` pull-back where nothing input-dependent,
    an outer norm or a post-norm, stands between the projection and the stream) is made once and kept."""
    layer, planned, mode = term_at
    split, edits = how
    memo = memo or (lambda name, make: make())
    u, rest = memo("write", lambda: write_direction(layer, planned, v))
    if outer is not None:
        if outer.biased:
            rest = rest + dot(u, outer.norm.bias)
        u = outer.norm.transpose(u)
    if mode is None:  # [batch, 1]; a rest of 0.0 (no bias) is not added
        score = dot(reads.value, u, keepdim=True)
        if not isinstance(rest, torch.Tensor):
            return (score if rest == 0.0 else score + rest), None
        return score + on(rest, score.device).reshape(-1, 1), None
    kind = kind_module(planned, mode)
    if on_write(kind):  # its parts along u on the write itself (a dictionary's latents, bias, skip, error), then
        parts, rest, _ = kind.score(term_at, reads.parts, u, rest, split)  # the rest (the write's own bias)
        return finished(parts, rest, None, None, edits)
    held = reads.written is not None and (edits or checks_split(planned, mode))  # its gap is a column, or held
    written = dot(reads.written, u) + rest if held else None  # [batch] what it really wrote
    noise = roundings(planned) * ((reads.written * u.to(reads.written.device)) ** 2).sum(-1) if held else None
    static = getattr(kind, "static", None)  # the kind's pull-back, made once where it depends on u alone
    if static is not None and outer is None and reads.post_norm is None:
        pulled = memo(mode, lambda: static(layer, planned, mode, projected(layer, planned, u), rest))
        if pulled is not None:
            parts, rest, _ = kind.score(term_at, reads.parts, u, rest, split, pulled)
            return finished(parts, rest, written, noise, edits)
    if reads.post_norm is not None:
        rest = rest + dot(u, reads.post_norm.bias)
        u = reads.post_norm.transpose(u)
    parts, rest, _ = kind.score(term_at, reads.parts, projected(layer, planned, u), rest, split)
    return finished(parts, rest, written, noise, edits)


def projected(layer, planned: PlannedTerm, u: torch.Tensor) -> torch.Tensor:
    """``u`` on the projection's output: times the split's projection multiplier and scale (``Heads`` /
    ``Neurons``), where it has them."""
    if planned.projection_multiplier != 1.0:
        u = u * planned.projection_multiplier
    projection_scale = getattr(planned.term.split, "projection_scale", None)  # Heads / Neurons only
    if projection_scale is not None:
        u = u * param(layer, projection_scale).to(u.device)
    return u


def finished(parts: torch.Tensor, rest, written, noise, edits: bool):
    """``score_term``'s result from a split term's ``parts`` ``[batch, parts]`` and ``rest``: the parts, then (with
    ``edits``) the gap between what the term ``written`` and its parts, then the rest; the gap and ``noise`` as
    the rounding the self-check holds it to, when ``written`` was read for it (else None)."""
    if written is None and not isinstance(rest, torch.Tensor):  # a float rest: one op, the parts padded with it
        return torch.nn.functional.pad(parts, (0, 1), value=float(rest)), None
    rest = (rest.to(device=parts.device, dtype=parts.dtype) if isinstance(rest, torch.Tensor)
            else parts.new_full((), float(rest))).expand(parts.shape[0])  # a float: filled there, not copied
    if written is None:
        return torch.cat([parts, rest.unsqueeze(-1)], -1), None
    gap = written.to(parts.device) - parts.sum(-1) - rest  # [batch]: an edit after the projection, or rounding
    if edits:
        return torch.cat([parts, gap.unsqueeze(-1), rest.unsqueeze(-1)], -1), None
    return torch.cat([parts, rest.unsqueeze(-1)], -1), (gap, noise.to(parts.device))


class BlockCall(NamedTuple):
    """How one block is read and scored: ``by``, its ``index``, its ``SourceSplit`` (``by="source"``), the
    ``Rounding`` collector (low precision only: a checked split term reads its write whole too) and ``edits``
    (each split term reads its write whole: its ``.edit`` column)."""

    by: Granularity
    index: int = 0
    split: sources.SourceSplit | None = None
    rounding: Rounding | None = None
    edits: bool = False


class Found(NamedTuple):
    """What reading the blocks collects: ``fit_errors`` (every frozen norm's), ``patterns`` (``(rebuild error,
    index)`` of the heads split by source, or None) and ``writes`` (each term's write as added,
    ``adds.written_at``: the per-add check; None: not read)."""

    fit_errors: list
    patterns: list | None = None
    writes: list | None = None


def layer_reads(layer, terms: tuple[PlannedTerm, ...], sites: Sites, call: BlockCall, found: Found) -> BlockReads:
    """What scoring one block's terms needs, read in forward order (``layer_scores`` does the arithmetic, then or
    later): ``call`` says how (``BlockCall``), ``found`` collects the norms' fit errors, the source split's
    rebuild errors and the writes as added (``Found``). A shared ``outer_norm`` is read right after the last term
    that names it (its place in the forward pass)."""
    by, split, rounding, edits, index = call.by, call.split, call.rounding, call.edits, call.index
    fit_errors, patterns, writes = found
    modes = [planned.mode(by) for planned in terms]
    modes = ["heads" if m == "sources" and (split is None or not any(split.heads(p.parts))) else m
             for m, p in zip(modes, terms)]  # a block none of whose heads is split reads them whole
    last_user = {planned.term.write.outer_norm: k for k, planned in enumerate(terms) if planned.term.write.outer_norm}
    reads, outers = [], {}
    paths = None if split is None else split.paths  # sources=dict(upstream=...): every write at the sources
    for k, planned in enumerate(terms):
        if paths is not None:
            paths.before(layer, planned, modes[k], index)
        reads.append(read_term(TermAt(layer, planned, modes[k]), sites, own=rounding is not None, edits=edits,
                               whole=writes is not None))
        if writes is not None:
            write = reads[-1].value if reads[-1].value is not None else reads[-1].written  # as the term added it
            writes.append(written_at(layer, planned, write))
        if paths is not None:
            paths.after(layer, planned, modes[k], reads[-1])
        reads[-1].post_norm_io = None  # the post-norm's whole input and output: not kept past its term
        for path, last in last_user.items():
            if last == k:
                outers[path] = frozen_at(module_at(layer, path), sites)
                fit_errors.append(outers[path].fit_error)
    fit_errors.extend(norm.fit_error for r in reads for norm in r.norms())
    if patterns is not None:  # the heads rebuilt from pattern and values: checked on their own (by="source")
        patterns.extend((r.parts.pattern_error, index) for r in reads if isinstance(r.parts, sources.SourceReads))
    return BlockReads(modes, reads, outers)


class BlockReads(NamedTuple):
    """One block's reads (``layer_reads``): each term's mode and ``TermReads``, and its shared outer norms frozen."""

    modes: list
    reads: list
    outers: dict


def layer_scores(layer, terms: tuple[PlannedTerm, ...], directions, block: BlockReads, call: BlockCall, memo=None):
    """``(scores [batch, n], hyper, before, after)`` of each of one block's terms, from its reads (``block``).
    ``hyper`` is the term's ``(post, comb)`` on a family with parallel streams, else None; ``before`` ``[batch]``
    the frozen scale of a norm applied to the stream before the term, ``after`` ``(scale [batch], bias constant
    [batch])`` of a norm right after it (else None). ``rounding`` (low precision only) collects each checked split
    term's gap and squared noise (``Readout.split_gap``); ``edits``: each split term's gap is a column of its own,
    before its rest (``score_term``); ``index``: the block's index (names a checked term); ``call``: those, and
    the block's source split (``BlockCall``); ``memo(key, make)``: the call's ``Prepared`` (``trace.prepared``),
    keyed by ``(index, k, name)`` for term ``k``.
    """
    split, rounding, edits, index = call.split, call.rounding, call.edits, call.index
    modes, reads, outers = block
    scores, biased, how = [], set(), Scoring(split, edits)
    for k, planned in enumerate(terms):
        path = planned.term.write.outer_norm
        v, stream_constant, after_constant = directions[k]
        outer = None if outers.get(path) is None else Outer(outers[path], path is not None and path not in biased)
        score, gap = score_term(TermAt(layer, planned, modes[k]), reads[k], v, outer, how,
                                None if memo is None else (lambda name, make, k=k: memo((index, k, name), make)))
        biased.add(path)
        if not isinstance(stream_constant, float):  # a stream bias added with this term (ZAYA)
            score[:, -1] += stream_constant.to(score.device)
        if modes[k] in planned.bare:  # nothing but its parts writes into its rest: no column (Plan.components)
            score = score[:, :-1]
        before, after = reads[k].stream_norm, reads[k].stream_norm_after
        scores.append((score, reads[k].hyper, before.scale if before is not None else None,
                       (after.scale, after_constant) if after is not None else None))
        if rounding is not None and gap is not None:
            rounding.split_gaps.append(gap[0])
            rounding.split_noise.append(gap[1])
            rounding.split_terms.append((index, k))
    return scores
