"""The family entries of dense decoders: pre-norm, parallel, sandwich and post-norm blocks, gates and scalars on the
stream, scaled writes, modules that add the residual inside themselves, and the families described by the shared
shapes. ``table.py`` joins ``DENSE`` with ``EXPERTS`` and ``HYBRID`` into ``FAMILIES``."""

from __future__ import annotations

from .schema import Experts, Family, Heads, LayerKind, Neurons, Stream, Term, Write
from .shapes import INKLING_ATTENTION, LLAMA_LIKE, OPT_LIKE, POST_NORM_ONLY, SANDWICH, depth_scale, sequential

DENSE: tuple[Family, ...] = (
    # Pre-norm blocks whose modules' outputs are what the block adds.
    Family("gpt2", ("gpt2",), sequential(("c_proj", "c_proj"), reads=("ln_1", "ln_2"), values=("self_attn.c_attn.output", "qkv")),
           notes="Conv1D weights; learned positions in embed."),
    Family("llama", ("llama",), LLAMA_LIKE),
    Family("mistral", ("mistral",), LLAMA_LIKE),
    Family("qwen2", ("qwen2",), LLAMA_LIKE),
    Family("qwen3", ("qwen3",), LLAMA_LIKE),
    Family("gemma", ("gemma",), LLAMA_LIKE, notes="RMSNorm gain is 1 + w; embeddings scaled by sqrt(d_model)."),
    Family("olmo", ("olmo",), LLAMA_LIKE, notes="non-affine LayerNorm."),
    Family("phi3", ("phi3",), sequential(values=("self_attn.qkv_proj.output", "qkv")), notes="fused qkv_proj and gate_up_proj."),
    Family("smollm3", ("smollm3",), LLAMA_LIKE),
    Family("apertus", ("apertus",), sequential(reads=("attention_layernorm", "feedforward_layernorm")),
           notes="xIELU MLP without a gate."),
    # Parallel blocks: attention and MLP read the same normed stream; both outputs are added.
    Family("gptj", ("gptj",), sequential(("out_proj", "fc_out"), reads=("ln_1", "ln_1"), parallel=True),
           notes="parallel block; lm_head has a bias."),
    Family("gpt_neox", ("gpt_neox",), sequential(("dense", "dense_4h_to_h"), parallel="use_parallel_residual",
                                                values=("self_attn.query_key_value.output", "per_head_qkv")),
           notes="parallel (use_parallel_residual) or sequential."),
    Family("phi", ("phi",), sequential(("dense", "fc2"), reads=("input_layernorm", "input_layernorm"), parallel=True),
           rename={"ln_final_name": "final_layernorm"},
           notes="parallel block; lm_head has a bias; nnterp needs the final norm's name."),
    Family("cohere", ("cohere",), sequential(reads=("input_layernorm", "input_layernorm"), parallel=True),
           logits_times="logit_scale", notes="parallel block; weight-only LayerNorm; logits times logit_scale."),
    # Sandwich and post-norm blocks: what is added is a post-norm's output.
    Family("gemma2", ("gemma2",), SANDWICH, softcap="final_logit_softcapping",
           notes="sandwich norms; final logits soft-capped."),
    Family("gemma3", ("gemma3_text", "gemma3"), SANDWICH, softcap="final_logit_softcapping", notes="sandwich norms."),
    Family("olmo2", ("olmo2",), POST_NORM_ONLY, notes="post-norm only."),
    Family("olmo3", ("olmo3",), POST_NORM_ONLY, notes="post-norm only."),
    Family("exaone4", ("exaone4",), POST_NORM_ONLY, notes="post-norm only."),
    Family("glm4", ("glm4",), sequential(post=("post_self_attn_layernorm", "post_mlp_layernorm")),
           notes="sandwich norms."),
    # Gates and scalars on the stream itself.
    Family("doge", ("doge",), (LayerKind((
        Term("attn", "self_attn.output", Heads("self_attn.o_proj", values="self_attn.v_proj.output"),
             reads="input_layernorm", stream=Stream(scale="input_residual")),
        Term("mlp", "mlp.output", Neurons("mlp.down_proj"), reads="post_attention_layernorm",
             stream=Stream(scale="post_attention_residual")),
    )),), notes="per-channel residual gates: mid = input_residual * x + attn; out = post_attention_residual * mid + mlp."),
    Family("gemma4", ("gemma4_text", "gemma4"), (LayerKind((
        Term("attn", "post_attention_layernorm.output", Heads("self_attn.o_proj", values="self_attn.v_norm.output"),
             reads="input_layernorm", write=Write(post_norm="post_attention_layernorm")),
        Term("mlp", "post_feedforward_layernorm_1.output", Neurons("mlp.down_proj"), reads="pre_feedforward_layernorm",
             when="experts",
             write=Write(post_norm="post_feedforward_layernorm_1", outer_norm="post_feedforward_layernorm")),
        Term("mlp", "post_feedforward_layernorm.output", Neurons("mlp.down_proj"), reads="pre_feedforward_layernorm",
             unless="experts", write=Write(post_norm="post_feedforward_layernorm")),
        Term("experts", "post_feedforward_layernorm_2.output", Experts("experts"), reads="pre_feedforward_layernorm_2",
             parallel=True, when="experts",
             write=Write(post_norm="post_feedforward_layernorm_2", outer_norm="post_feedforward_layernorm")),
        Term("ple", "post_per_layer_input_norm.output", when="per_layer_input_gate"),
    )),), layer_scale="layer_scalar", softcap="final_logit_softcapping", logits_to_keep=False,
        notes="sandwich norms; the whole stream times layer_scalar after each block; optional terms: the MoE "
              "variant adds experts beside the MLP, both under post_feedforward_layernorm, and a per-layer-input "
              "branch (ple) follows where the model has per-layer inputs; given logits_to_keep, its KV-shared layers "
              "run on the kept positions only, so the whole sequence is kept."),
    # --- New term kinds (issue 12): computed scalars, norms on the stream itself, norms without weights
    Family("minicpm3", ("minicpm3",), sequential(multiplier=depth_scale), head_input_over="logits_scaling",
           notes="MLA attention; writes times scale_depth / sqrt(layers) (a computed scalar); embedding times "
                 "scale_emb; the final norm's output over hidden_size / dim_model_base."),
    Family("nanochat", ("nanochat",), sequential(("o_proj", "fc2")), softcap="final_logit_softcapping",
           final_norm="shared", load_kwargs={"check_renaming": False},
           notes="RMSNorms without weights (probed at the stream's width); the final norm module also norms the "
                 "embedding before the blocks; relu^2 MLP (fc1, fc2); logits soft-capped."),
    Family("inkling", ("inkling_text",), (
        LayerKind((INKLING_ATTENTION, Term("mlp", "mlp_sconv.output", reads="post_attention_layernorm")),
                  when="mlp.experts"),
        LayerKind((INKLING_ATTENTION, Term("mlp", "mlp_sconv.output",
                                           Neurons("mlp.down_proj", position_conv="mlp_sconv",
                                                   projection_scale="mlp.global_scale"),
                                           reads="post_attention_layernorm"))),
    ), head_input_over="logits_mup_width_multiplier", load_kwargs={"check_renaming": False},
        notes="each sublayer's output x is added as x + causal_conv(x) over positions (a position convolution: "
              "heads and neurons are read at the K last positions); the MoE blocks' experts (a bmm shared-expert "
              "layout) are not split; lm_head reads the final norm's output over the mup width."),
    Family("openai-gpt", ("openai-gpt",), (LayerKind((
        Term("attn", "self_attn.output", Heads("self_attn.c_proj"), stream=Stream(norm_after="ln_1")),
        Term("mlp", "mlp.output", Neurons("mlp.c_proj"), stream=Stream(norm_after="ln_2")),
    )),), final_norm="none", load_kwargs={"check_renaming": False},
        notes="post-norm blocks: the stream is normed right after each add (ln_1, ln_2); no final norm (lm_head "
              "reads the last block's output); Conv1D weights; learned positions in embed."),
    # Scaled writes.
    Family("granite", ("granite",), sequential(multiplier="residual_multiplier"), logits_over="logits_scaling",
           notes="writes times residual_multiplier; embedding times embedding_multiplier; logits over logits_scaling."),
    # Modules that add the residual inside themselves, in-place adds, sublayers outside a module.
    Family("bloom", ("bloom",), (LayerKind((
        Term("attn", "self_attn.dense.output",
             Heads("self_attn.dense", values="self_attn.query_key_value.output", values_layout="per_head_qkv"),
             reads="input_layernorm"),
        Term("mlp", "mlp.dense_4h_to_h.output", Neurons("mlp.dense_4h_to_h"), reads="post_attention_layernorm"),
    )),), notes="modules add the residual inside: the terms are the dense projections' outputs."),
    Family("falcon", ("falcon",), (
        LayerKind((  # new decoder architecture, two norms
            Term("attn", "self_attn.output", Heads("self_attn.dense"), reads="ln_attn"),
            Term("mlp", "mlp.output", Neurons("mlp.dense_4h_to_h"), reads="ln_mlp", parallel=True,
                 write=Write(clone=True)),
        ), when="ln_mlp"),
        LayerKind((  # sequential (parallel_attn=False)
            Term("attn", "self_attn.output", Heads("self_attn.dense"), reads="input_layernorm"),
            Term("mlp", "mlp.output", Neurons("mlp.dense_4h_to_h"), reads="post_attention_layernorm"),
        ), when="post_attention_layernorm"),
        LayerKind((  # parallel, one norm
            Term("attn", "self_attn.output", Heads("self_attn.dense"), reads="input_layernorm"),
            Term("mlp", "mlp.output", Neurons("mlp.dense_4h_to_h"), reads="input_layernorm", parallel=True,
                 write=Write(clone=True)),
        )),
    ), notes="parallel: the block adds the attention output into the MLP output in place (the MLP term is a copy)."),
    Family("opt", ("opt",), (LayerKind((
        Term("attn", "self_attn.output", Heads("self_attn.out_proj", values="self_attn.v_proj.output"),
             reads="self_attn_layer_norm"),
        Term("mlp", "fc2.output", Neurons("fc2"), reads="final_layer_norm", write=Write(flat=True)),
    )),), notes="fc1/fc2 sit on the block (nnterp finds no MLP module)."),
    # --- Families described by the shared shapes (issue 12) -------------------------------------------------
    Family("llama_like", (
        "arcee", "bitnet", "cwm", "diffllama", "ernie4_5", "exaone", "glm", "helium", "hunyuan_v1_dense", "internlm3",
        "iquestcoder", "jais2", "ministral", "ministral3", "nemotron", "seed_oss", "stablelm", "youtu",
    ), LLAMA_LIKE, notes="pre-norm attention then MLP, each module's output added (norms, MLP activations, "
                         "attention variants such as MLA, differential or sliding-window attention differ)."),
    Family("gpt_bigcode", ("gpt_bigcode",), sequential(("c_proj", "c_proj"), reads=("ln_1", "ln_2")),
           notes="multi-query attention; learned positions in embed."),
    Family("gpt_neo", ("gpt_neo",), sequential(("attention.out_proj", "c_proj"), reads=("ln_1", "ln_2")),
           notes="local and global attention layers; learned positions in embed."),
    Family("starcoder2", ("starcoder2",), sequential(("o_proj", "c_proj")), notes="LayerNorm with biases."),
    Family("persimmon", ("persimmon",), sequential(("dense", "dense_4h_to_h")), rename={"ln_final_name": "final_layernorm"},
           notes="squared-ReLU MLP, qk LayerNorm; nnterp needs the final norm's name."),
    Family("codegen", ("codegen",), sequential(("out_proj", "fc_out"), reads=("ln_1", "ln_1"), parallel=True),
           notes="parallel block (GPT-J layout); lm_head has a bias."),
    Family("xglm", ("xglm",), (OPT_LIKE,),
           rename={"ln_final_name": "layer_norm", "ignore_mlp": True, "attn_head_config_key": "attention_heads"},
           notes="OPT layout: fc1/fc2 sit on the block; embeddings scaled by sqrt(d_model), sinusoidal positions."),
    Family("biogpt", ("biogpt",), (OPT_LIKE,),
           rename={"model_name": "biogpt", "layers_name": "biogpt.layers", "ln_final_name": "biogpt.layer_norm",
                   "lm_head_name": "output_projection", "ignore_mlp": True},
           notes="OPT layout: fc1/fc2 sit on the block; embeddings scaled by sqrt(d_model), learned positions."),
    Family("cohere2", ("cohere2", "cohere_compass_text"),
           sequential(reads=("input_layernorm", "input_layernorm"), parallel=True), logits_times="logit_scale",
           notes="parallel block; sliding-window and global layers; logits times logit_scale."),
    Family("vaultgemma", ("vaultgemma",), sequential(reads=("input_layernorm", "pre_feedforward_layernorm")),
           softcap="final_logit_softcapping", notes="Gemma without post-norms; final logits soft-capped."),
    Family("apertus1p5", ("apertus1p5_text",), sequential(reads=("attention_layernorm", "feedforward_layernorm")),
           notes="xIELU MLP without a gate."),
    Family("granite_swa", ("granite_swa",), sequential(multiplier="residual_multiplier"),
           logits_over="logits_scaling", notes="Granite with sliding-window layers."),
    Family("hyperclovax", ("hyperclovax",), (
        LayerKind(sequential(post=("post_norm1", "post_norm2"), multiplier="residual_multiplier")[0].terms,
                  when="post_norm1.weight"),
        sequential(multiplier="residual_multiplier")[0],
    ), logits_times="logits_scaling",
        notes="optional post-norms (use_post_norm); writes times residual_multiplier; logits *times* logits_scaling."),
    Family("gemma4_unified", ("gemma4_unified_text",), SANDWICH, layer_scale="layer_scalar",
           softcap="final_logit_softcapping", logits_to_keep=False,
           notes="sandwich norms; the whole stream times layer_scalar after each block; KV-shared layers."),
    Family("mpt", ("mpt",), (LayerKind((
        Term("attn", "self_attn.output", Heads("self_attn.out_proj"), reads="norm_1"),
        Term("mlp", "mlp.down_proj.output", Neurons("mlp.down_proj"), reads="norm_2"),
    )),), notes="ALiBi; the MLP adds the residual inside: the term is down_proj's output."),
    Family("ctrl", ("ctrl",), (LayerKind((
        Term("attn", "self_attn.output", Heads("self_attn.dense"), reads="layernorm1"),
        Term("mlp", "mlp.output", Neurons("mlp.2"), reads="layernorm2"),
    )),), rename={"attn_name": "multi_head_attention", "ln_final_name": "layernorm"},
        load_kwargs={"check_renaming": False},
        notes="sinusoidal positions; embeddings scaled by sqrt(d_model); MLP is a Sequential (mlp.2 = down)."),
    Family("gpt_neox_japanese", ("gpt_neox_japanese",), tuple(
        LayerKind((Term("attn", "self_attn.output", Heads("self_attn.dense"), reads="input_layernorm",
                        write=Write(bias=bias)),
                   Term("mlp", "mlp.output", Neurons("mlp.dense_4h_to_h"), reads="post_attention_layernorm")),
                  when=bias)
        for bias in ("self_attn.dense_bias", None)
    ), rename={"model_name": "gpt_neox_japanese"},
        notes="the attention returns its output projection's bias (last block only) for the block to add: the term "
             "is the attention output plus that bias."),
)
