"""The plan of ``attribute_scores``: which head's score, read how, split into which components (client side).

``score_spec(model, plan, head, by)`` checks, before any forward pass, that the model's attention score can be split
exactly, and returns a ``ScoreSpec`` (a small frozen record that travels into the trace, ``trace.scores``):

- the head label (``"L29.H0"``) names a block with attention heads and a head in range;
- the stream entering that block is the plain sum of what earlier components wrote (no stream gates, stream norms,
  hyper-connections or per-block stream scales: those families are refused, naming the reason);
- the attention module computes its query and key as ``norm(proj(ln1(x)))`` followed by rotary embeddings: separate
  ``q_proj`` / ``k_proj`` linear maps, optional per-head or all-heads q/k norms (Qwen3, Gemma-3, OLMo-2), and nothing
  else between them and the attention call (a fused QKV projection, latent attention, a gate, a differential
  attention or a short convolution is refused with the module that does it named). Whatever the module really does is
  checked in the trace anyway: the rebuilt query and key against the attention call's own (``trace.scores``).

``by="block"``: the embedding, then every earlier term whole (``L3.attn``, ``L3.mlp``); ``by="head"``: each earlier
attention's heads (``L3.H5``, each head's slice of the output projection's input times its slice of the weight,
through any post-norm frozen at its real input) and their rest (biases: ``L3.attn``), MLPs whole.
"""

from __future__ import annotations

import inspect
import re
import sys
from dataclasses import dataclass

from ..errors import DLAError, InputError
from ..families import Heads
from .build import module_at
from .plan import Plan, Stop

QUERY_NORMS = ("q_norm", "q_layernorm", "query_layernorm")
KEY_NORMS = ("k_norm", "k_layernorm", "key_layernorm")
# children of an attention module that do not change its query or key
INERT = {"v_proj", "o_proj", "dense", "out_proj", "c_proj", "attn_dropout", "resid_dropout", "attention_dropout",
         "rotary_emb", "v_norm"}
LABEL = re.compile(r"^L(-?\d+)\.H(\d+)$")


@dataclass(frozen=True)
class ScoreSpec:
    """What the trace reads to split one head's score (``trace.scores.score_attribution``).

    Attributes:
        layer, head: the block and the query head; ``kv_head`` the key head it reads (GQA / MQA groups).
        heads, kv_heads, head_dim: the attention's shapes.
        attention: the attention module's path below the block (``"self_attn"``); ``ln1`` the norm it reads (None:
            it reads the stream itself, OLMo-2's post-norm-only blocks).
        q_proj, k_proj: the projections below the attention module; ``q_norm`` / ``k_norm`` their norms (or None).
        stop: where the stream the head reads is in the plan (the terms written before the attention).
        by: ``"block"`` or ``"head"``.
        labels: the components, in forward order (the matrix's rows and columns).
        rotary: the Python module whose ``apply_rotary_pos_emb(q, k, cos, sin)`` the attention rotates with (None:
            it has none; a rotary it applies anyway is caught by the query check in the trace).
    """

    layer: int
    head: int
    kv_head: int
    heads: int
    kv_heads: int
    head_dim: int
    attention: str
    ln1: str | None
    q_proj: str
    k_proj: str
    q_norm: str | None
    k_norm: str | None
    stop: Stop
    by: str
    labels: tuple[str, ...]
    rotary: str | None = None


def parse_head(head, plan: Plan) -> tuple[int, int]:
    """``(layer, head)`` of a label ``"L29.H0"`` (negative layers count from the end), or an ``InputError`` naming
    ``head``."""
    match = LABEL.match(head) if isinstance(head, str) else None
    if match is None:
        raise InputError(f"head={head!r}: name one head as 'L<layer>.H<head>', e.g. 'L3.H5'")
    layer, index = int(match.group(1)), int(match.group(2))
    n = len(plan.layers)
    if not -n <= layer < n:
        raise InputError(f"head={head!r}: block {layer} is outside this {n}-block model")
    layer %= n
    attention = [p for p in plan.layers[layer] if p.term.splits_heads]
    if not attention:
        raise InputError(f"head={head!r}: block {layer} of this {plan.family.name} model has no attention heads")
    if not 0 <= index < attention[0].parts:
        raise InputError(f"head={head!r}: block {layer} has {attention[0].parts} heads (H0 .. H{attention[0].parts - 1})")
    return layer, index


def refuse(plan: Plan, why: str):
    raise DLAError(f"family {plan.family.name!r}: attribute_scores cannot split this model's attention score "
                   f"exactly: {why}")


def check_stream(plan: Plan, stop: Stop) -> None:
    """The stream at ``stop`` must be the plain sum of the terms written before it."""
    if plan.family.layer_scale is not None:
        refuse(plan, f"the whole stream is multiplied by {plan.family.layer_scale} after each block")
    for terms in plan.terms_before(stop):
        for planned in terms:
            term = planned.term
            stream = term.stream
            if term.hyper is not None:
                refuse(plan, "parallel residual streams (hyper-connections) mix the stream between blocks")
            if any(getattr(stream, f) is not None for f in ("scale", "bias", "norm", "norm_after")) or \
                    planned.stream_multiplier != 1.0:
                refuse(plan, f"the {term.name} term acts on the stream itself (a gate, scale or norm of the stream)")
            if term.write.outer_norm is not None:
                refuse(plan, f"the {term.name} term's write is normed together with another term's")


