"""The schema of the family table: ``Term``, ``LayerKind``, ``Family`` and ``ExpertsLayout``, as frozen dataclasses.

A ``Term`` holds small typed records rather than flat optional fields, so an impossible combination cannot be
written: ``write`` (a ``Write``: how the added tensor is read and scaled), ``stream`` (a ``Stream``: what acts on the
stream itself) and ``split`` (None, or one of ``Heads``, ``Neurons``, ``Experts``, ``Routed``, each with the fields
only that split uses). Fields holding a path below the block envoy carry ``PATH`` metadata (``Term.paths``).

What the fields answer (the three questions the attribution math asks of a family) is the package docstring of
``dla_recipes.families``; the entries themselves are in ``dense.py``, ``experts.py`` and ``hybrid.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Literal

PATH = {"path": True}  # field metadata: a path below the block envoy, checked to exist when the plan is built


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


def path(default=None):
    """A dataclass field holding a path below the block envoy (``PATH`` metadata: ``plan.build`` checks it exists)."""
    return field(default=default, metadata=PATH)


@dataclass(frozen=True)
class Write:
    """How the added tensor is read and scaled: ``write = (outer_norm(read(output)) + bias) * scale * multiplier``,
    where ``read(output)`` is ``post_norm(projection(projection.input))`` when those are given.

    Attributes:
        post_norm: a norm between ``projection`` and ``output`` (sandwich / post-norm families).
        outer_norm: a norm applied after ``output``, to the sum of this and the block's other terms that name it
            (Gemma-4's ``post_feedforward_layernorm`` over its dense MLP and its experts).
        multiplier: a config attribute the write is multiplied by (Granite's ``residual_multiplier``); an item of a
            config list is ``"name[i]"`` (Falcon-H1's ``mlp_multipliers[1]``); or a computed scalar: a function
            ``(config, layer_index) -> float`` (MiniCPM3's ``scale_depth / sqrt(layers)``).
        scale, bias: parameter paths of an affine merge, ``(h + bias) * scale`` (ZAYA).
        clone: the model later edits this tensor in place (Falcon's ``mlp_output += attention_output``).
        flat: the module sees batch and position flattened, ``[batch * pos, ...]`` (OPT's ``fc1`` / ``fc2``).
    """

    post_norm: str | None = path()
    outer_norm: str | None = path()
    multiplier: str | Callable | None = None
    scale: str | None = path()
    bias: str | None = path()
    clone: bool = False
    flat: bool = False


@dataclass(frozen=True)
class Stream:
    """What acts on the stream itself as the term is added: the stream after the term is
    ``norm_after((norm(stream) + bias) * scale * multiplier + write)``.

    Attributes:
        scale, bias: parameter paths acting on the stream as this term is added (Doge, ZAYA).
        multiplier: a scalar the stream is multiplied by as this term is added (a config attribute, or a function
            ``(config, layer_index) -> float``): MiniMax's ``alpha``, Beam's depth-scaled residual.
        norm: a norm applied to the stream itself before this term is added, whose output is the stream the later
            terms add onto (MiniMax's ``input_layernorm``, RWKV's embedding norm in block 0). It is frozen at its real
            input: a linear map ``gain * center(x) * scale + bias`` that carries every earlier term.
        norm_after: a norm applied to the stream right after this term is added (post-norm blocks: OpenAI GPT's
            ``ln_1`` / ``ln_2``), frozen at its real input like ``norm``.
    """

    scale: str | None = path()
    bias: str | None = path()
    multiplier: str | Callable | None = None
    norm: str | None = path()
    norm_after: str | None = path()


@dataclass(frozen=True)
class Heads:
    """The term splits into heads: ``projection``'s input is ``[batch, pos, heads * head_dim]``.

    Attributes:
        projection: the linear map (``nn.Linear`` or GPT-2's ``Conv1D``) whose input splits.
        values: where the attention's values are read, ``"<path>.output"`` of ``[batch, pos, kv_heads * head_dim]``
            or ``[batch, pos, kv_heads, head_dim]``: the value projection's output (bias included), or the value
            norm's output where the family normalises values (Gemma-4's ``v_norm``). Query head ``h`` reads group
            ``h // (heads / kv_heads)`` (GQA / MQA). The attention pattern is the second element of the output of the
            module that owns ``projection`` (``self_attn``) under eager attention, else recomputed from that module's
            attention call (``trace.kinds.pattern``). ``by="source"`` needs it; None:
            this term cannot be split by source position (latent attention, ...). Checked by ``plan.sources`` when
            ``by="source"`` needs it, not when the plan is built.
        values_layout: where the values sit in a fused projection's output: ``"qkv"`` (queries, keys, values
            concatenated, keys and values of equal width: the values are the last ``(width - heads * head_dim) / 2``
            features; GPT-2's ``c_attn``, Phi-3's ``qkv_proj``) or ``"per_head_qkv"`` (each head's query, key and
            value side by side: ``[..., heads, 3 * head_dim]``, the values last; GPT-NeoX). None: the tensor is the
            values.
        then: a second linear map after ``projection`` (DeepSeek-V4's ``o_b_proj`` after the grouped ``o_a_proj``).
        position_conv: the sublayer's output ``x`` passes through a module computing ``x +
            causal_depthwise_conv(mask * x)`` over positions (weights ``<position_conv>.conv1d.weight [d, 1, K]``,
            the padding mask its ``conv_mask`` argument: Inkling's short convolutions), so the term at position ``p``
            is made of the projection's inputs at ``p - K + 1 ... p``.
        projection_scale: a parameter path (a learned scalar or per-channel gain) multiplying ``projection``'s
            output inside ``output`` (Inkling's MLP ``global_scale``).
        projection_multiplier: a scalar (config attribute or function) between ``projection`` and ``output``.
    """

    projection: str = field(metadata=PATH)
    values: str | None = field(default=None, kw_only=True)
    values_layout: str | None = field(default=None, kw_only=True)
    then: str | None = field(default=None, kw_only=True, metadata=PATH)
    position_conv: str | None = field(default=None, kw_only=True, metadata=PATH)
    projection_scale: str | None = field(default=None, kw_only=True, metadata=PATH)
    projection_multiplier: str | Callable | None = field(default=None, kw_only=True)


@dataclass(frozen=True)
class Neurons:
    """The term splits into neurons: ``projection``'s input is ``[batch, pos, d_mlp]``.

    Attributes:
        projection: the linear map (``nn.Linear`` or GPT-2's ``Conv1D``) whose input splits.
        then: a second linear map after ``projection``.
        position_conv: as ``Heads.position_conv``.
        output_gate: ``sigmoid(output_gate.output)`` multiplies ``projection``'s output channel by channel (RWKV's
            channel mix: ``sigmoid(receptance(x)) * value(k)``).
        projection_scale: a parameter path (a learned scalar or per-channel gain) multiplying ``projection``'s
            output inside ``output`` (Inkling's MLP ``global_scale``).
        projection_multiplier: a scalar (config attribute or function) between ``projection`` and ``output``.
    """

    projection: str = field(metadata=PATH)
    then: str | None = field(default=None, kw_only=True, metadata=PATH)
    position_conv: str | None = field(default=None, kw_only=True, metadata=PATH)
    output_gate: str | None = field(default=None, kw_only=True, metadata=PATH)
    projection_scale: str | None = field(default=None, kw_only=True, metadata=PATH)
    projection_multiplier: str | Callable | None = field(default=None, kw_only=True)


@dataclass(frozen=True)
class Experts:
    """The term is a fused mixture-of-experts module, called as ``experts(hidden [tokens, d], top_k_index [tokens,
    k], top_k_weights [tokens, k])`` with weights as ``layout`` describes; it splits into experts and their neurons.

    Attributes:
        projection: the fused experts module.
        layout: how the experts module stores its weights (default: transformers' fused layout).
        shared: the down projection of a dense shared expert added to the routed experts.
        shared_gate: ``sigmoid(shared_gate.output)`` multiplies the shared expert (Qwen2-MoE).
        shared_first: the shared expert runs before the routed experts (forward order of reads).
        projection_multiplier: a scalar (config attribute or function) between ``projection`` and ``output``
            (Beam's ``routed_scaling_factor`` after its experts).
    """

    projection: str = field(metadata=PATH)
    layout: ExpertsLayout = field(default=FUSED, kw_only=True)
    shared: str | None = field(default=None, kw_only=True, metadata=PATH)
    shared_gate: str | None = field(default=None, kw_only=True, metadata=PATH)
    shared_first: bool = field(default=False, kw_only=True)
    projection_multiplier: str | Callable | None = field(default=None, kw_only=True)


@dataclass(frozen=True)
class Routed:
    """Grouped experts behind a router (ScatterMoE layout: JetMoE's attention and MLP).

    Attributes:
        projection: the grouped output projection (``weight [E, d_model, in]``): its input rows are the heads of each
            routed slot (``parts="heads"``, slot ``s`` owns heads ``s * in/head_dim ...``) or each routed expert's
            neurons (``parts="experts"``).
        router: a top-k router whose output is ``(index_sorted_experts, batch_index, batch_gates, expert_size,
            logits)`` and whose experts are grouped by expert.
        parts: ``"heads"`` or ``"experts"``: what the projection's input rows are.
        projection_bias: a bias added once after ``projection`` (inside ``output``), when the projection has none.
    """

    projection: str = field(metadata=PATH)
    router: str = field(metadata=PATH)
    parts: Literal["heads", "experts"] = field(default="heads", kw_only=True)
    projection_bias: str | None = field(default=None, kw_only=True, metadata=PATH)

    def __post_init__(self):
        if self.parts not in ("heads", "experts"):
            raise ValueError(f"Routed.parts is 'heads' or 'experts', not {self.parts!r}")


Split = Heads | Neurons | Experts | Routed  # how a term splits (``Term.split``); None: never split


@dataclass(frozen=True)
class Term:
    """One term a block writes into the residual stream.

    The stream after the term is ``stream.norm_after((stream.norm(stream) + stream.bias) * stream.scale *
    stream.multiplier + write)`` where ``write = (outer_norm(read(output)) + bias) * scale * config[multiplier]``
    (the fields of ``write``) and ``read(output)`` is ``post_norm(projection(projection.input))`` when those are
    given.

    Attributes:
        name: the label suffix (``"attn"``, ``"mlp"``, ``"mixer"``, ...): components are labelled ``f"L{i}.{name}"``.
        output: the tensor added (before ``outer_norm``, ``multiplier``, ``scale``, ``bias``): ``"<path>.output"``
            or ``"<path>.input"``; a tuple value is read at its first element.
        split: how the term splits: ``Heads``, ``Neurons``, ``Experts`` (fused), ``Routed`` (grouped experts behind
            a router), each naming its ``projection``; None: never split.
        reads: the norm whose input is the stream this term's sublayer reads (``input_layernorm``, ``ln_2``, ...):
            what ``attribute_direction`` freezes to attribute a direction read at this sublayer.
        parallel: the sublayer reads the same stream as the term before it (a parallel block); a config
            attribute name (``"use_parallel_residual"``) when the family has both kinds.
        hyper: on a family with parallel residual streams, the hyper-connection run before this term's sublayer:
            its output is ``(post [b, s, streams], comb [b, s, streams, streams], collapsed)``; the streams become
            ``combᵀ streams`` and the term is written into stream ``k`` times ``post[k]``.
        when, unless: the term is written only by blocks where this path exists (``when``) or does not
            (``unless``): optional terms compose, so a block's features need no layer kind per combination.
        write: how the added tensor is read and scaled (``Write``).
        stream: what acts on the stream itself as the term is added (``Stream``).
    """

    name: str
    output: str
    split: Split | None = None
    reads: str | None = field(default=None, kw_only=True, metadata=PATH)
    parallel: bool | str = field(default=False, kw_only=True)
    hyper: str | None = field(default=None, kw_only=True, metadata=PATH)
    when: str | None = field(default=None, kw_only=True)
    unless: str | None = field(default=None, kw_only=True)
    write: Write = field(default=Write(), kw_only=True)
    stream: Stream = field(default=Stream(), kw_only=True)

    @property
    def splits_heads(self) -> bool:
        """The term splits into heads (``Heads``, or ``Routed`` with ``parts="heads"``)."""
        return isinstance(self.split, Heads) or (isinstance(self.split, Routed) and self.split.parts == "heads")

    @property
    def splits_neurons(self) -> bool:
        """The term splits into neurons of one projection (``Neurons``)."""
        return isinstance(self.split, Neurons)

    @property
    def splits_experts(self) -> bool:
        """The term splits into experts (``Experts``, or ``Routed`` with ``parts="experts"``)."""
        return isinstance(self.split, Experts) or (isinstance(self.split, Routed) and self.split.parts == "experts")

    def paths(self) -> list[str]:
        """Every path this term names below the block envoy that must exist (the ``PATH`` fields of the term and its
        records, in the order: ``output``'s module, ``split``, ``write``, ``stream``, the term's own)."""
        found = [self.output.rsplit(".", 1)[0]]
        for record in (self.split, self.write, self.stream, self):
            if record is not None:
                found += [getattr(record, f.name) for f in fields(record) if f.metadata.get("path")]
        return [p for p in found if p]


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
    single_pass: str | None = None  # config value: the longest sequence the model runs in one pass; a longer batch
    # runs chunk by chunk, each block once per chunk (xLSTM's max_inference_chunksize), and is refused
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
