"""The family entries of mixtures of experts: fused experts modules, experts with their own layouts (separate or
transposed weights, biases, router-scaled inputs, scaled routed and shared parts), mixtures of attention, and the
routed-plus-shared shapes of ``moe_kinds``. ``table.py`` joins ``EXPERTS`` with ``DENSE`` and ``HYBRID``."""

from __future__ import annotations

from .schema import Experts, ExpertsLayout, Family, Heads, LayerKind, Neurons, Routed, Stream, Term, Write
from .shapes import (
    ATTENTION,
    DENSE_MLP,
    MLA,
    QWEN_NEXT_KINDS,
    ROUTED,
    beam_stream,
    beam_write,
    cohere2_moe_mean,
    granite_moe_kinds,
    moe_kinds,
    sequential,
)

EXPERTS: tuple[Family, ...] = (
    # Mixtures of experts (fused experts modules): one term per expert, and neurons inside the experts that fired.
    Family("mixtral", ("mixtral",), (LayerKind((ATTENTION, ROUTED)),)),
    Family("olmoe", ("olmoe",), (LayerKind((ATTENTION, ROUTED)),)),
    Family("qwen2_moe", ("qwen2_moe",), (LayerKind((ATTENTION, Term(
        "mlp", "mlp.output", Experts("mlp.experts", shared="mlp.shared_expert.down_proj",
                                     shared_gate="mlp.shared_expert_gate", shared_first=True),
        reads="post_attention_layernorm"))),),
        notes="a shared expert gated by sigmoid(shared_expert_gate), run before the routed experts."),
    Family("deepseek_v3", ("deepseek_v3",), (
        LayerKind((MLA, Term("mlp", "mlp.output", Experts("mlp.experts", shared="mlp.shared_experts.down_proj"),
                             reads="post_attention_layernorm")),
                  when="mlp.experts"),
        LayerKind((MLA, DENSE_MLP)),
    ), notes="MLA attention (H x v_head_dim into o_proj); the first blocks are dense, the rest MoE + shared experts."),
    # --- Mixtures of experts with their own layouts (issue 12)
    Family("gpt_oss", ("gpt_oss",), (LayerKind((ATTENTION, Term(
        "mlp", "mlp.output", Experts("mlp.experts", layout=ExpertsLayout(
            transposed=("gate_up_proj", "down_proj"), gate_up_bias="gate_up_proj_bias", down_bias="down_proj_bias")),
        reads="post_attention_layernorm"),
    )),), notes="attention sinks; experts stored [in, out] with biases, gate/up interleaved and clamped (its own "
                "_apply_gate); each expert's down bias is part of that expert."),
    Family("aria_text", ("aria_text",), (LayerKind((ATTENTION, Term(
        "mlp", "mlp.output", Experts("mlp.experts", layout=ExpertsLayout(transposed=("gate_up_proj", "down_proj")),
                                     shared="mlp.shared_experts.down_proj"),
        reads="post_attention_layernorm")),
    ),), notes="experts stored [in, out]; shared experts run after the routed ones."),
    Family("llama4_text", ("llama4_text",), (LayerKind((
        ATTENTION,
        Term("mlp", "mlp.output",
             Experts("mlp.experts",
                     layout=ExpertsLayout(transposed=("gate_up_proj", "down_proj"), gating=None, scaled_inputs=True),
                     shared="mlp.shared_expert.down_proj"), reads="post_attention_layernorm", when="mlp.experts",
             write=Write(flat=True)),
        Term("mlp", "mlp.output", Neurons("mlp.down_proj"), reads="post_attention_layernorm", unless="mlp.experts"),
    )),), rename={"mlp_name": "feed_forward"}, load_kwargs={"check_renaming": False},
        notes="every expert runs on every token, its input pre-multiplied by the sigmoid router score (0: not "
              "routed); a shared expert; dense and MoE blocks interleave (optional terms); the MoE block's output is "
              "flat [tokens, d], which nnterp's renaming check refuses on a first MoE block, so it is skipped; "
              "attention temperature tuning reads absolute positions, so left padding changes a prompt's logits "
              "past floor_scale (8192) tokens."),
    Family("minimax_m3_vl_text", ("minimax_m3_vl_text",), (LayerKind((
        ATTENTION,
        Term("mlp", "mlp.output",
             Experts("mlp.experts", layout=ExpertsLayout(routed_scale="routed_scaling_factor"),
                     shared="mlp.shared_experts.down_proj", shared_first=True), reads="post_attention_layernorm",
             when="mlp.experts"),
        Term("mlp", "mlp.output", Neurons("mlp.down_proj"), reads="post_attention_layernorm", unless="mlp.experts"),
    )),), notes="clamped SwiGLU experts without act_fn (their own _apply_gate); routed experts times "
                "routed_scaling_factor, plus a shared expert run first; dense and MoE blocks (optional terms)."),
    Family("cohere2_moe", ("cohere2_moe",), (LayerKind((
        Term("attn", "self_attn.output", Heads("self_attn.o_proj"), reads="input_layernorm"),
        Term("mlp", "mlp.output",
             Experts("mlp.experts", layout=ExpertsLayout(routed_scale=cohere2_moe_mean, shared_scale=cohere2_moe_mean),
                     shared="mlp.shared_experts.down_proj"),
             reads="input_layernorm", parallel=True, when="mlp.experts"),
        Term("mlp", "mlp.output", Neurons("mlp.down_proj"), reads="input_layernorm", parallel=True,
             unless="mlp.experts"),
    )),), logits_times="logit_scale",
        notes="parallel block (one input_layernorm); routed and shared experts summed or averaged "
              "(shared_expert_combination_strategy); dense prefix blocks; logits times logit_scale."),
    Family("dbrx", ("dbrx",), (LayerKind((
        Term("attn", "norm_attn_norm.attn.output", Heads("norm_attn_norm.attn.out_proj"),
             reads="norm_attn_norm.norm_1"),
        Term("mlp", "mlp.output",
             Experts("mlp.experts",
                     layout=ExpertsLayout(gate_up=None, gate="mlp.w1", up="mlp.v1", down="mlp.w2",
                                          transposed=("mlp.w2",), gating=None, activation="mlp.activation_fn")),
             reads="norm_attn_norm.norm_2"),
    )),), notes="separate flattened w1 / v1 / w2 expert weights [E * I, d] (w2 used as [in, out]); the attention "
                "sits inside norm_attn_norm (nnterp's self_attn) with both norms."),
    # Gates and scalars on the stream itself.
    Family("zaya", ("zaya",), (LayerKind((
        Term("attn", "self_attn.output", Heads("self_attn.o_proj"), reads="input_layernorm",
             write=Write(scale="post_attention_residual_scale.hidden_states_scale",
                         bias="post_attention_residual_scale.hidden_states_bias"),
             stream=Stream(scale="post_attention_residual_scale.residual_scale",
                           bias="post_attention_residual_scale.residual_bias")),
        Term("mlp", "mlp.output", Experts("mlp.experts"), reads="post_attention_layernorm",
             write=Write(scale="post_mlp_residual_scale.hidden_states_scale",
                         bias="post_mlp_residual_scale.hidden_states_bias"),
             stream=Stream(scale="post_mlp_residual_scale.residual_scale",
                           bias="post_mlp_residual_scale.residual_bias")),
    )),), notes="each merge is (h + hb) * hs + (stream + rb) * rs (ZayaResidualScaling); MoE MLP."),
    # Mixture of attention: ScatterMoE-style grouped experts in the attention and in the MLP.
    Family("jetmoe", ("jetmoe",), (LayerKind((
        Term("attn", "self_attn.output",
             Routed("self_attn.experts.output_linear", "self_attn.experts.router", parts="heads",
                    projection_bias="self_attn.experts.bias"), reads="input_layernorm"),
        Term("mlp", "mlp.output",
             Routed("mlp.output_linear", "mlp.router", parts="experts", projection_bias="mlp.bias"),
             reads="post_attention_layernorm"),
    )),), notes="mixture of attention (each token routes to top-k attention experts, each owning a group of heads) "
                "and a mixture of experts MLP, both ScatterMoE-style grouped experts."),
    # --- New term kinds (issue 12): computed scalars, norms on the stream itself
    Family("beam", ("beam",), tuple(
        LayerKind((
            Term("attn", "post_attention_layernorm.output", Heads("self_attn.o_proj"), reads="input_layernorm",
                 write=Write(post_norm="post_attention_layernorm", multiplier=beam_write(0)),
                 stream=Stream(multiplier=beam_stream(0))),
            Term("mlp", "post_feedforward_layernorm.output", split, reads="pre_feedforward_layernorm",
                 write=Write(post_norm="post_feedforward_layernorm", multiplier=beam_write(1)),
                 stream=Stream(multiplier=beam_stream(1))),
        ), when=when)
        for when, split in (("mlp.experts", Experts("mlp.experts", projection_multiplier="routed_scaling_factor")),
                            (None, Neurons("mlp.down_proj")))
    ), softcap="final_logit_softcapping", load_kwargs={"check_renaming": False},
        notes="sandwich norms; each add is depth-scaled: stream * sqrt((n - 1) / n) + write / sqrt(n) for the n-th "
              "add (computed scalars); experts' sum times routed_scaling_factor before the post-norm."),
    Family("minimax", ("minimax",), tuple(
        LayerKind((
            Term("attn", "self_attn.output", Heads(f"self_attn.{projection}"), reads="input_layernorm",
                 write=Write(multiplier=f"{kind}_attn_beta_factor"),
                 stream=Stream(multiplier=f"{kind}_attn_alpha_factor", norm="input_layernorm")),
            Term("mlp", "mlp.output", Experts("mlp.experts"), reads="post_attention_layernorm",
                 write=Write(multiplier="mlp_beta_factor"),
                 stream=Stream(multiplier="mlp_alpha_factor", norm="post_attention_layernorm")),
        ), when=f"self_attn.{projection}")
        for projection, kind in (("o_proj", "full"), ("out_proj", "linear"))
    ), load_kwargs={"check_renaming": False},
        notes="the residual is the normed stream: stream <- norm(stream) * alpha + write * beta (norms on the stream "
             "itself); lightning (linear) attention on some blocks, softmax attention on the others; MoE MLP."),
    # Mixtures of experts: a routed experts module, optionally a shared expert beside it, the first blocks dense.
    Family("moe", (
        "qwen3_moe", "phimoe", "minimax_m2", "mellum", "deepseek_v2", "glm4_moe", "glm4_moe_lite", "dots1",
        "exaone_moe", "solar_open", "sarvam_mla", "sarvam_moe", "hy_v3", "mimo_v2_flash",
    ), moe_kinds(), notes="routed experts (fused module), an ungated shared expert where the block has one, dense "
                          "first blocks."),
    Family("moe_shared_first", ("ernie4_5_moe", "hunyuan_v1_moe"), moe_kinds(shared_first=True),
           notes="routed experts, a shared expert computed before them, dense first blocks."),
    Family("dsa_moe", ("deepseek_v32", "glm_moe_dsa", "axk2"), moe_kinds(), padding_safe=False,
           notes="DeepSeek sparse attention: a lightning indexer picks each query's top-k keys; routed + shared "
                 "experts. Declared padding-unsafe: axk2's tiny model moves 1% padded, and issue 12 measured "
                 "deepseek_v32 / glm_moe_dsa padded logits 3% / 2.6% off."),
    Family("axk1", ("axk1",), moe_kinds(post_norm="mlp.post_mlp_layernorm"),
           notes="MLA attention; routed + shared experts under a norm inside the MoE module (post_mlp_layernorm)."),
    Family("flex_olmo", ("flex_olmo",), (LayerKind((
        Term("attn", "post_attention_layernorm.output", Heads("self_attn.o_proj"),
             write=Write(post_norm="post_attention_layernorm")),
        Term("mlp", "post_feedforward_layernorm.output", Experts("mlp.experts"),
             write=Write(post_norm="post_feedforward_layernorm")),
    )),), notes="OLMo-2 post-norms around attention and routed experts."),
    Family("afmoe", ("afmoe",), (
        LayerKind((
            Term("attn", "post_attention_layernorm.output", Heads("self_attn.o_proj"), reads="input_layernorm",
                 write=Write(post_norm="post_attention_layernorm")),
            Term("mlp", "post_mlp_layernorm.output",
                 Experts("mlp.experts", shared="mlp.shared_experts.down_proj", shared_first=True),
                 reads="pre_mlp_layernorm", write=Write(post_norm="post_mlp_layernorm")),
        ), when="mlp.experts"),
        sequential(post=("post_attention_layernorm", "post_mlp_layernorm"),
                   reads=("input_layernorm", "pre_mlp_layernorm"))[0],
    ), notes="sandwich norms; gated attention; routed + shared experts after dense first blocks."),
    Family("kolibri1", ("kolibri1",), (
        LayerKind((
            Term("attn", "post_self_attn_layernorm.output", Heads("self_attn.o_proj"), reads="input_layernorm",
                 write=Write(post_norm="post_self_attn_layernorm")),
            Term("mlp", "post_mlp_layernorm.output", Experts("mlp.experts", shared="mlp.shared_experts.down_proj"),
                 reads="post_attention_layernorm", write=Write(post_norm="post_mlp_layernorm")),
        ), when="mlp.experts"),
        sequential(post=("post_self_attn_layernorm", "post_mlp_layernorm"))[0],
    ), notes="sandwich norms; routed + shared experts."),
    Family("flint", ("flint",), QWEN_NEXT_KINDS, rename={"attn_name": "linear_attn"},
           notes="Qwen3-Next blocks with sliding-window and full attention only; routed experts with a sigmoid-gated "
                 "shared expert."),
    # Granite mixtures of experts: every write times residual_multiplier, logits over logits_scaling.
    Family("granitemoe", ("granitemoe", "granitemoe_swa", "granitemoeshared"), granite_moe_kinds(),
           logits_over="logits_scaling",
           notes="routed experts (block_sparse_moe), a shared MLP beside them where the block has one; Granite "
                 "multipliers."),
)