def splits_heads(planned) -> bool:
    """Whether an upstream term's heads can be read one by one (``by="head"``): heads through one projection."""
    split, write = planned.term.split, planned.term.write
    return (planned.mode("head") == "heads" and planned.kind == "linear" and isinstance(split, Heads)
            and split.then is None and split.position_conv is None and split.projection_scale is None
            and planned.projection_multiplier == 1.0 and write.scale is None)


def components(plan: Plan, stop: Stop, by: str) -> tuple[str, ...]:
    """The labels of the components written before ``stop``: ``embed``, then each term (``by="head"``: its heads,
    then its rest ``L3.attn``)."""
    labels = ["embed"]
    for i, terms in enumerate(plan.terms_before(stop)):
        for planned in terms:
            if by == "head" and splits_heads(planned):
                labels += [f"L{i}.H{h}" for h in range(planned.parts)]
            labels.append(f"L{i}.{planned.term.name}")
    return tuple(labels)


def child(attention, names) -> str | None:
    return next((n for n in names if getattr(attention, n, None) is not None), None)


def score_spec(model, plan: Plan, head, by: str) -> ScoreSpec:
    """The ``ScoreSpec`` of ``head`` (a label) at ``by``; see the module docstring for what is refused."""
    if by not in ("block", "head"):
        raise InputError(f"by={by!r}: attribute_scores splits by 'block' or 'head' (upstream heads)")
    layer, index = parse_head(head, plan)
    planned = next(p for p in plan.layers[layer] if p.term.splits_heads)
    term = planned.term
    if not isinstance(term.split, Heads):
        refuse(plan, "a mixture of attention routes each token to its own heads")
    k = [p.term.name for p in plan.layers[layer]].index(term.name)
    stop = plan.stop_before(layer, term.name) if term.reads is not None else Stop(layer, k)
    if term.reads is None and k:
        refuse(plan, "the attention reads the stream without a norm, after other terms of its block")
    check_stream(plan, stop)
    attention_path = term.split.projection.rsplit(".", 1)[0]
    attention = module_at(model.layers[layer], attention_path)
    module = getattr(attention, "_module", attention)
    if getattr(module, "q_proj", None) is None or getattr(module, "k_proj", None) is None:
        fused = [n for n, _ in module.named_children() if n not in INERT]
        refuse(plan, f"its attention computes the query and key without separate q_proj / k_proj projections "
                     f"({', '.join(fused) or 'none'}: fused QKV or latent attention)")
    width = int(module.q_proj.weight.shape[0])
    head_dim = getattr(module, "head_dim", None)  # the query / key head width (MiMo's values are wider)
    head_dim = int(head_dim) if isinstance(head_dim, int) else planned.part_width
    if width != planned.parts * head_dim:
        refuse(plan, f"its q_proj writes {width} features, not {planned.parts} heads x {head_dim}: "
                     "something written beside the query (an output gate)")
    q_norm, k_norm = child(module, QUERY_NORMS), child(module, KEY_NORMS)
    for name in (q_norm, k_norm):
        weight = getattr(getattr(module, name, None), "weight", None) if name else None
        if weight is not None and weight.dim() > 1:
            refuse(plan, f"its {name} has a gain per head {tuple(weight.shape)}, which the frozen norm does not read")
    extra = [n for n, _ in module.named_children() if n not in INERT | {"q_proj", "k_proj", q_norm, k_norm}]
    if extra:
        refuse(plan, f"its attention module has {', '.join(extra)} besides the query and key projections and norms "
                     "(a gate, a mask from the values, a convolution, a sub-norm or a second pattern)")
    if getattr(getattr(module, "config", None), "_attn_implementation", "eager") is None:
        refuse(plan, "its attention is its own code (no attention call to read the query and key from)")
    heads = planned.parts
    kv_width = int(module.k_proj.weight.shape[0])
    kv_heads = kv_width // head_dim
    if kv_heads < 1 or heads % kv_heads:
        refuse(plan, f"its key projection is {kv_width} wide, not a whole number of {head_dim}-wide key heads")
    return ScoreSpec(layer=layer, head=index, kv_head=index // (heads // kv_heads), heads=heads, kv_heads=kv_heads,
                     head_dim=head_dim, attention=attention_path, ln1=term.reads, q_proj="q_proj", k_proj="k_proj",
                     q_norm=q_norm, k_norm=k_norm, stop=stop, by=by, labels=components(plan, stop, by),
                     rotary=rotary_of(plan, module))


def rotary_of(plan: Plan, module) -> str | None:
    """The name of the Python module whose ``apply_rotary_pos_emb(q, k, cos, sin)`` ``module`` rotates with. From
    transformers 5.25 the function is a ``kernels`` ``Func`` module whose ``forward(*args, **kwargs)`` passes its
    arguments on to the function (or to a hub kernel of the same contract): taken as it is, since the split keeps
    only a rotation that rebuilds the attention call's own query and key (``trace.scores.side``), and a function
    that took its arguments otherwise is refused by that rebuild's check (``scores.check_rebuilt``, naming the
    family)."""
    name = type(module).__module__
    function = getattr(sys.modules.get(name), "apply_rotary_pos_emb", None)
    if function is None:
        return None
    parameters = list(inspect.signature(function).parameters.values())
    passes_on = bool(parameters) and parameters[0].kind is inspect.Parameter.VAR_POSITIONAL
    names = [p.name for p in parameters[:4]]
    if names != ["q", "k", "cos", "sin"] and not passes_on:
        refuse(plan, f"its rotary function is apply_rotary_pos_emb({', '.join(names)}), not (q, k, cos, sin)")
    return name
