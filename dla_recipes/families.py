"""The family table: every per-family fact dla_recipes uses, as data, in this one module.

The attribution math (``recipe.py``) never asks which family it runs on. It asks this table three questions, and
each family answers with one ``Family`` entry:

1. **What does each block add to its residual stream?** A tuple of ``Term``: where the added tensor is read
   (``output``), which linear map's input splits it into heads or neurons (``projection``), a norm between that map
   and the add (``post_norm``), a config multiplier (``multiplier``), an affine merge (``scale``, ``bias``).
2. **What acts on the stream itself after a term is written?** ``Term.stream_scale`` / ``Term.stream_bias`` (the
   stream is ``(stream + stream_bias) * stream_scale`` when the term is added, as on Doge and ZAYA) and
   ``Family.layer_scale`` (the whole stream times a per-block buffer after the block, as on Gemma-4);
   ``Term.stream_multiplier`` (a scalar, MiniMax's alpha); ``Term.stream_norm`` / ``Term.stream_norm_after`` (a norm
   applied to the stream itself before / right after the add: MiniMax, RWKV's block 0, OpenAI GPT's post-norm blocks).
3. **What does the final head apply after the final norm and ``lm_head``?** ``logits_times`` / ``logits_over`` (a
   config constant) and ``softcap`` (``c * tanh(z / c)``: not linear, so the parts sum to the pre-cap logit);
   ``head_input_over`` (lm_head reads the final norm's output over a config constant) and ``final_norm`` (``"none"``:
   no final norm; ``"shared"``: the final norm module also runs before the blocks).

Paths are relative to the block envoy (``model.layers[i]``) in nnterp's renamed vocabulary (``self_attn``, ``mlp``),
with native names below that. The table composes: a term with ``when`` (``unless``) is written only by blocks where
that path exists (does not exist), so one list of optional terms describes every combination of a family's features
(Gemma-4's dense MLP, experts and per-layer inputs). An entry may also hold several layer kinds (hybrids whose blocks
share nothing); the first kind whose ``when`` path exists on a block is that block's kind.

A mixture of experts is recomputed from its own routing and weights; ``ExpertsLayout`` says how its experts module
stores them (fused or separate gate/up, ``[out, in]`` or ``[in, out]``, biases, the module's own gating function,
router-scaled inputs, scaled routed and shared parts).

Adding a family: one ``Family`` entry in ``FAMILIES`` and one tiny model in ``dla_recipes.testing.tiny``; the
test suite then checks it for exactness against the model's own logits at every granularity, and checks that a
family declared ``padding_safe`` really is (its padded batch's logits against each prompt alone). A model type that
no entry can describe exactly yet goes in ``REFUSED`` with the reason, which ``family_of`` raises. The docs page
"Family table" is generated from this module (``notebooks/families_table.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Callable, Literal

import torch

from .errors import UnknownFamilyError

Split = Literal["heads", "neurons", "experts"]


@dataclass(frozen=True)
class ExpertsLayout:
    """How a fused experts module stores and runs its routed experts: what their recomputation reads.

    Expert ``e`` maps its input row ``x`` ``[d]`` to ``act = gating(x @ gate_up[e] + gate_up_bias[e])`` ``[I]``
    (or ``activation(x @ gate[e]) * (x @ up[e])``) and writes ``weight * (act @ down[e] + down_bias[e])``. Weight
    paths are below the experts module; each is ``[E, out, in]``, or ``[E, in, out]`` when named in ``transposed``,
    or flattened ``[E * out, in]`` (viewed per expert).

    Attributes:
        gate_up: the fused gate/up weight ``[E, 2I, d]``; None when the gate and up are separate weights.
        gate, up: separate gate and up weights (DBRX's ``mlp.w1``, ``mlp.v1``).
        down: the down weight ``[E, d, I]``.
        transposed: the weights stored ``[E, in, out]`` (GPT-OSS, Aria, Llama-4; DBRX's ``mlp.w2``).
        gate_up_bias, down_bias: ``[E, 2I]`` and ``[E, d]`` biases (GPT-OSS).
        gating: the experts module's own method mapping the fused output ``[rows, 2I]`` to the activations
            ``[rows, I]`` (transformers' ``_apply_gate``: chunked or interleaved halves, clamps, as the model computes
            them); None: ``activation(gate) * up`` of the fused output's two halves (or of the separate weights).
        activation: the activation module (a path below the experts module) when ``gating`` is None.
        scaled_inputs: the module runs every expert on every token, each input row pre-multiplied by the token's
            routing score (Llama-4): its input is ``[E * tokens, d]``, expert-major, and each expert's output is
            added with weight 1; a zero input row is an expert the token was not routed to.
        routed_scale, shared_scale: a config attribute, or a function of the config, multiplying the routed
            experts' sum (MiniMax-M3's ``routed_scaling_factor``) and the shared expert (Cohere-2-MoE: both
            halved when the block averages them).
    """

    gate_up: str | None = "gate_up_proj"
    gate: str | None = None
    up: str | None = None
    down: str = "down_proj"
    transposed: tuple[str, ...] = ()
    gate_up_bias: str | None = None
    down_bias: str | None = None
    gating: str | None = "_apply_gate"
    activation: str = "act_fn"
    scaled_inputs: bool = False
    routed_scale: str | Callable | None = None
    shared_scale: str | Callable | None = None


FUSED = ExpertsLayout()  # transformers' standard experts: gate_up_proj [E, 2I, d], down_proj [E, d, I], _apply_gate


@dataclass(frozen=True)
class Term:
    """One term a block writes into the residual stream.

    The stream after the term is ``(stream + stream_bias) * stream_scale + write`` where
    ``write = (outer_norm(read(output)) + bias) * scale * config[multiplier]`` and ``read(output)`` is
    ``post_norm(projection(projection.input))`` when those are given.

    Attributes:
        name: the label suffix (``"attn"``, ``"mlp"``, ``"mixer"``, ...): components are labelled ``f"L{i}.{name}"``.
        output: the tensor added (before ``outer_norm``, ``multiplier``, ``scale``, ``bias``): ``"<path>.output"``
            or ``"<path>.input"``; a tuple value is read at its first element.
        split: how ``projection`` splits the term: ``"heads"`` (its input is ``[batch, pos, heads * head_dim]``),
            ``"neurons"`` (its input is ``[batch, pos, d_mlp]``), ``"experts"`` (a fused mixture-of-experts module
            called as ``experts(hidden [tokens, d], top_k_index [tokens, k], top_k_weights [tokens, k])`` with
            weights as ``layout`` describes), or ``None``.
        projection: the linear map (``nn.Linear`` or GPT-2's ``Conv1D``), or the fused experts module.
        post_norm: a norm between ``projection`` and ``output`` (sandwich / post-norm families).
        outer_norm: a norm applied after ``output``, to the sum of this and the block's other terms that name it
            (Gemma-4's ``post_feedforward_layernorm`` over its dense MLP and its experts).
        multiplier: a config attribute the write is multiplied by (Granite's ``residual_multiplier``); an item of a
            config list is ``"name[i]"`` (Falcon-H1's ``mlp_multipliers[1]``); or a computed scalar: a function
            ``(config, layer_index) -> float`` (MiniCPM3's ``scale_depth / sqrt(layers)``).
        scale, bias: parameter paths of an affine merge, ``(h + bias) * scale`` (ZAYA).
        stream_scale, stream_bias: parameter paths acting on the stream as this term is added (Doge, ZAYA).
        clone: the model later edits this tensor in place (Falcon's ``mlp_output += attention_output``).
        flat: the module sees batch and position flattened, ``[batch * pos, ...]`` (OPT's ``fc1`` / ``fc2``).
        shared: experts split: the down projection of a dense shared expert added to the routed experts.
        shared_gate: experts split: ``sigmoid(shared_gate.output)`` multiplies the shared expert (Qwen2-MoE).
        shared_first: experts split: the shared expert runs before the routed experts (forward order of reads).
        router: a top-k router whose output is ``(index_sorted_experts, batch_index, batch_gates, expert_size,
            logits)`` and whose experts are grouped by expert (ScatterMoE layout: JetMoE's attention and MLP). Then
            ``projection`` is the grouped output projection (``weight [E, d_model, in]``): its input rows are the
            heads of each routed slot (``split="heads"``, slot ``s`` owns heads ``s * in/head_dim ...``) or each
            routed expert's neurons (``split="experts"``).
        projection_bias: a bias added once after ``projection`` (inside ``output``), when the projection has none.
        reads: the norm whose input is the stream this term's sublayer reads (``input_layernorm``, ``ln_2``, ...):
            what ``attribute_direction`` freezes to attribute a direction read at this sublayer.
        parallel: the sublayer reads the same stream as the term before it (a parallel block); a config
            attribute name (``"use_parallel_residual"``) when the family has both kinds.
        then: a second linear map after ``projection`` (DeepSeek-V4's ``o_b_proj`` after the grouped ``o_a_proj``).
        hyper: on a family with parallel residual streams, the hyper-connection run before this term's sublayer:
            its output is ``(post [b, s, streams], comb [b, s, streams, streams], collapsed)``; the streams become
            ``combᵀ streams`` and the term is written into stream ``k`` times ``post[k]``.
        when, unless: the term is written only by blocks where this path exists (``when``) or does not
            (``unless``): optional terms compose, so a block's features need no layer kind per combination.
        layout: experts split: how the experts module stores its weights (default: transformers' fused layout).
        stream_multiplier: a scalar the stream is multiplied by as this term is added (a config attribute, or a
            function ``(config, layer_index) -> float``): MiniMax's ``alpha``, Beam's depth-scaled residual.
        stream_norm: a norm applied to the stream itself before this term is added, whose output is the stream
            the later terms add onto (MiniMax's ``input_layernorm``, RWKV's embedding norm in block 0). It is frozen
            at its real input: a linear map ``gain * center(x) * scale + bias`` that carries every earlier term.
        output_gate: neurons split: ``sigmoid(output_gate.output)`` multiplies ``projection``'s output channel by
            channel (RWKV's channel mix: ``sigmoid(receptance(x)) * value(k)``).
        projection_scale: split terms: a parameter path (a learned scalar or per-channel gain) multiplying
            ``projection``'s output inside ``output`` (Inkling's MLP ``global_scale``).
        position_conv: heads / neurons split: the sublayer's output ``x`` passes through a module computing
            ``x + causal_depthwise_conv(mask * x)`` over positions (weights ``<position_conv>.conv1d.weight
            [d, 1, K]``, the padding mask its ``conv_mask`` argument: Inkling's short convolutions), so the term at
            position ``p`` is made of the projection's inputs at ``p - K + 1 ... p``.
        stream_norm_after: a norm applied to the stream right after this term is added (post-norm blocks: OpenAI
            GPT's ``ln_1`` / ``ln_2``), frozen at its real input like ``stream_norm``.
        projection_multiplier: split terms: a scalar (config attribute or function) between ``projection`` and
            ``output`` (Beam's ``routed_scaling_factor`` after its experts).

    The stream after the term, in full: ``stream_norm_after((stream_norm(stream) + stream_bias) * stream_scale
    * stream_multiplier + write)``.
        values: heads split: where the attention's values are read, ``"<path>.output"`` of ``[batch, pos,
            kv_heads * head_dim]`` or ``[batch, pos, kv_heads, head_dim]``: the value projection's output (bias
            included), or the value norm's output where the family normalises values (Gemma-4's ``v_norm``). Query
            head ``h`` reads group ``h // (heads / kv_heads)`` (GQA / MQA). The attention pattern is the second
            element of the output of the module that owns ``projection`` (``self_attn``) under eager attention.
            ``by="source"`` needs it; None: this term cannot be split by source position (latent attention, ...).
        values_layout: where the values sit in a fused projection's output: ``"qkv"`` (queries, keys, values
            concatenated, keys and values of equal width: the values are the last ``(width - heads * head_dim) / 2``
            features; GPT-2's ``c_attn``, Phi-3's ``qkv_proj``) or ``"per_head_qkv"`` (each head's query, key and
            value side by side: ``[..., heads, 3 * head_dim]``, the values last; GPT-NeoX). None: the tensor is the
            values.
    """

    name: str
    output: str
    split: Split | None = None
    projection: str | None = None
    post_norm: str | None = None
    outer_norm: str | None = None
    multiplier: str | Callable | None = None
    scale: str | None = None
    bias: str | None = None
    stream_scale: str | None = None
    stream_bias: str | None = None
    clone: bool = False
    flat: bool = False
    shared: str | None = None
    shared_gate: str | None = None
    shared_first: bool = False
    router: str | None = None
    projection_bias: str | None = None
    reads: str | None = None
    parallel: bool | str = False
    then: str | None = None
    hyper: str | None = None
    when: str | None = None
    unless: str | None = None
    layout: ExpertsLayout = FUSED
    stream_multiplier: str | Callable | None = None
    stream_norm: str | None = None
    projection_multiplier: str | Callable | None = None
    stream_norm_after: str | None = None
    output_gate: str | None = None
    position_conv: str | None = None
    projection_scale: str | None = None
    values: str | None = None
    values_layout: str | None = None


@dataclass(frozen=True)
class LayerKind:
    """The terms of one kind of block; ``when`` is a path (or several, all required) that exists only on blocks of
    this kind (None: any)."""

    terms: tuple[Term, ...]
    when: str | tuple[str, ...] | None = None


@dataclass(frozen=True)
class Family:
    """Everything dla_recipes knows about one decoder family. See the module docstring.

    ``collapse`` / ``collapse_weights``: on a family with parallel residual streams, the module (a path from the
    model root) that collapses the streams ``[b, s, streams, d]`` into the final norm's input, and the function
    ``(module, streams [b, streams, d]) -> weights [b, streams]`` giving the collapse's per-stream weights.
    """

    name: str
    model_types: tuple[str, ...]
    kinds: tuple[LayerKind, ...]
    layer_scale: str | None = None
    logits_times: str | None = None
    logits_over: str | None = None
    softcap: str | None = None
    collapse: str | None = None
    collapse_weights: Callable | None = None
    padding_safe: bool = True  # left padding leaves a prompt's logits unchanged (False: recurrent state reads pads)
    logits_to_keep: bool = True  # the head may run on the attributed positions only (False: the layers change too)
    rename: dict = field(default_factory=dict)  # RenameConfig fields nnterp needs to load the family
    load_kwargs: dict = field(default_factory=dict)  # other StandardizedTransformer keyword arguments
    notes: str = ""
    head_input_over: str | None = None  # lm_head reads the final norm's output over this config value (MiniCPM)
    final_norm: Literal["module", "shared", "none"] = "module"  # "module": nnterp's ln_final, read at its input
    # and output; "shared": that module also runs before the blocks (nanochat), so it is read around (its input is
    # the last block's output, its output lm_head's input); "none": no final norm (OpenAI GPT), lm_head reads the
    # last block's output

    @property
    def terms(self) -> tuple[Term, ...]:
        """The terms of the family's first (for most families, only) layer kind."""
        return self.kinds[0].terms


# --- the shared shapes -------------------------------------------------------------------------------------------

def _sequential(
    attn_proj: str = "o_proj",
    mlp_proj: str = "down_proj",
    *,
    attn_post: str | None = None,
    mlp_post: str | None = None,
    multiplier: str | None = None,
    reads: tuple[str | None, str | None] = ("input_layernorm", "post_attention_layernorm"),
    parallel: bool | str = False,
    values: str | None = "self_attn.v_proj.output",
    values_layout: str | None = None,
) -> tuple[LayerKind, ...]:
    """A block that adds its attention's then its MLP's output (through an optional post-norm and multiplier)."""
    attn_out = f"{attn_post}.output" if attn_post else "self_attn.output"
    mlp_out = f"{mlp_post}.output" if mlp_post else "mlp.output"
    return (
        LayerKind(
            (
                Term("attn", attn_out, "heads", f"self_attn.{attn_proj}", post_norm=attn_post, multiplier=multiplier,
                     reads=reads[0], values=values, values_layout=values_layout),
                Term("mlp", mlp_out, "neurons", f"mlp.{mlp_proj}", post_norm=mlp_post, multiplier=multiplier,
                     reads=reads[1], parallel=parallel),
            )
        ),
    )


LLAMA_LIKE = _sequential()
ATTENTION = Term("attn", "self_attn.output", "heads", "self_attn.o_proj", reads="input_layernorm",
                 values="self_attn.v_proj.output")
MLA = Term("attn", "self_attn.output", "heads", "self_attn.o_proj", reads="input_layernorm")  # values inside kv_b_proj
DENSE_MLP = Term("mlp", "mlp.output", "neurons", "mlp.down_proj", reads="post_attention_layernorm")
ROUTED = Term("mlp", "mlp.output", "experts", "mlp.experts", reads="post_attention_layernorm")  # fused MoE
SANDWICH = _sequential(attn_post="post_attention_layernorm", mlp_post="post_feedforward_layernorm",
                       reads=("input_layernorm", "pre_feedforward_layernorm"))  # Gemma 2 / 3: norms around both
OPT_LIKE = LayerKind((  # OPT, XGLM, BioGPT: fc1 / fc2 sit on the block
    Term("attn", "self_attn.output", "heads", "self_attn.out_proj", reads="self_attn_layer_norm"),
    Term("mlp", "fc2.output", "neurons", "fc2", reads="final_layer_norm"),
))
POST_NORM_ONLY = _sequential(attn_post="post_attention_layernorm", mlp_post="post_feedforward_layernorm",
                             reads=(None, None))  # OLMo 2 / 3, EXAONE-4: the sublayers read the raw stream


def _moe_kinds(shared_first: bool = False, attention: Term = ATTENTION, post_norm: str | None = None,
               mixer: tuple[Term, str] | None = None, mlp_reads: str = "post_attention_layernorm",
               down: str = "down_proj") -> tuple[LayerKind, ...]:
    """Attention, then routed experts with a shared expert (``shared_experts``, ``shared_expert`` or
    ``shared_mlp``), routed experts alone, or a dense MLP: whichever the block has. ``post_norm``: a norm inside the
    MoE module after the sum (A.X-K1). ``mixer``: a second kind of token mixer and the path that marks its blocks."""
    def routed(shared):
        return Term("mlp", "mlp.output", "experts", "mlp.experts", shared=shared and f"{shared}.down_proj",
                    shared_first=shared_first, post_norm=post_norm, reads=mlp_reads)
    mlps = [(routed(f"mlp.{name}"), (f"mlp.{name}",)) for name in ("shared_experts", "shared_expert", "shared_mlp")]
    dense = Term("mlp", "mlp.output", "neurons", f"mlp.{down}", reads=mlp_reads)
    mlps += [(routed(None), ("mlp.experts",)), (dense, ())]
    mixers = [(mixer[0], (mixer[1],)), (attention, ())] if mixer else [(attention, ())]
    return tuple(LayerKind((m, mlp), when=m_when + mlp_when or None) for m, m_when in mixers for mlp, mlp_when in mlps)


def _granite_moe_kinds() -> tuple[LayerKind, ...]:
    """Granite MoE blocks: attention or a Mamba mixer, then routed experts and / or a shared MLP, every write times
    ``residual_multiplier``."""
    mult = "residual_multiplier"
    experts = Term("mlp", "mlp.output", "experts", "mlp.experts", multiplier=mult, reads="post_attention_layernorm")
    shared = Term("shared_mlp", "shared_mlp.output", "neurons", "shared_mlp.output_linear", multiplier=mult,
                  reads="post_attention_layernorm")
    mixers = (
        (Term("mixer", "mamba.output", multiplier=mult, reads="input_layernorm"), "mamba"),
        (Term("attn", "self_attn.output", "heads", "self_attn.o_proj", multiplier=mult, reads="input_layernorm"),
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


def _cohere2_moe_mean(config) -> float:
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


INKLING_ATTENTION = Term("attn", "attn_sconv.output", "heads", "self_attn.o_proj", position_conv="attn_sconv",
                         reads="input_layernorm")
RWKV_CHANNEL_MIX = Term("mlp", "feed_forward.output", "neurons", "feed_forward.value",
                        output_gate="feed_forward.receptance", reads="ln2")


_QWEN_NEXT_KINDS = tuple(
    LayerKind((mixer, mlp), when=(has, when))
    for mixer, has in ((Term("mixer", "self_attn.output", reads="input_layernorm"), "self_attn.out_proj"),
                       (ATTENTION, "self_attn.o_proj"))
    for mlp, when in (
        (Term("mlp", "mlp.output", "experts", "mlp.experts", shared="mlp.shared_expert.down_proj",
              shared_gate="mlp.shared_expert_gate", shared_first=True, reads="post_attention_layernorm"),
         "mlp.shared_expert_gate"),
        (Term("mlp", "mlp.output", "experts", "mlp.experts", shared="mlp.shared_expert.down_proj",
              reads="post_attention_layernorm"), "mlp.shared_expert"),
        (ROUTED, "mlp.experts"),
        (DENSE_MLP, "mlp.down_proj"),
    )
)  # Qwen3-Next blocks: a mixer (gated DeltaNet, or attention) x an MLP kind


# --- the table ---------------------------------------------------------------------------------------------------

FAMILIES: tuple[Family, ...] = (
    # Pre-norm blocks whose modules' outputs are what the block adds.
    Family("gpt2", ("gpt2",), _sequential("c_proj", "c_proj", reads=("ln_1", "ln_2"), values="self_attn.c_attn.output",
                                         values_layout="qkv"),
           notes="Conv1D weights; learned positions in embed."),
    Family("llama", ("llama",), LLAMA_LIKE),
    Family("mistral", ("mistral",), LLAMA_LIKE),
    Family("qwen2", ("qwen2",), LLAMA_LIKE),
    Family("qwen3", ("qwen3",), LLAMA_LIKE),
    Family("gemma", ("gemma",), LLAMA_LIKE, notes="RMSNorm gain is 1 + w; embeddings scaled by sqrt(d_model)."),
    Family("olmo", ("olmo",), LLAMA_LIKE, notes="non-affine LayerNorm."),
    Family("phi3", ("phi3",), _sequential(values="self_attn.qkv_proj.output", values_layout="qkv"), notes="fused qkv_proj and gate_up_proj."),
    Family("smollm3", ("smollm3",), LLAMA_LIKE),
    Family("apertus", ("apertus",), _sequential(reads=("attention_layernorm", "feedforward_layernorm")),
           notes="xIELU MLP without a gate."),
    # Parallel blocks: attention and MLP read the same normed stream; both outputs are added.
    Family("gptj", ("gptj",), _sequential("out_proj", "fc_out", reads=("ln_1", "ln_1"), parallel=True),
           notes="parallel block; lm_head has a bias."),
    Family("gpt_neox", ("gpt_neox",), _sequential("dense", "dense_4h_to_h", parallel="use_parallel_residual",
                                                 values="self_attn.query_key_value.output", values_layout="per_head_qkv"),
           notes="parallel (use_parallel_residual) or sequential."),
    Family("phi", ("phi",), _sequential("dense", "fc2", reads=("input_layernorm", "input_layernorm"), parallel=True),
           rename={"ln_final_name": "final_layernorm"},
           notes="parallel block; lm_head has a bias; nnterp needs the final norm's name."),
    Family("cohere", ("cohere",), _sequential(reads=("input_layernorm", "input_layernorm"), parallel=True),
           logits_times="logit_scale", notes="parallel block; weight-only LayerNorm; logits times logit_scale."),
    # Sandwich and post-norm blocks: what is added is a post-norm's output.
    Family("gemma2", ("gemma2",), SANDWICH, softcap="final_logit_softcapping",
           notes="sandwich norms; final logits soft-capped."),
    Family("gemma3", ("gemma3_text", "gemma3"), SANDWICH, softcap="final_logit_softcapping", notes="sandwich norms."),
    Family("olmo2", ("olmo2",), POST_NORM_ONLY, notes="post-norm only."),
    Family("olmo3", ("olmo3",), POST_NORM_ONLY, notes="post-norm only."),
    Family("exaone4", ("exaone4",), POST_NORM_ONLY, notes="post-norm only."),
    Family("glm4", ("glm4",), _sequential(attn_post="post_self_attn_layernorm", mlp_post="post_mlp_layernorm"),
           notes="sandwich norms."),
    # Mixtures of experts (fused experts modules): one term per expert, and neurons inside the experts that fired.
    Family("mixtral", ("mixtral",), (LayerKind((ATTENTION, ROUTED)),)),
    Family("olmoe", ("olmoe",), (LayerKind((ATTENTION, ROUTED)),)),
    Family("qwen2_moe", ("qwen2_moe",), (LayerKind((ATTENTION, Term(
        "mlp", "mlp.output", "experts", "mlp.experts", shared="mlp.shared_expert.down_proj",
        shared_gate="mlp.shared_expert_gate", shared_first=True, reads="post_attention_layernorm"))),),
        notes="a shared expert gated by sigmoid(shared_expert_gate), run before the routed experts."),
    Family("deepseek_v3", ("deepseek_v3",), (
        LayerKind((MLA, Term("mlp", "mlp.output", "experts", "mlp.experts", shared="mlp.shared_experts.down_proj",
                             reads="post_attention_layernorm")),
                  when="mlp.experts"),
        LayerKind((MLA, DENSE_MLP)),
    ), notes="MLA attention (H x v_head_dim into o_proj); the first blocks are dense, the rest MoE + shared experts."),
    # --- Mixtures of experts with their own layouts (issue 12)
    Family("gpt_oss", ("gpt_oss",), (LayerKind((ATTENTION, Term(
        "mlp", "mlp.output", "experts", "mlp.experts", reads="post_attention_layernorm", layout=ExpertsLayout(
            transposed=("gate_up_proj", "down_proj"), gate_up_bias="gate_up_proj_bias", down_bias="down_proj_bias")),
    )),), notes="attention sinks; experts stored [in, out] with biases, gate/up interleaved and clamped (its own "
                "_apply_gate); each expert's down bias is part of that expert."),
    Family("aria_text", ("aria_text",), (LayerKind((ATTENTION, Term(
        "mlp", "mlp.output", "experts", "mlp.experts", shared="mlp.shared_experts.down_proj",
        reads="post_attention_layernorm", layout=ExpertsLayout(transposed=("gate_up_proj", "down_proj")))),
    ),), notes="experts stored [in, out]; shared experts run after the routed ones."),
    Family("llama4_text", ("llama4_text",), (LayerKind((
        ATTENTION,
        Term("mlp", "mlp.output", "experts", "mlp.experts", shared="mlp.shared_expert.down_proj", flat=True,
             reads="post_attention_layernorm", when="mlp.experts", layout=ExpertsLayout(
                 transposed=("gate_up_proj", "down_proj"), gating=None, scaled_inputs=True)),
        Term("mlp", "mlp.output", "neurons", "mlp.down_proj", reads="post_attention_layernorm", unless="mlp.experts"),
    )),), rename={"mlp_name": "feed_forward"}, load_kwargs={"check_renaming": False},
        notes="every expert runs on every token, its input pre-multiplied by the sigmoid router score (0: not "
              "routed); a shared expert; dense and MoE blocks interleave (optional terms); the MoE block's output is "
              "flat [tokens, d], which nnterp's renaming check refuses on a first MoE block, so it is skipped; "
              "attention temperature tuning reads absolute positions, so left padding changes a prompt's logits "
              "past floor_scale (8192) tokens."),
    Family("minimax_m3_vl_text", ("minimax_m3_vl_text",), (LayerKind((
        ATTENTION,
        Term("mlp", "mlp.output", "experts", "mlp.experts", shared="mlp.shared_experts.down_proj", shared_first=True,
             reads="post_attention_layernorm", when="mlp.experts",
             layout=ExpertsLayout(routed_scale="routed_scaling_factor")),
        Term("mlp", "mlp.output", "neurons", "mlp.down_proj", reads="post_attention_layernorm", unless="mlp.experts"),
    )),), notes="clamped SwiGLU experts without act_fn (their own _apply_gate); routed experts times "
                "routed_scaling_factor, plus a shared expert run first; dense and MoE blocks (optional terms)."),
    Family("cohere2_moe", ("cohere2_moe",), (LayerKind((
        Term("attn", "self_attn.output", "heads", "self_attn.o_proj", reads="input_layernorm"),
        Term("mlp", "mlp.output", "experts", "mlp.experts", shared="mlp.shared_experts.down_proj",
             reads="input_layernorm", parallel=True, when="mlp.experts",
             layout=ExpertsLayout(routed_scale=_cohere2_moe_mean, shared_scale=_cohere2_moe_mean)),
        Term("mlp", "mlp.output", "neurons", "mlp.down_proj", reads="input_layernorm", parallel=True,
             unless="mlp.experts"),
    )),), logits_times="logit_scale",
        notes="parallel block (one input_layernorm); routed and shared experts summed or averaged "
              "(shared_expert_combination_strategy); dense prefix blocks; logits times logit_scale."),
    Family("falcon_h1", ("falcon_h1",), (LayerKind((
        Term("mixer", "mamba.output", multiplier="ssm_out_multiplier", reads="input_layernorm"),
        Term("attn", "self_attn.output", "heads", "self_attn.o_proj", multiplier="attention_out_multiplier",
             reads="input_layernorm", parallel=True),
        Term("mlp", "mlp.down_proj.output", "neurons", "mlp.down_proj", multiplier="mlp_multipliers[1]",
             reads="pre_ff_layernorm"),
    )),), logits_times="lm_head_multiplier", rename={"ln_final_name": "final_layernorm", "mlp_name": "feed_forward"},
        notes="Mamba-2 mixer and attention side by side on one norm, each times its config multiplier; the MLP's "
              "down projection times mlp_multipliers[1]; embedding times embedding_multiplier; logits times "
              "lm_head_multiplier."),
    Family("dbrx", ("dbrx",), (LayerKind((
        Term("attn", "norm_attn_norm.attn.output", "heads", "norm_attn_norm.attn.out_proj", reads="norm_attn_norm.norm_1"),
        Term("mlp", "mlp.output", "experts", "mlp.experts", reads="norm_attn_norm.norm_2", layout=ExpertsLayout(
            gate_up=None, gate="mlp.w1", up="mlp.v1", down="mlp.w2", transposed=("mlp.w2",), gating=None,
            activation="mlp.activation_fn")),
    )),), notes="separate flattened w1 / v1 / w2 expert weights [E * I, d] (w2 used as [in, out]); the attention "
                "sits inside norm_attn_norm (nnterp's self_attn) with both norms."),
    # Gates and scalars on the stream itself.
    Family("doge", ("doge",), (LayerKind((
        Term("attn", "self_attn.output", "heads", "self_attn.o_proj", stream_scale="input_residual",
             reads="input_layernorm", values="self_attn.v_proj.output"),
        Term("mlp", "mlp.output", "neurons", "mlp.down_proj", stream_scale="post_attention_residual",
             reads="post_attention_layernorm"),
    )),), notes="per-channel residual gates: mid = input_residual * x + attn; out = post_attention_residual * mid + mlp."),
    Family("zaya", ("zaya",), (LayerKind((
        Term("attn", "self_attn.output", "heads", "self_attn.o_proj",
             scale="post_attention_residual_scale.hidden_states_scale",
             bias="post_attention_residual_scale.hidden_states_bias",
             stream_scale="post_attention_residual_scale.residual_scale",
             stream_bias="post_attention_residual_scale.residual_bias", reads="input_layernorm"),
        Term("mlp", "mlp.output", "experts", "mlp.experts",
             scale="post_mlp_residual_scale.hidden_states_scale",
             bias="post_mlp_residual_scale.hidden_states_bias",
             stream_scale="post_mlp_residual_scale.residual_scale",
             stream_bias="post_mlp_residual_scale.residual_bias", reads="post_attention_layernorm"),
    )),), notes="each merge is (h + hb) * hs + (stream + rb) * rs (ZayaResidualScaling); MoE MLP."),
    Family("gemma4", ("gemma4_text", "gemma4"), (LayerKind((
        Term("attn", "post_attention_layernorm.output", "heads", "self_attn.o_proj", post_norm="post_attention_layernorm",
             reads="input_layernorm", values="self_attn.v_norm.output"),
        Term("mlp", "post_feedforward_layernorm_1.output", "neurons", "mlp.down_proj",
             post_norm="post_feedforward_layernorm_1", outer_norm="post_feedforward_layernorm",
             reads="pre_feedforward_layernorm", when="experts"),
        Term("mlp", "post_feedforward_layernorm.output", "neurons", "mlp.down_proj", post_norm="post_feedforward_layernorm",
             reads="pre_feedforward_layernorm", unless="experts"),
        Term("experts", "post_feedforward_layernorm_2.output", "experts", "experts",
             post_norm="post_feedforward_layernorm_2", outer_norm="post_feedforward_layernorm",
             reads="pre_feedforward_layernorm_2", parallel=True, when="experts"),
        Term("ple", "post_per_layer_input_norm.output", when="per_layer_input_gate"),
    )),), layer_scale="layer_scalar", softcap="final_logit_softcapping", logits_to_keep=False,
        notes="sandwich norms; the whole stream times layer_scalar after each block; optional terms: the MoE "
              "variant adds experts beside the MLP, both under post_feedforward_layernorm, and a per-layer-input "
              "branch (ple) follows where the model has per-layer inputs; given logits_to_keep, its KV-shared layers "
              "run on the kept positions only, so the whole sequence is kept."),
    # Hybrids: recurrent mixers beside (or instead of) attention.
    Family("recurrent_gemma", ("recurrent_gemma",), (
        LayerKind((Term("attn", "self_attn.output", "heads", "self_attn.o_proj", reads="temporal_pre_norm"),
                   Term("mlp", "mlp.output", "neurons", "mlp.down_proj", reads="channel_pre_norm")), when="self_attn.o_proj"),
        LayerKind((Term("mixer", "self_attn.output", reads="temporal_pre_norm"),
                   Term("mlp", "mlp.output", "neurons", "mlp.down_proj", reads="channel_pre_norm"))),
    ), softcap="logits_soft_cap", padding_safe=False,
        rename={"ln_final_name": "final_norm", "attn_name": "temporal_block", "mlp_name": "mlp_block"},
        notes="local attention and RG-LRU blocks (temporal_block); embedding times a bfloat16 normalizer; logits soft-capped."),
    Family("zamba2", ("zamba2",), (
        LayerKind((Term("mixer", "mamba_decoder.mamba.output"),), when="mamba_decoder"),
        LayerKind((Term("mixer", "mamba.output", reads="input_layernorm"),)),
    ), rename={"attn_name": ["mamba", "mamba_decoder.mamba"], "ln_final_name": "final_layernorm", "ignore_mlp": True},
        load_kwargs={"allow_multimodal": True},
        notes="Mamba-2 mixers; hybrid blocks feed a shared transformer's output into the mixer, whose output is the "
              "block's only write."),
    Family("jetmoe", ("jetmoe",), (LayerKind((
        Term("attn", "self_attn.output", "heads", "self_attn.experts.output_linear",
             router="self_attn.experts.router", projection_bias="self_attn.experts.bias", reads="input_layernorm"),
        Term("mlp", "mlp.output", "experts", "mlp.output_linear", router="mlp.router", projection_bias="mlp.bias",
             reads="post_attention_layernorm"),
    )),), notes="mixture of attention (each token routes to top-k attention experts, each owning a group of heads) "
                "and a mixture of experts MLP, both ScatterMoE-style grouped experts."),
    Family("deepseek_v4", ("deepseek_v4",), (LayerKind((
        Term("attn", "self_attn.output", "heads", "self_attn.o_a_proj", then="self_attn.o_b_proj", hyper="attn_hc"),
        Term("mlp", "mlp.output", "experts", "mlp.experts", shared="mlp.shared_experts.down_proj", hyper="ffn_hc"),
    )),), collapse="model.hc_head", collapse_weights=hyper_head_weights, load_kwargs={"check_renaming": False},
        padding_safe=False,
        notes="hc_mult parallel residual streams mixed by input-dependent hyper-connections (post, comb) and "
              "collapsed by hc_head; grouped low-rank output projection (o_a_proj, then o_b_proj); clamped-SwiGLU experts."),
    # --- New term kinds (issue 12): computed scalars, norms on the stream itself, norms without weights
    Family("minicpm3", ("minicpm3",), _sequential(multiplier=depth_scale), head_input_over="logits_scaling",
           notes="MLA attention; writes times scale_depth / sqrt(layers) (a computed scalar); embedding times "
                 "scale_emb; the final norm's output over hidden_size / dim_model_base."),
    Family("beam", ("beam",), tuple(
        LayerKind((
            Term("attn", "post_attention_layernorm.output", "heads", "self_attn.o_proj",
                 post_norm="post_attention_layernorm", multiplier=beam_write(0),
                 stream_multiplier=beam_stream(0), reads="input_layernorm"),
            Term("mlp", "post_feedforward_layernorm.output", split, f"mlp.{projection}",
                 post_norm="post_feedforward_layernorm", multiplier=beam_write(1), stream_multiplier=beam_stream(1),
                 projection_multiplier=scaling, reads="pre_feedforward_layernorm"),
        ), when=when)
        for when, split, projection, scaling in (("mlp.experts", "experts", "experts", "routed_scaling_factor"),
                                                 (None, "neurons", "down_proj", None))
    ), softcap="final_logit_softcapping", load_kwargs={"check_renaming": False},
        notes="sandwich norms; each add is depth-scaled: stream * sqrt((n - 1) / n) + write / sqrt(n) for the n-th "
              "add (computed scalars); experts' sum times routed_scaling_factor before the post-norm."),
    Family("minimax", ("minimax",), tuple(
        LayerKind((
            Term("attn", "self_attn.output", "heads", f"self_attn.{projection}", multiplier=f"{kind}_attn_beta_factor",
                 stream_multiplier=f"{kind}_attn_alpha_factor", stream_norm="input_layernorm", reads="input_layernorm"),
            Term("mlp", "mlp.output", "experts", "mlp.experts", multiplier="mlp_beta_factor",
                 stream_multiplier="mlp_alpha_factor", stream_norm="post_attention_layernorm",
                 reads="post_attention_layernorm"),
        ), when=f"self_attn.{projection}")
        for projection, kind in (("o_proj", "full"), ("out_proj", "linear"))
    ), load_kwargs={"check_renaming": False},
        notes="the residual is the normed stream: stream <- norm(stream) * alpha + write * beta (norms on the stream "
             "itself); lightning (linear) attention on some blocks, softmax attention on the others; MoE MLP."),
    Family("nanochat", ("nanochat",), _sequential("o_proj", "fc2"), softcap="final_logit_softcapping",
           final_norm="shared", load_kwargs={"check_renaming": False},
           notes="RMSNorms without weights (probed at the stream's width); the final norm module also norms the "
                 "embedding before the blocks; relu^2 MLP (fc1, fc2); logits soft-capped."),
    Family("hy_v4", ("hy_v4",), (
        LayerKind((
            Term("attn", "self_attn.output", "heads", "self_attn.o_proj", hyper="attn_hc"),
            Term("mlp", "mlp.output", "experts", "mlp.experts", shared="mlp.shared_experts.down_proj", hyper="ffn_hc"),
        ), when="mlp.experts"),
        LayerKind((
            Term("attn", "self_attn.output", "heads", "self_attn.o_proj", hyper="attn_hc"),
            Term("mlp", "mlp.output", "neurons", "mlp.down_proj", hyper="ffn_hc"),
        )),
    ), collapse="model.hc_head", collapse_weights=hy_head_weights, load_kwargs={"check_renaming": False},
        padding_safe=False,
        notes="hc_mult parallel residual streams (DeepSeek-V4's machinery without the comb mixing: each sublayer "
              "reads a weighted sum of the streams and writes into stream k times post[k]); collapsed by hc_head; "
              "MLA attention; dense or MoE + shared experts with a clamped SwiGLU."),
    Family("inkling", ("inkling_text",), (
        LayerKind((INKLING_ATTENTION, Term("mlp", "mlp_sconv.output", reads="post_attention_layernorm")),
                  when="mlp.experts"),
        LayerKind((INKLING_ATTENTION, Term("mlp", "mlp_sconv.output", "neurons", "mlp.down_proj",
                                           position_conv="mlp_sconv", projection_scale="mlp.global_scale",
                                           reads="post_attention_layernorm"))),
    ), head_input_over="logits_mup_width_multiplier", load_kwargs={"check_renaming": False},
        notes="each sublayer's output x is added as x + causal_conv(x) over positions (a position convolution: "
              "heads and neurons are read at the K last positions); the MoE blocks' experts (a bmm shared-expert "
              "layout) are not split; lm_head reads the final norm's output over the mup width."),
    Family("openai-gpt", ("openai-gpt",), (LayerKind((
        Term("attn", "self_attn.output", "heads", "self_attn.c_proj", stream_norm_after="ln_1"),
        Term("mlp", "mlp.output", "neurons", "mlp.c_proj", stream_norm_after="ln_2"),
    )),), final_norm="none", load_kwargs={"check_renaming": False},
        notes="post-norm blocks: the stream is normed right after each add (ln_1, ln_2); no final norm (lm_head "
              "reads the last block's output); Conv1D weights; learned positions in embed."),
    Family("rwkv", ("rwkv",), (
        LayerKind((Term("attn", "attention.output", stream_norm="pre_ln", reads="ln1"), RWKV_CHANNEL_MIX), when="pre_ln"),
        LayerKind((Term("attn", "attention.output", reads="ln1"), RWKV_CHANNEL_MIX)),
    ), padding_safe=False, rename={"model_name": "rwkv", "ln_final_name": "ln_out", "lm_head_name": "head",
                                   "attn_name": "attention", "mlp_name": "feed_forward"},
        load_kwargs={"check_renaming": False},
        notes="RWKV-4 time mixing (no heads: one term) and channel mixing (neurons: value's input, its output gated "
              "by sigmoid(receptance)); block 0 norms the embedding (pre_ln, a norm on the stream itself)."),
    # Scaled writes.
    Family("granite", ("granite",), _sequential(multiplier="residual_multiplier"), logits_over="logits_scaling",
           notes="writes times residual_multiplier; embedding times embedding_multiplier; logits over logits_scaling."),
    # Modules that add the residual inside themselves, in-place adds, sublayers outside a module.
    Family("bloom", ("bloom",), (LayerKind((
        Term("attn", "self_attn.dense.output", "heads", "self_attn.dense", reads="input_layernorm",
             values="self_attn.query_key_value.output", values_layout="per_head_qkv"),
        Term("mlp", "mlp.dense_4h_to_h.output", "neurons", "mlp.dense_4h_to_h", reads="post_attention_layernorm"),
    )),), notes="modules add the residual inside: the terms are the dense projections' outputs."),
    Family("falcon", ("falcon",), (
        LayerKind((  # new decoder architecture, two norms
            Term("attn", "self_attn.output", "heads", "self_attn.dense", reads="ln_attn"),
            Term("mlp", "mlp.output", "neurons", "mlp.dense_4h_to_h", clone=True, reads="ln_mlp", parallel=True),
        ), when="ln_mlp"),
        LayerKind((  # sequential (parallel_attn=False)
            Term("attn", "self_attn.output", "heads", "self_attn.dense", reads="input_layernorm"),
            Term("mlp", "mlp.output", "neurons", "mlp.dense_4h_to_h", reads="post_attention_layernorm"),
        ), when="post_attention_layernorm"),
        LayerKind((  # parallel, one norm
            Term("attn", "self_attn.output", "heads", "self_attn.dense", reads="input_layernorm"),
            Term("mlp", "mlp.output", "neurons", "mlp.dense_4h_to_h", clone=True, reads="input_layernorm", parallel=True),
        )),
    ), notes="parallel: the block adds the attention output into the MLP output in place (the MLP term is a copy)."),
    Family("opt", ("opt",), (LayerKind((
        Term("attn", "self_attn.output", "heads", "self_attn.out_proj", reads="self_attn_layer_norm",
             values="self_attn.v_proj.output"),
        Term("mlp", "fc2.output", "neurons", "fc2", flat=True, reads="final_layer_norm"),
    )),), notes="fc1/fc2 sit on the block (nnterp finds no MLP module)."),
    # --- Families described by the shapes above (issue 12) -------------------------------------------------------
    Family("llama_like", (
        "arcee", "bitnet", "cwm", "diffllama", "ernie4_5", "exaone", "glm", "helium", "hunyuan_v1_dense", "internlm3",
        "iquestcoder", "jais2", "ministral", "ministral3", "nemotron", "seed_oss", "stablelm", "youtu",
    ), LLAMA_LIKE, notes="pre-norm attention then MLP, each module's output added (norms, MLP activations, "
                         "attention variants such as MLA, differential or sliding-window attention differ)."),
    Family("gpt_bigcode", ("gpt_bigcode",), _sequential("c_proj", "c_proj", reads=("ln_1", "ln_2")),
           notes="multi-query attention; learned positions in embed."),
    Family("gpt_neo", ("gpt_neo",), _sequential("attention.out_proj", "c_proj", reads=("ln_1", "ln_2")),
           notes="local and global attention layers; learned positions in embed."),
    Family("starcoder2", ("starcoder2",), _sequential("o_proj", "c_proj"), notes="LayerNorm with biases."),
    Family("persimmon", ("persimmon",), _sequential("dense", "dense_4h_to_h"), rename={"ln_final_name": "final_layernorm"},
           notes="squared-ReLU MLP, qk LayerNorm; nnterp needs the final norm's name."),
    Family("codegen", ("codegen",), _sequential("out_proj", "fc_out", reads=("ln_1", "ln_1"), parallel=True),
           notes="parallel block (GPT-J layout); lm_head has a bias."),
    Family("xglm", ("xglm",), (OPT_LIKE,),
           rename={"ln_final_name": "layer_norm", "ignore_mlp": True, "attn_head_config_key": "attention_heads"},
           notes="OPT layout: fc1/fc2 sit on the block; embeddings scaled by sqrt(d_model), sinusoidal positions."),
    Family("biogpt", ("biogpt",), (OPT_LIKE,),
           rename={"model_name": "biogpt", "layers_name": "biogpt.layers", "ln_final_name": "biogpt.layer_norm",
                   "lm_head_name": "output_projection", "ignore_mlp": True},
           notes="OPT layout: fc1/fc2 sit on the block; embeddings scaled by sqrt(d_model), learned positions."),
    Family("cohere2", ("cohere2", "cohere_compass_text"),
           _sequential(reads=("input_layernorm", "input_layernorm"), parallel=True), logits_times="logit_scale",
           notes="parallel block; sliding-window and global layers; logits times logit_scale."),
    Family("vaultgemma", ("vaultgemma",), _sequential(reads=("input_layernorm", "pre_feedforward_layernorm")),
           softcap="final_logit_softcapping", notes="Gemma without post-norms; final logits soft-capped."),
    Family("apertus1p5", ("apertus1p5_text",), _sequential(reads=("attention_layernorm", "feedforward_layernorm")),
           notes="xIELU MLP without a gate."),
    Family("granite_swa", ("granite_swa",), _sequential(multiplier="residual_multiplier"),
           logits_over="logits_scaling", notes="Granite with sliding-window layers."),
    Family("hyperclovax", ("hyperclovax",), (
        LayerKind(_sequential(attn_post="post_norm1", mlp_post="post_norm2", multiplier="residual_multiplier")[0].terms,
                  when="post_norm1.weight"),
        _sequential(multiplier="residual_multiplier")[0],
    ), logits_times="logits_scaling",
        notes="optional post-norms (use_post_norm); writes times residual_multiplier; logits *times* logits_scaling."),
    Family("gemma4_unified", ("gemma4_unified_text",), SANDWICH, layer_scale="layer_scalar",
           softcap="final_logit_softcapping", logits_to_keep=False,
           notes="sandwich norms; the whole stream times layer_scalar after each block; KV-shared layers."),
    Family("mpt", ("mpt",), (LayerKind((
        Term("attn", "self_attn.output", "heads", "self_attn.out_proj", reads="norm_1"),
        Term("mlp", "mlp.down_proj.output", "neurons", "mlp.down_proj", reads="norm_2"),
    )),), notes="ALiBi; the MLP adds the residual inside: the term is down_proj's output."),
    Family("ctrl", ("ctrl",), (LayerKind((
        Term("attn", "self_attn.output", "heads", "self_attn.dense", reads="layernorm1"),
        Term("mlp", "mlp.output", "neurons", "mlp.2", reads="layernorm2"),
    )),), rename={"attn_name": "multi_head_attention", "ln_final_name": "layernorm"},
        load_kwargs={"check_renaming": False},
        notes="sinusoidal positions; embeddings scaled by sqrt(d_model); MLP is a Sequential (mlp.2 = down)."),
    Family("gpt_neox_japanese", ("gpt_neox_japanese",), tuple(
        LayerKind((Term("attn", "self_attn.output", "heads", "self_attn.dense", bias=bias, reads="input_layernorm"),
                   Term("mlp", "mlp.output", "neurons", "mlp.dense_4h_to_h", reads="post_attention_layernorm")),
                  when=bias)
        for bias in ("self_attn.dense_bias", None)
    ), rename={"model_name": "gpt_neox_japanese"},
        notes="the attention returns its output projection's bias (last block only) for the block to add: the term "
             "is the attention output plus that bias."),
    # Mixtures of experts: a routed experts module, optionally a shared expert beside it, the first blocks dense.
    Family("moe", (
        "qwen3_moe", "phimoe", "minimax_m2", "mellum", "deepseek_v2", "glm4_moe", "glm4_moe_lite", "dots1",
        "exaone_moe", "solar_open", "sarvam_mla", "sarvam_moe", "hy_v3", "mimo_v2_flash",
    ), _moe_kinds(), notes="routed experts (fused module), an ungated shared expert where the block has one, dense "
                           "first blocks."),
    Family("moe_shared_first", ("ernie4_5_moe", "hunyuan_v1_moe"), _moe_kinds(shared_first=True),
           notes="routed experts, a shared expert computed before them, dense first blocks."),
    Family("dsa_moe", ("deepseek_v32", "glm_moe_dsa", "axk2"), _moe_kinds(), padding_safe=False,
           notes="DeepSeek sparse attention: a lightning indexer picks each query's top-k keys; routed + shared "
                 "experts. Declared padding-unsafe: axk2's tiny model moves 1% padded, and issue 12 measured "
                 "deepseek_v32 / glm_moe_dsa padded logits 3% / 2.6% off."),
    Family("axk1", ("axk1",), _moe_kinds(post_norm="mlp.post_mlp_layernorm"),
           notes="MLA attention; routed + shared experts under a norm inside the MoE module (post_mlp_layernorm)."),
    Family("kimi_linear", ("kimi_linear", "bailing_hybrid"),
           _moe_kinds(mixer=(Term("mixer", "self_attn.output", reads="input_layernorm"), "self_attn.forget_gate")),
           padding_safe=False,
           notes="Kimi delta attention (block level) beside MLA attention; routed + shared experts. Recurrent state: "
                 "declared padding-unsafe."),
    Family("flex_olmo", ("flex_olmo",), (LayerKind((
        Term("attn", "post_attention_layernorm.output", "heads", "self_attn.o_proj",
             post_norm="post_attention_layernorm"),
        Term("mlp", "post_feedforward_layernorm.output", "experts", "mlp.experts",
             post_norm="post_feedforward_layernorm"),
    )),), notes="OLMo-2 post-norms around attention and routed experts."),
    Family("afmoe", ("afmoe",), (
        LayerKind((
            Term("attn", "post_attention_layernorm.output", "heads", "self_attn.o_proj",
                 post_norm="post_attention_layernorm", reads="input_layernorm"),
            Term("mlp", "post_mlp_layernorm.output", "experts", "mlp.experts", post_norm="post_mlp_layernorm",
                 shared="mlp.shared_experts.down_proj", shared_first=True, reads="pre_mlp_layernorm"),
        ), when="mlp.experts"),
        _sequential(attn_post="post_attention_layernorm", mlp_post="post_mlp_layernorm",
                    reads=("input_layernorm", "pre_mlp_layernorm"))[0],
    ), notes="sandwich norms; gated attention; routed + shared experts after dense first blocks."),
    Family("kolibri1", ("kolibri1",), (
        LayerKind((
            Term("attn", "post_self_attn_layernorm.output", "heads", "self_attn.o_proj",
                 post_norm="post_self_attn_layernorm", reads="input_layernorm"),
            Term("mlp", "post_mlp_layernorm.output", "experts", "mlp.experts", post_norm="post_mlp_layernorm",
                 shared="mlp.shared_experts.down_proj", reads="post_attention_layernorm"),
        ), when="mlp.experts"),
        _sequential(attn_post="post_self_attn_layernorm", mlp_post="post_mlp_layernorm")[0],
    ), notes="sandwich norms; routed + shared experts."),
    Family("qwen3_next", ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "lara_mini"), _QWEN_NEXT_KINDS,
           rename={"attn_name": "linear_attn"}, padding_safe=False,
           notes="gated-DeltaNet linear attention (block-level: its heads are not the attention heads) beside full "
                 "attention; dense MLP or routed experts with a (sigmoid-gated) shared expert. Recurrent and "
                 "convolution state: declared padding-unsafe (the tiny model's CPU path masks the pads)."),
    Family("flint", ("flint",), _QWEN_NEXT_KINDS, rename={"attn_name": "linear_attn"},
           notes="Qwen3-Next blocks with sliding-window and full attention only; routed experts with a sigmoid-gated "
                 "shared expert."),
    # Granite mixtures of experts: every write times residual_multiplier, logits over logits_scaling.
    Family("granitemoe", ("granitemoe", "granitemoe_swa", "granitemoeshared"), _granite_moe_kinds(),
           logits_over="logits_scaling",
           notes="routed experts (block_sparse_moe), a shared MLP beside them where the block has one; Granite "
                 "multipliers."),
    Family("granitemoehybrid", ("granitemoehybrid",), _granite_moe_kinds(), logits_over="logits_scaling",
           load_kwargs={"check_renaming": False}, padding_safe=False,
           notes="Mamba-2 mixers beside attention; routed experts and a shared MLP; Granite multipliers; recurrent "
                 "state: declared padding-unsafe."),
    # State-space and recurrent mixers (the mixer is one block-level term: its state mixes every position).
    Family("mamba", ("mamba", "mamba2", "falcon_mamba"),
           (LayerKind((Term("mixer", "self_attn.output", reads="norm"),)),),
           rename={"attn_name": "mixer", "ignore_mlp": True, "model_name": "backbone"},
           load_kwargs={"check_renaming": False}, padding_safe=False,
           notes="one Mamba mixer per block; recurrent state: declared padding-unsafe."),
    Family("nemotron_h", ("nemotron_h",), (
        LayerKind((Term("attn", "self_attn.output", "heads", "self_attn.o_proj", reads="norm"),),
                  when="self_attn.o_proj"),
        LayerKind((Term("mlp", "self_attn.output", reads="norm"),), when="self_attn.experts"),
        LayerKind((Term("mlp", "self_attn.output", "neurons", "self_attn.down_proj", reads="norm"),),
                  when="self_attn.down_proj"),
        LayerKind((Term("mixer", "self_attn.output", reads="norm"),)),
    ), rename={"attn_name": "mixer", "ignore_mlp": True}, load_kwargs={"check_renaming": False}, padding_safe=False,
        notes="one mixer per block: Mamba-2, attention, MLP or routed + shared experts (block level: its experts "
              "have no gate, a layout the expert split does not read yet); recurrent state: declared padding-unsafe."),
    Family("zamba", ("zamba",), (
        LayerKind((Term("mixer", "mamba_decoder.mamba.output"),), when="mamba_decoder"),
        LayerKind((Term("mixer", "mamba.output", reads="input_layernorm"),)),
    ), rename={"attn_name": ["mamba", "mamba_decoder.mamba"], "ln_final_name": "final_layernorm", "ignore_mlp": True},
        load_kwargs={"allow_multimodal": True}, padding_safe=False,
        notes="Zamba-2 layout: hybrid blocks feed a shared transformer's output into the Mamba mixer, whose output is "
              "the block's only write; recurrent state: declared padding-unsafe."),
    Family("jamba", ("jamba", "bamba"), _moe_kinds(
        mixer=(Term("mixer", "self_attn.output", reads="input_layernorm"), "self_attn.out_proj"),
        mlp_reads="pre_ff_layernorm"),
        rename={"attn_name": "mamba", "mlp_name": "feed_forward", "ln_final_name": "final_layernorm"},
        load_kwargs={"allow_multimodal": True}, padding_safe=False,
        notes="Mamba mixers beside attention, a dense MLP or routed experts after each; recurrent state: declared "
              "padding-unsafe."),
    Family("lfm2", ("lfm2", "lfm2_moe"), _moe_kinds(
        attention=Term("attn", "self_attn.output", "heads", "self_attn.out_proj", reads="operator_norm"),
        mixer=(Term("mixer", "self_attn.output", reads="operator_norm"), "self_attn.conv"),
        mlp_reads="ffn_norm", down="w2"),
        rename={"attn_name": "conv", "mlp_name": "feed_forward"}, load_kwargs={"allow_multimodal": True},
        padding_safe=False,
        notes="short causal convolutions beside attention; dense (w1/w3/w2) or routed experts; the convolution's "
              "state reads the pads: declared padding-unsafe."),
    Family("lfm3", ("lfm3",), tuple(
        LayerKind((mixer, Term("mlp", "post_ffn_norm.output", "neurons", "mlp.w2", post_norm="post_ffn_norm",
                               reads="ffn_norm")), when=when)
        for mixer, when in (
            (Term("mixer", "post_operator_norm.output", post_norm="post_operator_norm", reads="operator_norm"),
             "self_attn.conv"),
            (Term("attn", "post_operator_norm.output", "heads", "self_attn.o_proj", post_norm="post_operator_norm",
                  reads="operator_norm"), None),
        )
    ), rename={"attn_name": "conv", "mlp_name": "feed_forward"}, load_kwargs={"allow_multimodal": True},
        padding_safe=False,
        notes="LFM2 with sandwich norms (post_operator_norm, post_ffn_norm); convolutions: declared padding-unsafe."),
    Family("olmo_hybrid", ("olmo_hybrid",), (
        LayerKind((Term("mixer", "self_attn.output", reads="input_layernorm"),
                   Term("mlp", "mlp.output", "neurons", "mlp.down_proj", reads="post_attention_layernorm")),
                  when="input_layernorm"),
        POST_NORM_ONLY[0],
    ), rename={"attn_name": "linear_attn"}, load_kwargs={"allow_multimodal": True}, padding_safe=False,
        notes="gated-DeltaNet blocks (pre-norm) beside OLMo-3 attention blocks (post-norm only); recurrent state: "
              "declared padding-unsafe."),
    Family("xlstm", ("xlstm",), (LayerKind((
        Term("mixer", "self_attn.output", reads="norm_mlstm"),
        Term("mlp", "mlp.output", "neurons", "mlp.proj_down", reads="norm_ffn"),
    )),), rename={"attn_name": "mlstm_layer", "model_name": "backbone", "ln_final_name": "out_norm"},
        load_kwargs={"check_renaming": False}, padding_safe=False, softcap="output_logit_soft_cap",
        notes="mLSTM mixer (block level) and a gated MLP per block; logits soft-capped; recurrent state: "
              "padding-unsafe (measured: a padded prompt's logits move)."),
)


# Decoder model types dla_recipes knows and refuses: model type -> why no entry can be exact yet (what is missing).
# ``family_of`` raises ``UnknownFamilyError`` naming the reason; the generated families page lists them.
REFUSED: dict[str, str] = {
    "laguna": "its MoE multiplies the routed experts' sum by moe_routed_scaling_factor after the experts module and "
              "before adding the shared expert; the expert split has no term for that factor yet",
    "dots3_note_text": "its config gives the number of attention heads per layer (per_layer_config), which the "
                       "head split does not read yet",
    "longcat_flash": "each block holds two attention sublayers and two MLPs (ModuleLists) plus a shortcut MoE "
                     "added at the block's end, whose zero-computation (identity) experts add their input; no term "
                     "kind reads ModuleList sublayers or identity experts yet",
}


def family_of(model_or_config) -> Family:
    """The ``Family`` entry for a model (a StandardizedTransformer, a transformers model) or its config."""
    config = getattr(model_or_config, "config", model_or_config)
    config = getattr(config, "text_config", None) or config
    model_type = getattr(config, "model_type", None)
    for family in FAMILIES:
        if model_type in family.model_types:
            return family
    if model_type in REFUSED:
        raise UnknownFamilyError(
            f"dla_recipes refuses model_type {model_type!r}: {REFUSED[model_type]}. It cannot promise exact "
            "attributions for it, so it returns none."
        )
    known = ", ".join(sorted(t for f in FAMILIES for t in f.model_types))
    raise UnknownFamilyError(
        f"dla_recipes has no family entry for model_type {model_type!r} ({type(model_or_config).__name__}). "
        f"Known model types: {known}. To add one, describe what its blocks add to the residual stream as a "
        "`Family` entry in dla_recipes/families.py (usually one line: see the module docstring) and add a tiny "
        "model for it in dla_recipes/testing/tiny.py; the test suite then checks it against the model's own logits."
    )


# --- Refusals for the new term kinds (issue 12): decoder types whose writes no term kind describes exactly.
REFUSED.update({
    "dory": "its recurrent section calls the same decoder layers n_loops times in one forward and re-adds the "
            "normed input section's output between loops, outside any block; its blocks replace the stream by an "
            "interpolation (1 - a) * norm(stream) + a * norm(write) and its lm_head scales each token's logit by a "
            "learned per-token factor: a block is not one call, so its terms cannot be read once each.",
    "gemma3n_text": "AltUp keeps several streams: each block predicts every stream from all of them with "
                    "coefficients computed from the stream, runs its sublayers on the active prediction (merging "
                    "attention with a LAuReL branch as (attn + laurel) / sqrt(2)), then corrects every stream by "
                    "coefficients times (the block's output minus the active prediction), so the stream itself re-"
                    "enters through what the block writes; the final collapse rescales each stream to the active "
                    "stream's magnitude (not linear in the streams).",
    "qwen4_exp_text": "its streams are collapsed by hyper_connection_mixer: a mean over the streams of each stream "
                      "RMS-normed on its own and gated channel by channel by an input-dependent sigmoid, so each "
                      "stream is read along its own direction; the parallel-stream kind reads every stream along one "
                      "direction with a scalar weight per stream (its gated residuals otherwise fit: the writes go "
                      "into every stream times injection_weights, like HY-V4).",
    "inkling2_text": "each sublayer reads a softmax-weighted mixture over all earlier blocks' outputs (block attention "
                     "residuals, input-dependent mixing over depth) and its output passes through a causal "
                     "convolution over positions: no term kind reads mixing over depth.",
    "inkling2_loop_text": "as inkling2_text (attention over earlier blocks' outputs, convolutions over positions), and "
                          "its blocks run in loops: no term kind reads mixing over depth.",
    "reformer": "reversible residual layers: attention writes one half-stream and the chunked feed-forward the other "
                "(y1 = x1 + attn(x2), y2 = x2 + ffn(y1)), and the final norm reads their concatenation "
                "(2 * hidden_size); no term kind describes two half-streams, and nnterp finds no layers.",
    "cpmant": "the model prepends prompt_length learned prompt tokens (and a segment embedding) inside its forward, "
              "so its blocks run on a longer sequence than the input and an attributed position is a different "
              "index inside them; its blocks add the residual inside their attention and FFN sub-blocks.",
})


def text_config(model_or_config):
    """The text model's config of a model (``.config``) or of a config: its ``text_config`` where it has one."""
    config = getattr(model_or_config, "config", model_or_config)
    return getattr(config, "text_config", None) or config
