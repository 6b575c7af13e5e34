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
3. Each block's values are read in forward order, then reduced to a few numbers (``terms.layer_scores``): a block term
   to one (its value at the position, dotted with its direction); a split term to one per head, neuron or expert:
   the direction is pulled back through the term's multiplier, outer and post norms (frozen at their real inputs)
   and output projection onto the projection's input, then multiplied by the heads' outputs or the neurons'
   activations; a fused mixture of experts is recomputed from the model's own routing and weights, only for the
   experts that fired. No ``[batch, pos, d_model]`` activation is kept, and no ``[batch, d_mlp, d_model]`` tensor
   is ever built.
4. At the end the final norm's scale ``s`` is fitted at the real stream, every number is multiplied by it, and the
   model's own logit is read from ``lm_head``'s output (times ``logit_scale``), so the caller can check
   ``values.sum(-1) + constant == logit``.

Everything runs under ``torch.no_grad()`` in float32, whatever the model's dtype. In a remote trace, call these
functions by name (``dla_recipes.trace.direct_logit_attribution``): the module object itself cannot travel.
``LogitCall`` / ``DirectionCall`` hold one batch's arguments, so a trace reads ``call.run(model)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..args import Granularity, check_granularity
from ..math.frozen_norm import FrozenNorm, NormProbe, identity_probe, probe_norm
from ..math.linalg import dot
from ..math.rounding import Rounding, binade, rounding_scales, stream_sumsq
from ..plan.build import module_at
from ..plan.plan import Plan, Sources, Stop
from .kinds.sources import SourceSplit
from .readers import at, layer_input, layer_output, read_site
from .readout import Readout
from .terms import layer_scores, term_directions


def final_direction(model, plan: Plan, targets: torch.Tensor, contrasts: torch.Tensor | None):
    """``(probe, direction [batch, d_model], constant [batch])`` of the final head for these target tokens."""
    width = model.lm_head.weight.shape[-1]
    probe: NormProbe = identity_probe(width) if plan.family.final_norm == "none" else probe_norm(model.ln_final, width)
    weight = model.lm_head.weight
    probe = probe.to(weight.device)  # a norm without parameters (OLMo, nanochat) is probed on the CPU
    rows = weight[targets.to(weight.device)].float()
    bias = getattr(model.lm_head, "bias", None)
    head_bias = bias[targets.to(bias.device)].float() if bias is not None else 0.0
    if contrasts is not None:
        rows = rows - weight[contrasts.to(weight.device)].float()
        if bias is not None:
            head_bias = head_bias - bias[contrasts.to(bias.device)].float()
    rows = rows.to(probe.gain.device)
    rows = rows * plan.head_input_scale  # lm_head reads the final norm's output times it (MiniCPM)
    direction = plan.logit_scale * probe.center(probe.gain * rows)
    constant = plan.logit_scale * (dot(rows, probe.bias) + torch.as_tensor(head_bias).to(rows.device))
    return probe, direction, constant


def softcap(z: torch.Tensor, cap: float | None) -> torch.Tensor:
    return z if cap is None else cap * torch.tanh(z / cap)


def scaled(scores: list, scale: torch.Tensor) -> list:
    """Every score group ``[batch, ...]`` times a per-prompt ``scale`` ``[batch]`` (a frozen stream norm's)."""
    return [s * scale.to(s.device).reshape(-1, *([1] * (s.dim() - 1))) for s in scores]


