"""The schema of the family table: ``Term``, ``LayerKind``, ``Family`` and ``ExpertsLayout``, as frozen dataclasses.

What the fields answer (the three questions the attribution math asks of a family) is the package docstring of
``dla_recipes.families``; the entries themselves are in ``dense.py``, ``experts.py`` and ``hybrid.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

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
    """Everything dla_recipes knows about one decoder family. See the package docstring (``dla_recipes.families``).

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
