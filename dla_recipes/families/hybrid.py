"""The family entries of hybrids: recurrent, state-space, linear-attention and convolution mixers beside (or
instead of) attention, and parallel residual streams mixed by hyper-connections. Recurrent and convolution state
reads the pads, so most are declared padding-unsafe. ``table.py`` joins ``HYBRID`` with ``DENSE`` and ``EXPERTS``."""

from __future__ import annotations

from .schema import Experts, Family, Heads, LayerKind, Neurons, Stream, Term, Write
from .shapes import (
    POST_NORM_ONLY,
    QWEN_NEXT_KINDS,
    RWKV_CHANNEL_MIX,
    granite_moe_kinds,
    hy_head_weights,
    hyper_head_weights,
    moe_kinds,
)

HYBRID: tuple[Family, ...] = (
    # Hybrids: recurrent mixers beside (or instead of) attention.
    Family("falcon_h1", ("falcon_h1",), (LayerKind((
        Term("mixer", "mamba.output", reads="input_layernorm", write=Write(multiplier="ssm_out_multiplier")),
        Term("attn", "self_attn.output", Heads("self_attn.o_proj"), reads="input_layernorm", parallel=True,
             write=Write(multiplier="attention_out_multiplier")),
        Term("mlp", "mlp.down_proj.output", Neurons("mlp.down_proj"), reads="pre_ff_layernorm",
             write=Write(multiplier="mlp_multipliers[1]")),
    )),), logits_times="lm_head_multiplier", rename={"ln_final_name": "final_layernorm", "mlp_name": "feed_forward"},
        notes="Mamba-2 mixer and attention side by side on one norm, each times its config multiplier; the MLP's "
              "down projection times mlp_multipliers[1]; embedding times embedding_multiplier; logits times "
              "lm_head_multiplier."),
    Family("recurrent_gemma", ("recurrent_gemma",), (
        LayerKind((Term("attn", "self_attn.output", Heads("self_attn.o_proj"), reads="temporal_pre_norm"),
                   Term("mlp", "mlp.output", Neurons("mlp.down_proj"), reads="channel_pre_norm")),
                  when="self_attn.o_proj"),
        LayerKind((Term("mixer", "self_attn.output", reads="temporal_pre_norm"),
                   Term("mlp", "mlp.output", Neurons("mlp.down_proj"), reads="channel_pre_norm"))),
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
    # Parallel residual streams mixed by hyper-connections, collapsed before the final norm.
    Family("deepseek_v4", ("deepseek_v4",), (LayerKind((
        Term("attn", "self_attn.output", Heads("self_attn.o_a_proj", then="self_attn.o_b_proj"), hyper="attn_hc"),
        Term("mlp", "mlp.output", Experts("mlp.experts", shared="mlp.shared_experts.down_proj"), hyper="ffn_hc"),
    )),), collapse="model.hc_head", collapse_weights=hyper_head_weights, load_kwargs={"check_renaming": False},
        padding_safe=False,
        notes="hc_mult parallel residual streams mixed by input-dependent hyper-connections (post, comb) and "
              "collapsed by hc_head; grouped low-rank output projection (o_a_proj, then o_b_proj); clamped-SwiGLU experts."),
    Family("hy_v4", ("hy_v4",), (
        LayerKind((
            Term("attn", "self_attn.output", Heads("self_attn.o_proj"), hyper="attn_hc"),
            Term("mlp", "mlp.output", Experts("mlp.experts", shared="mlp.shared_experts.down_proj"), hyper="ffn_hc"),
        ), when="mlp.experts"),
        LayerKind((
            Term("attn", "self_attn.output", Heads("self_attn.o_proj"), hyper="attn_hc"),
            Term("mlp", "mlp.output", Neurons("mlp.down_proj"), hyper="ffn_hc"),
        )),
    ), collapse="model.hc_head", collapse_weights=hy_head_weights, load_kwargs={"check_renaming": False},
        padding_safe=False,
        notes="hc_mult parallel residual streams (DeepSeek-V4's machinery without the comb mixing: each sublayer "
              "reads a weighted sum of the streams and writes into stream k times post[k]); collapsed by hc_head; "
              "MLA attention; dense or MoE + shared experts with a clamped SwiGLU."),
    # --- New term kinds (issue 12): a norm on the stream itself (RWKV's block 0)
    Family("rwkv", ("rwkv",), (
        LayerKind((Term("attn", "attention.output", reads="ln1", stream=Stream(norm="pre_ln")), RWKV_CHANNEL_MIX),
                  when="pre_ln"),
        LayerKind((Term("attn", "attention.output", reads="ln1"), RWKV_CHANNEL_MIX)),
    ), padding_safe=False, rename={"model_name": "rwkv", "ln_final_name": "ln_out", "lm_head_name": "head",
                                   "attn_name": "attention", "mlp_name": "feed_forward"},
        load_kwargs={"check_renaming": False},
        notes="RWKV-4 time mixing (no heads: one term) and channel mixing (neurons: value's input, its output gated "
              "by sigmoid(receptance)); block 0 norms the embedding (pre_ln, a norm on the stream itself)."),
    # Linear-attention mixers (recurrent state) beside attention, with routed experts.
    Family("kimi_linear", ("kimi_linear", "bailing_hybrid"),
           moe_kinds(mixer=(Term("mixer", "self_attn.output", reads="input_layernorm"), "self_attn.forget_gate")),
           padding_safe=False,
           notes="Kimi delta attention (block level) beside MLA attention; routed + shared experts. Recurrent state: "
                 "declared padding-unsafe."),
    Family("qwen3_next", ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "lara_mini"), QWEN_NEXT_KINDS,
           rename={"attn_name": "linear_attn"}, padding_safe=False,
           notes="gated-DeltaNet linear attention (block-level: its heads are not the attention heads) beside full "
                 "attention; dense MLP or routed experts with a (sigmoid-gated) shared expert. Recurrent and "
                 "convolution state: declared padding-unsafe (the tiny model's CPU path masks the pads)."),
    # Granite mixtures of experts with Mamba-2 mixers: every write times residual_multiplier, logits over
    # logits_scaling.
    Family("granitemoehybrid", ("granitemoehybrid",), granite_moe_kinds(), logits_over="logits_scaling",
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
        LayerKind((Term("attn", "self_attn.output", Heads("self_attn.o_proj"), reads="norm"),),
                  when="self_attn.o_proj"),
        LayerKind((Term("mlp", "self_attn.output", reads="norm"),), when="self_attn.experts"),
        LayerKind((Term("mlp", "self_attn.output", Neurons("self_attn.down_proj"), reads="norm"),),
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
    Family("jamba", ("jamba", "bamba"), moe_kinds(
        mixer=(Term("mixer", "self_attn.output", reads="input_layernorm"), "self_attn.out_proj"),
        mlp_reads="pre_ff_layernorm"),
        rename={"attn_name": "mamba", "mlp_name": "feed_forward", "ln_final_name": "final_layernorm"},
        load_kwargs={"allow_multimodal": True}, padding_safe=False,
        notes="Mamba mixers beside attention, a dense MLP or routed experts after each; recurrent state: declared "
              "padding-unsafe."),
    Family("lfm2", ("lfm2", "lfm2_moe"), moe_kinds(
        attention=Term("attn", "self_attn.output", Heads("self_attn.out_proj"), reads="operator_norm"),
        mixer=(Term("mixer", "self_attn.output", reads="operator_norm"), "self_attn.conv"),
        mlp_reads="ffn_norm", down="w2"),
        rename={"attn_name": "conv", "mlp_name": "feed_forward"}, load_kwargs={"allow_multimodal": True},
        padding_safe=False,
        notes="short causal convolutions beside attention; dense (w1/w3/w2) or routed experts; the convolution's "
              "state reads the pads: declared padding-unsafe."),
    Family("lfm3", ("lfm3",), tuple(
        LayerKind((mixer, Term("mlp", "post_ffn_norm.output", Neurons("mlp.w2"), reads="ffn_norm",
                               write=Write(post_norm="post_ffn_norm"))), when=when)
        for mixer, when in (
            (Term("mixer", "post_operator_norm.output", reads="operator_norm",
                  write=Write(post_norm="post_operator_norm")),
             "self_attn.conv"),
            (Term("attn", "post_operator_norm.output", Heads("self_attn.o_proj"), reads="operator_norm",
                  write=Write(post_norm="post_operator_norm")), None),
        )
    ), rename={"attn_name": "conv", "mlp_name": "feed_forward"}, load_kwargs={"allow_multimodal": True},
        padding_safe=False,
        notes="LFM2 with sandwich norms (post_operator_norm, post_ffn_norm); convolutions: declared padding-unsafe."),
    Family("olmo_hybrid", ("olmo_hybrid",), (
        LayerKind((Term("mixer", "self_attn.output", reads="input_layernorm"),
                   Term("mlp", "mlp.output", Neurons("mlp.down_proj"), reads="post_attention_layernorm")),
                  when="input_layernorm"),
        POST_NORM_ONLY[0],
    ), rename={"attn_name": "linear_attn"}, load_kwargs={"allow_multimodal": True}, padding_safe=False,
        notes="gated-DeltaNet blocks (pre-norm) beside OLMo-3 attention blocks (post-norm only); recurrent state: "
              "declared padding-unsafe."),
    Family("xlstm", ("xlstm",), (LayerKind((
        Term("mixer", "self_attn.output", reads="norm_mlstm"),
        Term("mlp", "mlp.output", Neurons("mlp.proj_down"), reads="norm_ffn"),
    )),), rename={"attn_name": "mlstm_layer", "model_name": "backbone", "ln_final_name": "out_norm"},
        load_kwargs={"check_renaming": False}, padding_safe=False, softcap="output_logit_soft_cap",
        single_pass="max_inference_chunksize",
        notes="mLSTM mixer (block level) and a gated MLP per block; logits soft-capped; recurrent state: "
              "padding-unsafe (measured: a padded prompt's logits move); a batch longer than "
              "max_inference_chunksize runs chunk by chunk through a cache (bfloat16 without use_cache): refused."),
)