def decompose(model, plan: Plan, direction: torch.Tensor, positions: torch.Tensor, by: Granularity,
              stop: Stop | None = None, sources: Sources | None = None,
              offsets: torch.Tensor | None = None,
              rounding: Rounding | None = None, edits: bool = False,
              patterns: list | None = None) -> tuple[torch.Tensor, list[float]]:
    """``[batch, n_components]``: every term written before ``stop`` at the attributed positions, dotted with
    ``direction`` (a direction on the stream at ``stop``; None: the final norm's input), read in forward order.
    ``by="source"``: ``sources`` says which heads split into how many sources; ``offsets`` ``[batch]`` is where
    each prompt's own tokens start in the padded sequence.

    Returns the unscaled scores (multiply by the frozen norm's scale at ``stop``) and the post-norms' fit errors;
    ``rounding`` (low precision only) collects what the model's own rounding is bounded with, unscaled: each split
    term's gap and noise and, after each whole block, the stream's noise around its adds (``Rounding``). ``edits``:
    the forward pass may be edited, so each split term's gap is a column of its own (``L3.mlp.edit``, before its
    rest): what it wrote beyond its parts and bias. ``patterns`` collects each source-split block's
    ``(rebuild error, layer)`` (``by="source"``: the heads rebuilt from pattern and values against the model's).
    """
    rows = torch.arange(positions.shape[0])
    embed_direction, per_layer = term_directions(model, plan, direction, stop)
    fit_errors: list[float] = []
    embed = at(layer_input(model, 0), rows, positions)  # [batch, d_model], or [batch, streams, d_model]
    scores = [(embed * embed_direction.to(embed.device).unsqueeze(-2)).sum(-1) if embed.dim() == 3 else
              dot(embed, embed_direction).unsqueeze(-1)]
    carried = [None]  # parallel streams: each score group's weight on every stream [batch, streams]
    if embed.dim() == 3:
        carried = [torch.eye(embed.shape[1], device=embed.device).expand(embed.shape[0], -1, -1)]
    previous = embed  # the stream before the block (its rounding bound, ``rounding``)
    for i, terms in enumerate(plan.terms_before(stop)):
        split = SourceSplit(sources, i, offsets) if by == "source" else None
        for score, hyper, before, after in layer_scores(model.layers[i], terms, per_layer[i], by, rows, positions,
                                                        fit_errors, split, rounding, edits, i, patterns):
            if before is not None:  # a norm on the stream scales everything written before it
                scores = scaled(scores, before)
            if hyper is not None:  # streams <- comb^T streams, then the term is written with weights post
                post, comb = hyper
                if comb is not None:
                    carried = [torch.einsum("bjk,b...j->b...k", comb, weights) for weights in carried]
                carried.append(post)
            scores.append(score.to(scores[0].device))
            if after is not None:  # a norm right after the add scales it too; its bias joins the term's rest
                scores = scaled(scores, after[0])
                scores[-1][:, -1] += torch.as_tensor(after[1]).to(scores[-1].device)
        if rounding is not None and per_layer[i] and (stop is None or i < stop[0]):
            stream_after = at(read_site(model.layers[i], "output"), rows, positions)
            rounding.stream_noise.append(len(terms) * stream_sumsq(previous, stream_after, per_layer[i][-1][0]))
            previous = stream_after
    if carried[0] is not None:  # the final collapse: each group's stream weights read along the collapse weights
        head = module_at(model, plan.family.collapse)
        collapse = plan.family.collapse_weights(head, at(head.input, rows, positions))  # [batch, streams]
        weights = [torch.einsum("b...k,bk->b...", w, collapse) for w in carried]
        scores = [(scores[0] * weights[0]).sum(-1, keepdim=True)] + [s * w[:, None] for s, w in zip(scores[1:], weights[1:])]
    return torch.cat(scores, -1), fit_errors


def direct_logit_attribution(
    model,
    plan: Plan,
    positions: torch.Tensor,
    targets: torch.Tensor,
    contrasts: torch.Tensor | None = None,
    by: Granularity = "block",
    sources: Sources | None = None,
    offsets: torch.Tensor | None = None,
    edits: bool = False,
) -> Readout:
    """Attribute a logit (difference) inside a trace; see the module docstring.

    Args:
        model: the ``StandardizedTransformer`` being traced.
        plan: ``build_plan(model)``.
        positions: ``[batch]`` long, the attributed position of each prompt, an index into the padded sequence.
        targets, contrasts: ``[batch]`` long token ids (``contrasts`` optional: attribute the logit difference).
        by: ``"block"``, ``"head"``, ``"neuron"``, ``"expert"`` or ``"source"``.
        sources, offsets: ``by="source"``: the heads split and into how many sources (``plan.Sources``), and
            ``[batch]`` long, where each prompt's own tokens start in the padded sequence.
        edits: the forward pass may be edited (``intervene=``, ``trace_attribution``): each split term has an
            ``.edit`` column, what it wrote beyond its parts and bias (``plan.components(by, edits=True)``).
    """
    check_granularity(by)
    with torch.no_grad():
        rows = torch.arange(positions.shape[0])
        probe, direction, constant = final_direction(model, plan, targets, contrasts)
        # the rounding the self-check bounds is read only for a low-precision model (in float32 and float64 it is
        # far below the float32 floor of the check, and the reads cost time on small models)
        rounding = Rounding() if model.lm_head.weight.dtype in (torch.bfloat16, torch.float16) else None
        patterns: list = []
        scores, fit_errors = decompose(model, plan, direction, positions, by, None, sources, offsets, rounding, edits,
                                       patterns)
        pattern_error, pattern_layer = max(patterns, default=(0.0, -1))
        if plan.family.final_norm != "module":  # no final norm, or it also ran before the blocks: read around it
            stream, normed = layer_output(model, len(model.layers) - 1), model.lm_head.input  # normed: [b, kept, d]
        else:
            stream, normed = model.ln_final.input, model.ln_final.output  # [batch, pos, d_model]
        x = at(stream, rows, positions)
        y = at(normed, rows, positions - (stream.shape[1] - normed.shape[1]))
        final: FrozenNorm = probe.freeze(x, y)
        fit_errors.append(final.fit_error)
        values = scores * final.scale.to(scores.device).unsqueeze(-1)
        head_out = model.lm_head.output  # [batch, kept, vocab]: the last `kept` positions (logits_to_keep)
        at_head = positions - (stream.shape[1] - head_out.shape[1])
        head_out = at(head_out, rows, at_head)  # [batch, vocab]
        logits = at(model.output.logits, rows, at_head)
        picked, out = head_out.gather(-1, targets.to(head_out.device)[:, None])[:, 0], logits.gather(-1, targets.to(logits.device)[:, None])[:, 0]
        head_error = (softcap(picked * plan.logit_scale, plan.softcap) - out.to(picked.device)).abs().max()
        logit = picked * plan.logit_scale
        if contrasts is not None:
            picked_contrast = head_out.gather(-1, contrasts.to(head_out.device)[:, None])[:, 0]
            out_contrast = logits.gather(-1, contrasts.to(logits.device)[:, None])[:, 0]
            head_error = torch.maximum(
                head_error,
                (softcap(picked_contrast * plan.logit_scale, plan.softcap) - out_contrast.to(picked.device)).abs().max(),
            )
            logit = logit - picked_contrast * plan.logit_scale
            out = out - out_contrast
        head_rows = model.lm_head.weight[targets.to(model.lm_head.weight.device)].float()
        if contrasts is not None:
            head_rows = head_rows - model.lm_head.weight[contrasts.to(model.lm_head.weight.device)].float()
        size = (binade(picked) + (binade(picked_contrast) if contrasts is not None else 0.0)) * abs(plan.logit_scale)
        return Readout(
            values=values.cpu(),
            constant=constant.cpu(),
            logit=logit.cpu(),
            output_logit=out.cpu(),
            head_error=head_error.cpu(),
            norm_fit_error=torch.tensor(max(fit_errors)),
            scale=final.scale.cpu(),
            pattern_error=torch.tensor(float(pattern_error)),
            pattern_layer=torch.tensor(float(pattern_layer)),
            **rounding_scales(x, direction, final.scale, y, head_rows * plan.logit_scale, rounding, size, scores,
                              computed_in=model.lm_head.weight.dtype),
        )


