"""The plan of ``attribute(..., by="source")``: whether the model's heads can split by source position, and which.

A head's write at position ``p`` is ``z_h[p] = sum_s A_h[p, s] v_h[s]``, linear in the values once the attention
pattern ``A`` the model computed is read, so its part splits exactly over source positions ``s`` (the in-trace
math is ``trace.kinds.sources``). This module decides, before any forward pass, whether the model can be split
(its family must say where the values are read, ``Heads.values`` and ``Heads.values_layout``) and which heads are
split (``sources=dict(layers=[...], top_heads=k)``), and raises a clear error otherwise.

How the pattern is read, per attention implementation: under eager, the model's own attention weights, the second
output of the attention module (after soft-capping, sliding-window and padding masks, and without the sink column
of attention-sink families, whose rows sum to less than 1: the missing mass belongs to no source). Under sdpa (or
any implementation that returns no weights), recomputed inside the trace at the attributed sites from the attention
module's own ``attention_interface(...)`` call, read through nnsight's ``.source``: its query and key (after rotary
embeddings, q/k norms and query scales), scaling, soft-cap, sinks and mask, as ``eager_attention_forward`` combines
them (``trace.kinds.pattern``); a module without that call, or with inputs it does not expect, is refused with a
``DLAError``. Families whose attention is their own code (BLOOM) return their pattern whatever
``attn_implementation`` says. Where the values are read (``Heads.values``):

- ``v_proj``'s output: Llama, Mistral, Qwen2/3, Gemma 1/2/3, OLMo 1/2/3, SmolLM3, Apertus, GPT-J, Mixtral, Qwen2-MoE,
  OLMoE, GLM-4, EXAONE-4, Granite, Cohere, OPT, Phi, Doge; Gemma-4: ``v_norm``'s output (its KV-shared layers are
  refused: split the others with ``sources=dict(layers=[...])``);
- a fused projection's output: GPT-2, Phi-3 (``values_layout="qkv"``), GPT-NeoX, BLOOM (``"per_head_qkv"``);
- refused: Falcon (its own fused attention code), DeepSeek-V3/V4 (latent attention), JetMoE (mixture of attention),
  ZAYA, RecurrentGemma (no value tensor in the family table), Zamba2 (no heads).

``sources=dict(upstream="block")`` splits each (head, source) part further by the component that wrote the source
position's stream (``trace.kinds.paths``); ``check_upstream`` refuses the families whose stream is not the plain sum
of the components' writes, or whose values are not one projection of it through the frozen input norm, and with
``upstream="head"`` those whose heads reach the stream through more than their output projection, a post-norm (frozen
at its real input: Gemma-2/3, OLMo-2) and a multiplier (``head_maps`` names what else stands there).

Each split block's heads are rebuilt from the pattern (read or recomputed) and values in the trace, ``sum_s A v``
against the output projection's real input; the largest relative gap is reported with the norm fit errors
(``attr.diagnostics["norm_fit_error"]``), and a gap past its tolerance is refused by the self-check, so a wrong
recomputation raises instead of answering.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..errors import DLAError, InputError
from ..families import Heads, text_config
from .build import has_path, module_at
from .plan import Plan, Sources

OPTIONS = ("layers", "top_heads", "upstream")
UPSTREAM = ("block", "head")  # sources=dict(upstream=...): what splits each (head, source) part (plan.Sources.upstream)


def attention_implementation(model) -> str | None:
    """The attention implementation transformers runs (``"eager"``, ``"sdpa"``, ...), None when unknown."""
    return getattr(text_config(getattr(model, "_module", model)), "_attn_implementation", None)


def check(model, plan: Plan, layers: Sequence[int]) -> None:
    """Raise a ``DLAError`` unless every split layer's attention can be split by source position.

    Any attention implementation passes here: eager's pattern is read, another's recomputed in the trace
    (``trace.kinds.pattern``, which refuses a module it cannot read)."""
    if not layers:
        raise DLAError(f"family {plan.family.name!r}: this model has no attention heads to split by source")
    for i in layers:
        heads = [p for p in plan.layers[i] if p.term.splits_heads]
        if not heads:
            raise InputError(f"block {i} of this {plan.family.name} model has no attention heads to split by source")
        for planned in heads:
            split = planned.term.split
            if not isinstance(split, Heads) or not split.values:
                raise DLAError(
                    f"family {plan.family.name!r}: by='source' is not supported: its attention "
                    f"({split.projection}) has no value tensor in the family table (fused QKV, latent attention, a "
                    "mixture of attention, or attention that never returns its pattern); use by='head'"
                )
            module = split.values.rsplit(".", 1)[0]
            if not any(has_path(layer, module) for layer in model.layers):
                raise DLAError(
                    f"family {plan.family.name!r}: by='source' is not supported: no block has the value tensor the "
                    f"family table names ({split.values}; latent or fused attention computes its values elsewhere); "
                    "use by='head'"
                )
            if not has_path(model.layers[i], module):
                raise DLAError(
                    f"family {plan.family.name!r}: block {i} computes no values of its own ({split.values} is absent: "
                    "it reuses another block's keys and values); split other layers with "
                    "sources=dict(layers=[...])"
                )


def head_layers(plan: Plan) -> list[int]:
    """The blocks whose attention splits into heads."""
    return [i for i, terms in enumerate(plan.layers) if any(p.term.splits_heads and p.parts for p in terms)]


def parse(plan: Plan, sources: dict | None) -> tuple[list[int], int | None, str | None]:
    """``(layers, top_heads, upstream)`` from the user's ``sources`` dict (None: every head of every attention
    block, not split upstream), its blocks checked against the plan; its keys, ``upstream`` and ``top_heads`` were
    checked with the question (``question.ask``)."""
    sources = dict(sources or {})
    upstream = sources.get("upstream")
    all_layers = head_layers(plan)
    layers = sources.get("layers")
    if layers is None:
        layers = all_layers
    else:
        n = len(plan.layers)
        try:
            layers = sorted({int(i) % n if -n <= int(i) < n else _bad_layer(i, n) for i in layers})
        except TypeError:
            raise InputError(f"sources['layers'] must be a list of block indices, got {sources['layers']!r}") from None
        missing = [i for i in layers if i not in all_layers]
        if missing:
            raise InputError(f"blocks {missing} have no attention heads to split by source")
    return list(layers), sources.get("top_heads"), upstream


def _bad_layer(i, n):
    raise InputError(f"sources['layers'] has block {i}, outside this {n}-block model")


def choose(plan: Plan, layers: list[int], top: int | None, count: int, head_attribution=None,
           upstream: str | None = None) -> Sources:
    """The ``Sources`` spec: every head of ``layers``, or the ``top`` heads among them ranked by their largest
    ``|part|`` over the prompts in ``head_attribution`` (an ``attribute(..., by="head")`` of the same prompts);
    ``upstream``: each (head, source) part split by upstream component (``Sources.upstream``)."""
    if top is None and layers == head_layers(plan):
        return Sources(count, upstream=upstream)
    if top is None:
        return Sources(count, frozenset((i, h) for i in layers for p in plan.layers[i] if p.term.splits_heads
                                        for h in range(p.parts)), upstream)
    ranked = []
    wanted = set(layers)
    for j, component in enumerate(head_attribution.components):
        if component.part == "head" and component.layer in wanted:
            ranked.append((float(head_attribution.values[:, j].abs().max()), component.layer, component.index))
    ranked.sort(reverse=True)
    return Sources(count, frozenset((i, h) for _, i, h in ranked[:top]), upstream)


def head_maps(planned) -> str:
    """What stands between a heads term's output projection and the stream that ``upstream="head"`` cannot carry
    each head through ('' if nothing: a post-norm frozen at its real input and a config multiplier it can)."""
    term, split = planned.term, planned.term.split
    found = [why for why, present in (
        (f"its parts are read as a {planned.kind!r} kind, not one linear projection", planned.kind != "linear"),
        (f"a second map, {getattr(split, 'then', None)}", getattr(split, "then", None) is not None),
        (f"a scale on the projection's input, {getattr(split, 'projection_scale', None)}",
         getattr(split, "projection_scale", None) is not None),
        ("a multiplier on the projection's input", planned.projection_multiplier != 1.0),
        (f"an affine merge ({', '.join(p for p in (term.write.scale, term.write.bias) if p)})",
         term.write.scale is not None or term.write.bias is not None),
    ) if present]
    return "; ".join(found)


def check_upstream(model, plan: Plan, layers: Sequence[int], upstream: str = "block") -> None:
    """``sources=dict(upstream="block" or "head")``: raise a ``DLAError`` unless the stream each split block's heads read is
    the plain sum of the writes before it (no per-block scale, stream norm, stream gate or parallel streams) and
    their values are linear in it (one projection of the stream through the block's frozen input norm, or of the
    stream itself: no value norm); ``"head"``: and each earlier attention's heads reach the stream through their
    output projection, a post-norm (frozen at its real input) and a multiplier only (``head_maps``)."""
    family = plan.family.name
    why = None
    if plan.family.layer_scale is not None:
        why = f"a per-block scale ({plan.family.layer_scale}) multiplies the stream after each block"
    for i, terms in enumerate(plan.layers[:max(layers, default=-1) + 1]):
        for planned in terms:
            term, stream = planned.term, planned.term.stream
            acting = [name for name in ("scale", "bias", "multiplier", "norm", "norm_after")
                      if getattr(stream, name) is not None]
            if why is None and (acting or term.hyper is not None or planned.stream_multiplier != 1.0):
                why = (f"block {i}'s {term.name} acts on the stream itself ({', '.join(acting) or 'hyper-connections'})"
                       ", so the stream is not the sum of what the components wrote")
            if why is None and term.write.outer_norm is not None:
                why = f"block {i}'s {term.name} is written through a norm shared with another term ({term.write.outer_norm})"
            if why is None and upstream == "head" and planned.mode("head") == "heads":
                after = head_maps(planned)
                if after:
                    why = (f"upstream='head': block {i}'s heads are not written by their output projection alone "
                           f"(then {after})")
    for i in layers:
        for planned in plan.layers[i]:
            if why is None and planned.mode("source") == "sources":
                module = planned.term.split.values.rsplit(".", 1)[0]
                weight = getattr(module_at(model.layers[i], module), "weight", None)
                attention = planned.term.split.projection.rsplit(".", 1)[0]
                if planned.kind != "linear" or weight is None or len(weight.shape) != 2:
                    why = (f"block {i}'s values ({planned.term.split.values}) are not one linear projection of the "
                           "normed stream (a value norm, or a convolution over positions)")
                elif planned.term.output.rsplit(".", 1)[0].startswith(attention + "."):
                    why = (f"block {i}'s attention write ({planned.term.output}) is read inside the attention module, "
                           "which returns its pattern only after it, so the write cannot be read in forward order")
    if why is not None:
        instead = "upstream='block' or " if upstream == "head" and why.startswith("upstream='head'") else ""
        raise DLAError(f"family {family!r}: sources=dict(upstream=...) is not supported: {why}. "
                       f"Use {instead}by='source' without upstream")
