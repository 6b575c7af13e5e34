"""Shapes shared by several family entries: block layouts (``LLAMA_LIKE``, ``SANDWICH``, ...), the terms they are
made of (``ATTENTION``, ``DENSE_MLP``, ``ROUTED``, ...), builders of layer kinds (``sequential``, ``moe_kinds``,
``granite_moe_kinds``) and the computed scalars and collapse weights entries point to (``depth_scale``,
``beam_write``, ``hyper_head_weights``, ...)."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from .schema import Experts, Heads, LayerKind, Neurons, Term, Write


def sequential(
    proj: tuple[str, str] = ("o_proj", "down_proj"),
    *,
    post: tuple[str | None, str | None] = (None, None),
    multiplier: str | None = None,
    reads: tuple[str | None, str | None] = ("input_layernorm", "post_attention_layernorm"),
    parallel: bool | str = False,
    values: tuple[str | None, str | None] = ("self_attn.v_proj.output", None),
) -> tuple[LayerKind, ...]:
    """A block that adds its attention's then its MLP's output (through an optional post-norm and multiplier).

    ``proj``: the attention's and the MLP's output projections; ``post``: their post-norms (None: none);
    ``reads``: the norms their inputs are read through; ``values``: the attention's values (a path) and their
    layout (``"qkv"``: a fused projection's; None: the values alone)."""
    (attn_proj, mlp_proj), (attn_post, mlp_post), (values, values_layout) = proj, post, values
    attn_out = f"{attn_post}.output" if attn_post else "self_attn.output"
    mlp_out = f"{mlp_post}.output" if mlp_post else "mlp.output"
    return (
        LayerKind(
            (
                Term("attn", attn_out, Heads(f"self_attn.{attn_proj}", values=values, values_layout=values_layout),
                     reads=reads[0], write=Write(post_norm=attn_post, multiplier=multiplier)),
                Term("mlp", mlp_out, Neurons(f"mlp.{mlp_proj}"), reads=reads[1], parallel=parallel,
                     write=Write(post_norm=mlp_post, multiplier=multiplier)),
            )
        ),
    )


LLAMA_LIKE = sequential()
ATTENTION = Term("attn", "self_attn.output", Heads("self_attn.o_proj", values="self_attn.v_proj.output"),
                 reads="input_layernorm")
MLA = Term("attn", "self_attn.output", Heads("self_attn.o_proj"), reads="input_layernorm")  # values inside kv_b_proj
DENSE_MLP = Term("mlp", "mlp.output", Neurons("mlp.down_proj"), reads="post_attention_layernorm")
ROUTED = Term("mlp", "mlp.output", Experts("mlp.experts"), reads="post_attention_layernorm")  # fused MoE
SANDWICH = sequential(post=("post_attention_layernorm", "post_feedforward_layernorm"),
                      reads=("input_layernorm", "pre_feedforward_layernorm"))  # Gemma 2 / 3: norms around both
OPT_LIKE = LayerKind((  # OPT, XGLM, BioGPT: fc1 / fc2 sit on the block
    Term("attn", "self_attn.output", Heads("self_attn.out_proj"), reads="self_attn_layer_norm"),
    Term("mlp", "fc2.output", Neurons("fc2"), reads="final_layer_norm"),
))
POST_NORM_ONLY = sequential(post=("post_attention_layernorm", "post_feedforward_layernorm"),
                            reads=(None, None))  # OLMo 2 / 3, EXAONE-4: the sublayers read the raw stream


def moe_kinds(shared_first: bool = False, attention: Term = ATTENTION, post_norm: str | None = None,
              mixer: tuple[Term, str] | None = None, mlp_reads: str = "post_attention_layernorm",
              down: str = "down_proj") -> tuple[LayerKind, ...]:
    """Attention, then routed experts with a shared expert (``shared_experts``, ``shared_expert`` or
    ``shared_mlp``), routed experts alone, or a dense MLP: whichever the block has. ``post_norm``: a norm inside the
    MoE module after the sum (A.X-K1). ``mixer``: a second kind of token mixer and the path that marks its blocks."""
    def routed(shared):
        return Term("mlp", "mlp.output",
                    Experts("mlp.experts", shared=shared and f"{shared}.down_proj", shared_first=shared_first),
                    reads=mlp_reads, write=Write(post_norm=post_norm))
    mlps = [(routed(f"mlp.{name}"), (f"mlp.{name}",)) for name in ("shared_experts", "shared_expert", "shared_mlp")]
    dense = Term("mlp", "mlp.output", Neurons(f"mlp.{down}"), reads=mlp_reads)
    mlps += [(routed(None), ("mlp.experts",)), (dense, ())]
    mixers = [(mixer[0], (mixer[1],)), (attention, ())] if mixer else [(attention, ())]
    return tuple(LayerKind((m, mlp), when=m_when + mlp_when or None) for m, m_when in mixers for mlp, mlp_when in mlps)


def granite_moe_kinds() -> tuple[LayerKind, ...]:
    """Granite MoE blocks: attention or a Mamba mixer, then routed experts and / or a shared MLP, every write times
    ``residual_multiplier``."""
    mult = "residual_multiplier"
    experts = Term("mlp", "mlp.output", Experts("mlp.experts"), reads="post_attention_layernorm",
                   write=Write(multiplier=mult))
    shared = Term("shared_mlp", "shared_mlp.output", Neurons("shared_mlp.output_linear"),
                  reads="post_attention_layernorm", write=Write(multiplier=mult))
    mixers = (
        (Term("mixer", "mamba.output", reads="input_layernorm", write=Write(multiplier=mult)), "mamba"),
        (Term("attn", "self_attn.output", Heads("self_attn.o_proj"), reads="input_layernorm",
              write=Write(multiplier=mult)),
         "self_attn"),
    )
    mlps = (
        ((experts, replace(shared, parallel=True)), ("mlp.experts", "shared_mlp")),
        ((experts,), ("mlp.experts",)),
        ((shared,), ("shared_mlp",)),
    )
    return tuple(LayerKind((mixer, *terms), when=(has, *when)) for mixer, has in mixers for terms, when in mlps)


def hyper_head_weights(head, streams: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V4's final collapse weights ``[batch, streams]``: ``sigmoid(fn(rmsnorm(flat)) * scale + base) + eps``,
    computed with the module's own norm and parameters from the streams it reads ``[batch, streams, d_model]``."""
    flat = head.input_norm(streams.flatten(-2).float())
    mixes = flat @ head.hc_fn.float().T
    return torch.sigmoid(mixes * head.hc_scale.float() + head.hc_base.float()) + head.eps


def cohere2_moe_mean(config) -> float:
    """Cohere-2-MoE's routed and shared experts are averaged (each halved) under the "average" strategy."""
    averaged = config.num_shared_experts > 0 and config.shared_expert_combination_strategy == "average"
    return 0.5 if averaged else 1.0


def depth_scale(config, layer: int) -> float:
    """MiniCPM's residual scale ``scale_depth / sqrt(num_hidden_layers)`` (a computed scalar)."""
    return config.scale_depth / math.sqrt(config.num_hidden_layers)


@dataclass(frozen=True)
class beam_write:  # used like a function: ``beam_write(sublayer)(config, layer)``
    """Beam's depth-scaled add: the n-th add (``n = 2 (layer + 1) + sublayer``) writes ``write / sqrt(n)``."""

    sublayer: int

    def __call__(self, config, layer: int) -> float:
        return 1.0 / math.sqrt(2 * (layer + 1) + self.sublayer)


@dataclass(frozen=True)
class beam_stream:
    """Beam's depth-scaled add: the n-th add keeps ``stream * sqrt((n - 1) / n)``."""

    sublayer: int

    def __call__(self, config, layer: int) -> float:
        n = 2 * (layer + 1) + self.sublayer
        return math.sqrt((n - 1) / n)


def hy_head_weights(head, streams: torch.Tensor) -> torch.Tensor:
    """HY-V4's final collapse weights ``[batch, streams]``: ``sigmoid(fn(flat) * rms(flat)^-1 * scale + base) + eps``,
    computed with the module's own norm and parameters from the streams it reads ``[batch, streams, d_model]``."""
    flat = streams.flatten(-2).float()
    mixes = (flat @ head.hc_fn.float().T) * head.input_norm(flat)
    return torch.sigmoid(mixes * head.hc_scale.float() + head.hc_base.float()) + head.eps


INKLING_ATTENTION = Term("attn", "attn_sconv.output", Heads("self_attn.o_proj", position_conv="attn_sconv"),
                         reads="input_layernorm")
RWKV_CHANNEL_MIX = Term("mlp", "feed_forward.output",
                        Neurons("feed_forward.value", output_gate="feed_forward.receptance"), reads="ln2")


QWEN_NEXT_KINDS = tuple(
    LayerKind((mixer, mlp), when=(has, when))
    for mixer, has in ((Term("mixer", "self_attn.output", reads="input_layernorm"), "self_attn.out_proj"),
                       (ATTENTION, "self_attn.o_proj"))
    for mlp, when in (
        (Term("mlp", "mlp.output",
              Experts("mlp.experts", shared="mlp.shared_expert.down_proj", shared_gate="mlp.shared_expert_gate",
                      shared_first=True), reads="post_attention_layernorm"),
         "mlp.shared_expert_gate"),
        (Term("mlp", "mlp.output", Experts("mlp.experts", shared="mlp.shared_expert.down_proj"),
              reads="post_attention_layernorm"), "mlp.shared_expert"),
        (ROUTED, "mlp.experts"),
        (DENSE_MLP, "mlp.down_proj"),
    )
)  # Qwen3-Next blocks: a mixer (gated DeltaNet, or attention) x an MLP kind