def direction_attribution(
    model,
    plan: Plan,
    positions: torch.Tensor,
    direction: torch.Tensor,
    stop: Stop,
    reads: str,
    by: Granularity = "block",
) -> Readout:
    """Attribute ``norm(stream) @ direction`` inside a trace, where ``norm`` (the module at ``reads`` in block
    ``stop[0]``) reads the stream at ``stop``: the terms written before it, through the norm frozen at its input.

    Args:
        direction: ``[batch, d_model]`` (or ``[d_model]``), a direction on the norm's output (a probe, a query).
        stop: ``plan.stop_before(layer, sublayer)``; reads: that sublayer's ``Term.reads``.
    """
    check_granularity(by)
    with torch.no_grad():
        rows = torch.arange(positions.shape[0])
        norm = module_at(model.layers[stop[0]], reads)
        probe = probe_norm(norm, direction.shape[-1]).to(model.lm_head.weight.device)
        v = direction.float().to(probe.gain.device).expand(positions.shape[0], -1)
        # the rounding the self-check bounds is read only for a low-precision model (in float32 and float64 it is
        # far below the float32 floor of the check, and the reads cost time on small models)
        rounding = Rounding() if model.lm_head.weight.dtype in (torch.bfloat16, torch.float16) else None
        pulled = probe.center(probe.gain * v)
        scores, fit_errors = decompose(model, plan, pulled, positions, by, stop, rounding=rounding)
        stream = at(read_site(norm, "input", positions.shape[0]), rows, positions)
        output = at(read_site(norm, "output", positions.shape[0]), rows, positions)
        frozen = probe.freeze(stream, output)
        fit_errors.append(frozen.fit_error)
        own = dot(output, v)  # the model's own normed stream, read along the direction
        return Readout(
            values=(scores * frozen.scale.to(scores.device).unsqueeze(-1)).cpu(),
            constant=dot(v, probe.bias).cpu(),
            logit=own.cpu(),
            output_logit=own.cpu(),
            head_error=torch.zeros(()),
            norm_fit_error=torch.tensor(max(fit_errors)),
            scale=frozen.scale.cpu(),
            **rounding_scales(stream, pulled, frozen.scale, output, v, rounding, 0.0, scores,
                              len(plan.terms_before(stop)[stop[0]]) if len(plan.terms_before(stop)) > stop[0] else 0,
                              computed_in=model.lm_head.weight.dtype),
        )


@dataclass(frozen=True)
class LogitCall:
    """``direct_logit_attribution``'s arguments for one batch: what a trace computes, ``call.run(model)``."""

    plan: Plan
    positions: torch.Tensor
    targets: torch.Tensor
    contrasts: torch.Tensor | None
    by: Granularity
    sources: Sources | None = None
    offsets: torch.Tensor | None = None
    edits: bool = False

    def run(self, model) -> Readout:
        """The attribution of this batch's logits, inside the running trace of ``model``."""
        return direct_logit_attribution(model, self.plan, self.positions, self.targets, self.contrasts, self.by,
                                        self.sources, self.offsets, self.edits)


@dataclass(frozen=True)
class DirectionCall:
    """``direction_attribution``'s arguments for one batch: what a trace computes, ``call.run(model)``."""

    plan: Plan
    positions: torch.Tensor
    direction: torch.Tensor
    stop: Stop
    reads: str
    by: Granularity

    def run(self, model) -> Readout:
        """The attribution of this batch's direction, inside the running trace of ``model``."""
        return direction_attribution(model, self.plan, self.positions, self.direction, self.stop, self.reads, self.by)
