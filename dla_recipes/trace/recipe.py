"""The in-trace DLA recipe: per-component contributions computed inside the trace, on any family.

``direct_logit_attribution(model, plan, positions, targets, contrasts, by)`` runs inside ``with model.trace(...)``
(locally, or server side on NDIF) and returns a ``Readout`` of a few small tensors; ``direction_attribution`` does
the same for a direction read by any block's norm. The math, for every family:

1. The logit is ``logit_scale * (lm_head.weight[t] @ norm(x) + lm_head.bias[t])`` at the attributed position, where
   ``x`` is the final norm's input. Freezing the norm (``FrozenNorm``) makes it ``gain * center(x) * s + bias``, so
   ``logit = s * (x @ d) + constant`` with the direction ``d = logit_scale * center(gain * W[t])`` (minus the same
   for a contrast token). ``d`` is known before the forward pass; the scale ``s`` only at its end.
2. ``x`` is the sum of the terms the blocks wrote (the embedding, then each block's terms, ``dla_recipes.families``), each
   carried by what later acts on the stream. Static maps (Doge's gates, ZAYA's residual scaling, Gemma-4's
   ``layer_scalar``) are pulled back into each term's direction before the forward pass reads it; input-dependent
   stream mixing (DeepSeek-V4's hyper-connections) is carried forward as per-stream weights and read along the
   final collapse at the end. A norm applied to the stream itself (MiniMax, RWKV, OpenAI GPT's post-norm blocks) is
   frozen at its real input: its static part (gain, centering) is pulled back before the forward pass, and its
   scale, read in the trace, multiplies everything written before it.
3. Each block's values are read in forward order (``terms.layer_reads``), then reduced to a few numbers
   (``terms.layer_scores``; in a call of at most ``DEFER_SITES`` sites every block's after the last block's reads,
   else each block's right after its own): a block term
   to one (its value at the position, dotted with its direction); a split term to one per head, neuron or expert:
   the direction is pulled back through the term's multiplier, outer and post norms (frozen at their real inputs)
   and output projection onto the projection's input, then multiplied by the heads' outputs or the neurons'
   activations; a fused mixture of experts is recomputed from the model's own routing and weights, only for the
   experts that fired. No ``[batch, pos, d_model]`` activation is kept, and no ``[batch, d_mlp, d_model]`` tensor
   is ever built. What depends only on the weights and the targets (the head, each term's direction, the pull-backs
   through ``W_O`` / ``W_down``) is made once a call, or taken from an earlier call's record (``trace.prepared``).
   In the common case (every term written straight into the stream, a small call; ``trace.plain``) each term is
   only read in the forward pass, and all are scored after it in one product per shape of term.
4. At the end the final norm's scale ``s`` is fitted at the real stream, every number is multiplied by it, and the
   model's own logit is read from ``lm_head``'s output (times ``logit_scale``), so the caller can check
   ``values.sum(-1) + constant == logit``.

A row of every number is a *site*, one attributed (prompt, position) pair (``readers.Sites``): one per prompt
(``rows`` omitted), or several per prompt, all read in the same forward pass; ``[batch]`` below counts sites. What
a site attributes is a ``targets.LinearTarget`` (a token, minus a contrast, a weighted set, minus the mean logit).

Everything runs under ``torch.no_grad()`` in float32, whatever the model's dtype. In a remote trace, call these
functions by name (``dla_recipes.trace.direct_logit_attribution``): the module object itself cannot travel.
``trace.calls`` holds one batch's arguments, so a trace reads ``call.run(model)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..args import Granularity, check_granularity
from ..errors import InputError
from ..math.adds import AddCheck
from ..math.frozen_norm import probe_norm
from ..math.linalg import dot, exact, on
from ..math.rounding import NormRead, Rounding, rounding_scales, stream_sumsq, unit_roundoff
from ..plan.build import module_at
from ..plan.plan import Plan
from . import plain
from . import targets as linear_targets
from .adds import activations_dtype, checked_blocks, final_read, low_precision
from .head import Head, final_direction, scaled_by, softcap
from .kinds import features
from .kinds.paths import Paths
from .kinds.sources import SourceSplit
from .kinds.sources import prepare as prepare_sources
from .prepared import Prepared
from .readers import Sites, at, layer_input, layer_output, read_site
from .reading import Reading, Where
from .readout import Readout
from .targets import as_target
from .terms import BlockCall, Found, layer_reads, layer_scores, term_directions

# Up to this many sites a block's arithmetic waits until the model's last block has run (its reads, [sites, width] a
# term, are kept until then) and runs in one stretch: between two blocks each op starts on caches the model's block
# has just refilled (measured, batch 1 on the CPU: 0.6-2% of the forward pass saved). The same ops in the same order,
# so the same numbers. Above it each block is scored right after its reads (its reads dropped): memory stays bounded.
DEFER_SITES = 64


def scaled(scores: list, scale: torch.Tensor) -> list:
    """Every score group ``[batch, ...]`` times a per-prompt ``scale`` ``[batch]`` (a frozen stream norm's)."""
    return [s * scale.to(s.device).reshape(-1, *([1] * (s.dim() - 1))) for s in scores]


@dataclass
class Work:
    """What one call's ``decompose`` collects and keeps, besides its scores: ``prepared`` (the memo of what depends
    only on the weights and the direction, ``trace.prepared``), ``rounding`` (low precision only: what the model's
    own rounding is bounded with, ``Rounding``), ``adds`` (``check="adds"``: the per-add check, ``AddCheck``),
    ``patterns`` (``by="source"``: each source-split block's ``(rebuild error, layer)``), ``room`` (the scores come
    back as the first columns of a ``[n, n_components + room]`` buffer whose last ``room`` columns
    ``Readout.pack`` fills) and ``fit_errors`` (the post-norms' fit errors, 0-d tensors read on the host once)."""

    prepared: Prepared = field(default_factory=Prepared)
    rounding: Rounding | None = None
    adds: AddCheck | None = None
    patterns: list = field(default_factory=list)
    room: int = 0
    fit_errors: list = field(default_factory=list)


def decompose(model, plan: Plan, direction: torch.Tensor, where: Where, reading: Reading,
              work: Work) -> tuple[torch.Tensor, list[float], Sites]:
    """``[n, n_components]``: every term written before ``where.stop`` at the sites, dotted with ``direction``
    ``[n, d_model]`` (a direction on the stream at ``stop``; None: the final norm's input), read in forward order.
    A site is ``(where.rows[s], where.positions[s])``: a prompt of the batch and an index into the padded sequence
    (``rows`` None: one site per prompt). ``reading.by="source"``: ``reading.sources`` says which heads split into
    how many sources; ``where.offsets`` ``[n]`` is where each site's prompt's own tokens start.

    Returns the unscaled scores (multiply by the frozen norm's scale at ``stop``), the post-norms' fit errors
    (``work.fit_errors``) and the ``Sites`` read (their ``batch`` read from the stream). ``work`` (``Work``)
    collects the rest: ``rounding`` (low precision only) what the model's own rounding is bounded with, unscaled:
    each split term's gap and noise and, after each whole block, the stream's noise around its adds;
    ``reading.edits``: the forward pass may be edited, so each split term's gap is a column of its own
    (``L3.mlp.edit``, before its rest): what it wrote beyond its parts and bias; ``patterns`` each source-split
    block's ``(rebuild error, layer)``; ``adds`` the per-add check (``math.adds``) of every block
    ``trace.adds.checked_blocks`` names: the stream entering and leaving it, each term's write as added, and the
    stream between two checked blocks.
    """
    by, stop, sources, edits = reading.by, where.stop, reading.sources, reading.edits
    positions, rows, offsets = where.positions, where.rows, where.offsets
    rounding, patterns, room, adds, prepared = work.rounding, work.patterns, work.room, work.adds, work.prepared
    plan = features.placed(plan, direction.device)  # the dictionaries on the device before the forward pass runs
    embed_direction, per_layer = prepared.get(("terms", stop), lambda: term_directions(model, plan, direction, stop))

    def memo(key, make):  # a term's direction on its write and its pull-back: kept within the record's budget
        return prepared.get(("term", stop, *key), make, keep=True)
    if by == "source":  # before the forward reaches any attention call the pattern is recomputed from
        prepare_sources(model, plan, sources)
    fit_errors = work.fit_errors  # each a 0-d tensor (or 0.0): read on the host once, with the result
    device = direction.device  # the sites' indices go to the device once, before the forward pass runs
    host_rows = torch.arange(positions.shape[0]) if rows is None else rows
    rows, positions = host_rows.to(device), positions.to(device)
    groups = Sites.grouped(host_rows, device) if by == "source" else ()  # each prompt's sites (per_prompt)
    offsets = None if offsets is None else offsets.to(device)
    stream = layer_input(model, 0)  # [batch, pos, d_model]: the batch's size is its first
    sites = Sites.on(rows, positions, int(stream.shape[0]), int(stream.shape[1]), groups)
    paths = None  # sources=dict(upstream=...): what every component wrote at the sources, collected as it is written
    if by == "source" and sources.upstream is not None:
        paths = Paths(offsets, sites.rows, sites.batch, sources.count, sources.upstream == "head")
        paths.collect(stream)
    embed = at(stream, sites)  # [n, d_model], or [n, streams, d_model]
    scores = [(embed * embed_direction.to(embed.device).unsqueeze(-2)).sum(-1) if embed.dim() == 3 else
              dot(embed, embed_direction).unsqueeze(-1)]
    carried = [None]  # parallel streams: each score group's weight on every stream [batch, streams]
    if embed.dim() == 3:
        carried = [torch.eye(embed.shape[1], device=embed.device).expand(embed.shape[0], -1, -1)]
    previous = embed  # the stream before the block (its rounding bound, ``rounding``)
    checked = checked_blocks(plan, stop) if adds is not None else frozenset()
    split_stream = plan.stream_dictionary is not None and stop is None
    first = plan.stream_dictionary[0] if split_stream else 0
    pending: list = []  # blocks read but not scored yet: scored after the forward pass while the call is small

    def score_pending():  # the arithmetic of every pending block, in forward order
        nonlocal scores, carried
        for i, terms, block, call in pending:
            for score, hyper, before, after in layer_scores(model.layers[i], terms, per_layer[i], block, call, memo):
                if before is not None:  # a norm on the stream scales everything written before it
                    scores = scaled(scores, before)
                if hyper is not None:  # streams <- comb^T streams, then the term is written with weights post
                    post, comb = hyper
                    if comb is not None:
                        with exact():
                            carried = [torch.einsum("bjk,b...j->b...k", comb, weights) for weights in carried]
                    carried.append(post)
                scores.append(on(score, scores[0].device))
                if after is not None:  # a norm right after the add scales it too; its bias joins the term's rest
                    scores = scaled(scores, after[0])
                    scores[-1][:, -1] += torch.as_tensor(after[1]).to(scores[-1].device)
        pending.clear()

    defer = by != "source" and len(sites) <= DEFER_SITES
    # the common case (every term written straight into the stream, a small call, no edit, no per-add check): each
    # term read here, all scored after the forward pass in a few products (trace.plain)
    lane = plain.lane(model, plan, by, stop, per_layer, work) if (
        defer and not edits and adds is None and reading.lane) else None
    lane_reads: dict = {}
    for i, terms in enumerate(plan.terms_before(stop)):
        if i < first:  # inside the stream a residual dictionary splits: its parts stand for these blocks'
            continue
        if lane is not None:
            lane.read(model.layers[i], i, terms, sites, lane_reads)
            continue
        if split_stream and i == first:
            stream_parts, previous = features.stream_scores(model, plan, sites, per_layer[i][0][0])
            scores, carried = [stream_parts], [None]
        split = SourceSplit(sources, i, offsets, paths) if by == "source" else None
        entering, writes = None, None  # the per-add check: the stream entering block i, its terms' writes
        if i in checked:
            entering, writes = at(stream if i == 0 else layer_input(model, i), sites, keep=True), []
            if adds.last is not None and adds.last[0] == i - 1:
                adds.between(i - 1, adds.last[1], entering)
        call = BlockCall(by, i, split, rounding, edits)
        block = layer_reads(model.layers[i], terms, sites, call, Found(fit_errors, patterns, writes))
        pending.append((i, terms, block, call))
        if not defer:
            score_pending()
        if i in checked or (rounding is not None and per_layer[i] and (stop is None or i < stop[0])):
            stream_after = at(read_site(model.layers[i], "output"), sites, keep=True)
            if i in checked:
                adds.block(i, entering, writes, stream_after)
            if rounding is not None and per_layer[i] and (stop is None or i < stop[0]):
                rounding.stream_noise.append(len(terms) * stream_sumsq(previous, stream_after, per_layer[i][-1][0]))
                previous = stream_after
    score_pending()
    if lane is not None:
        scores.append(lane.score(lane_reads, rounding, embed))
    if carried[0] is not None:  # the final collapse: each group's stream weights read along the collapse weights
        head = module_at(model, plan.family.collapse)
        read = at(head.input, sites)
        with exact():
            collapse = plan.family.collapse_weights(head, read)  # [n, streams]
            weights = [torch.einsum("b...k,bk->b...", w, collapse) for w in carried]
        scores = [(scores[0] * weights[0]).sum(-1, keepdim=True)] + [s * w[:, None] for s, w in zip(scores[1:], weights[1:])]
    fit_errors.extend([] if paths is None else paths.errors)
    return joined(scores, room), fit_errors, sites


def largest(errors: list, device) -> torch.Tensor:
    """``[]`` on ``device``: the largest of ``errors`` (floats or 0-d tensors; 0 when empty), not read on the host."""
    if not errors:
        return torch.zeros((), device=device)
    if all(isinstance(e, torch.Tensor) and e.dim() == 0 and e.dtype == torch.float32 for e in errors):
        if len(errors) == 1:  # the largest of one (a NaN stays NaN): no op
            return on(errors[0], device)
        return torch.stack([on(e, device) for e in errors]).max()  # each a float32 0-d tensor: stacked as it is
    return torch.stack([e.to(device).float().reshape(()) if isinstance(e, torch.Tensor)
                        else torch.full((), float(e), device=device) for e in errors]).max()


def worst_pattern(patterns: list, device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(error, layer)`` ``[]`` on ``device``: the block whose heads rebuilt from pattern and values are worst
    (``patterns``: ``(error, layer)`` pairs, by="source"), or the floats ``(0.0, -1.0)`` (``Readout.gathered``
    writes a float with the row of numbers known on the host)."""
    if not patterns:
        return 0.0, -1.0
    errors = torch.stack([largest([e], device) for e, _ in patterns])
    layers = torch.tensor([float(layer) for _, layer in patterns]).to(device)
    worst = errors.argmax()
    return errors[worst], layers[worst]


def joined(scores: list, room: int = 0) -> torch.Tensor:
    """``[n, width + room]``: the score groups ``[n, w_k]`` side by side (``torch.cat``), then ``room`` unset columns."""
    if not room:
        return torch.cat(scores, -1)
    width = sum(int(s.shape[-1]) for s in scores)
    out = torch.empty(scores[0].shape[0], width + room, dtype=scores[0].dtype, device=scores[0].device)
    torch.cat(scores, -1, out=out[:, :width])
    return out


def direct_logit_attribution(
    model,
    plan: Plan,
    positions: torch.Tensor,
    targets,
    contrasts: torch.Tensor | None = None,
    by: Granularity = "block",
    *,
    reading: Reading | None = None,
    rows: torch.Tensor | None = None,
    offsets: torch.Tensor | None = None,
    prepared: Prepared | None = None,
) -> Readout:
    """Attribute a logit (difference) inside a trace; see the module docstring.

    Args:
        model: the ``StandardizedTransformer`` being traced.
        plan: ``build_plan(model)``.
        positions: ``[n]`` long, each site's attributed position, an index into the padded sequence.
        targets, contrasts: ``[n]`` long token ids (``contrasts`` optional: attribute the logit difference), or
            ``targets`` a ``LinearTarget`` (any linear function of each site's logits; ``contrasts`` None).
        by: ``"block"``, ``"head"``, ``"neuron"``, ``"expert"`` or ``"source"``.
        reading: the rest of what the trace reads (``trace.reading.Reading``: ``by="source"``'s split heads, whether
            the forward pass may be edited (``intervene=``, ``trace_attribution``: each split term has an ``.edit``
            column), the per-add check's reads (``check="adds"``), the lane); None: ``Reading(by)``. Its ``by`` is
            ``by``.
        rows: ``[n]`` long, each site's prompt (its row of the batch); None: one site per prompt, ``n = batch``.
        offsets: ``by="source"``: ``[n]`` long, where each site's prompt's own tokens start in the padded sequence.
        prepared: what depends only on the weights and these targets, made by an earlier call with the same
            targets and weights (``trace.prepared``, local calls: ``transport.reuse``); None: made in this call.
    """
    reading = Reading(by) if reading is None else reading
    if reading.by != by:
        raise InputError(f"direct_logit_attribution: by={by!r} but reading.by={reading.by!r}: give one")
    check = reading.check
    check_granularity(by)
    with torch.no_grad():
        target = as_target(targets, contrasts)
        prepared = (prepared if prepared is not None else Prepared()).begin()
        final_head: Head = prepared.get("final", lambda: final_direction(model, plan, target))
        probe, direction, constant, target = final_head.probe, final_head.direction, final_head.constant, final_head.target
        # the rounding the self-check bounds is read only for a low-precision model (in float32 and float64 it is
        # far below the float32 floor of the check, and the reads cost time on small models)
        adds = AddCheck() if check == "adds" else None
        weight = model.lm_head.weight  # read once: the precision the call bounds (low_precision, activations_dtype)
        rounding = Rounding() if low_precision(weight) else None
        patterns: list = []
        room = len(Readout.FIELDS)  # the scores are written into the buffer pack() sends
        work = Work(prepared, rounding, adds, patterns, room)
        buffer, fit_errors, sites = decompose(model, plan, direction, Where(positions, rows, offsets), reading, work)
        scores = buffer[:, :buffer.shape[1] - room]
        rows, positions = sites.rows, sites.positions  # on the device
        if plan.family.final_norm != "module":  # no final norm, or it also ran before the blocks: read around it
            stream, normed = layer_output(model, len(model.layers) - 1), model.lm_head.input  # normed: [b, kept, d]
        else:
            stream, normed = model.ln_final.input, model.ln_final.output  # [batch, pos, d_model]
        batch = int(stream.shape[0])
        x = at(stream, sites)
        y = at(normed, sites if normed.shape[1] == stream.shape[1] else
               Sites(rows, positions - (stream.shape[1] - normed.shape[1]), batch))
        scale, fit_error = probe.to(x.device).fit(x, y)  # the final norm's scale, frozen at the real stream
        fit_errors.append(fit_error)
        final_read(adds, plan, x)  # the per-add check: the last block's output is what the final norm reads
        head_out, logits = model.lm_head.output, model.output.logits  # [batch, kept, vocab]: logits_to_keep
        kept = positions - (stream.shape[1] - head_out.shape[1])
        head = linear_targets.pick(head_out, rows, kept, target)  # [n, K] at the target's tokens
        # the model's output logits are lm_head's output itself (the same tensor) and the family's head is the
        # identity (no logit scale, no soft-cap): the logit and the output logit are one number, the head's error 0
        shared = logits is head_out and plan.logit_scale == 1 and plan.softcap is None
        own = head if shared else on(linear_targets.pick(logits, rows, kept, target), head.device)
        means = (None,) * 3
        if target.uses_mean:
            mean = linear_targets.vocab_mean(head_out, rows, kept)
            means = (mean, mean if shared else linear_targets.vocab_mean(logits, rows, kept),
                     linear_targets.vocab_mean(head_out, rows, kept, absolute=True))
        out = linear_targets.read_logits(target, own, means[1])
        head_error = 0.0 if shared else linear_targets.head_error(
            target, head, own, lambda z: softcap(scaled_by(z, plan.logit_scale), plan.softcap))
        logit = out if shared else scaled_by(linear_targets.read_logits(target, head, means[0]), plan.logit_scale)
        size = scaled_by(linear_targets.logit_size(target, head, means[2]), abs(plan.logit_scale))
        computed = activations_dtype(weight, head_out.dtype, *(() if adds is None else (adds.dtype,)))
        read = NormRead(x, direction, scale, y, final_head.logit_rows, final_head.finite)
        checks = rounding_scales(read, rounding, size, scores, computed_in=computed)  # reads the scores unscaled
        scores.mul_(on(scale, scores.device).unsqueeze(-1))  # in place: no second [n, components]
        pattern_error, pattern_layer = worst_pattern(patterns, buffer.device)
        return Readout.gathered(buffer, constant=constant, logit=logit, output_logit=out, head_error=head_error,
                                norm_fit_error=largest(fit_errors, buffer.device), scale=scale,
                                pattern_error=pattern_error, pattern_layer=pattern_layer,
                                weight_roundoff=unit_roundoff(weight.dtype), **checks,
                                **({} if adds is None else adds.fields()))


def direction_attribution(
    model,
    plan: Plan,
    where: Where,
    direction: torch.Tensor,
    reads: str,
    reading: Reading | None = None,
) -> Readout:
    """Attribute ``norm(stream) @ direction`` inside a trace, where ``norm`` (the module at ``reads`` in block
    ``where.stop[0]``) reads the stream at ``where.stop``: the terms written before it, through the norm frozen at
    its input.

    Args:
        where: the sites (``positions`` and ``rows``, as in ``direct_logit_attribution``) and ``stop``:
            ``plan.stop_before(layer, sublayer)``.
        direction: ``[n, d_model]`` (or ``[d_model]``), a direction on the norm's output (a probe, a query), one
            per site.
        reads: the sublayer's ``Term.reads``.
        reading: as in ``direct_logit_attribution`` (None: ``Reading()``, by block).
    """
    reading = Reading() if reading is None else reading
    by, check, stop, positions, rows = reading.by, reading.check, where.stop, where.positions, where.rows
    check_granularity(by)
    with torch.no_grad():
        rows = torch.arange(positions.shape[0]) if rows is None else rows
        norm = module_at(model.layers[stop[0]], reads)
        weight = model.lm_head.weight  # read once (low_precision, activations_dtype, weight_roundoff)
        probe = probe_norm(norm, direction.shape[-1]).to(weight.device)
        v = direction.float().to(probe.gain.device).expand(positions.shape[0], -1)
        # the rounding the self-check bounds is read only for a low-precision model (in float32 and float64 it is
        # far below the float32 floor of the check, and the reads cost time on small models)
        adds = AddCheck()  # passed to decompose only with check="adds" (else it stays empty)
        rounding = Rounding() if low_precision(weight) else None
        pulled = probe.center(probe.gain * v)
        room = len(Readout.FIELDS)  # the scores are written into the buffer pack() sends
        work = Work(rounding=rounding, adds=adds if check == "adds" else None, room=room)
        buffer, fit_errors, sites = decompose(model, plan, pulled, Where(positions, rows, where.offsets, stop), reading,
                                              work)
        scores = buffer[:, :buffer.shape[1] - room]
        stream = at(read_site(norm, "input", sites.batch), sites)
        output = at(read_site(norm, "output", sites.batch), sites)
        frozen = probe.freeze(stream, output)
        fit_errors.append(frozen.fit_error)
        own = dot(output, v)  # the model's own normed stream, read along the direction
        extra = len(plan.terms_before(stop)[stop[0]]) if len(plan.terms_before(stop)) > stop[0] else 0
        checks = rounding_scales(NormRead(stream, pulled, frozen.scale, output, v), rounding, 0.0, scores, extra,
                                 computed_in=activations_dtype(weight, output.dtype, adds.dtype))
        scores.mul_(frozen.scale.to(scores.device).unsqueeze(-1))  # in place
        return Readout.gathered(buffer, constant=dot(v, probe.bias), logit=own, output_logit=own,
                                norm_fit_error=largest(fit_errors, buffer.device), scale=frozen.scale,
                                weight_roundoff=unit_roundoff(weight.dtype), **checks, **adds.fields())
