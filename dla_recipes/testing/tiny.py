"""Tiny random decoder models, one per supported family, for tests, notebooks and benchmarks.

Every model here is built from a ``transformers`` Config class in milliseconds (no hub, no download): 2-3 layers,
hidden size 64, 4 attention heads (2 key/value heads where the family has GQA), intermediate size 128, vocabulary
128, float32, eval mode. Random initialisation hides bugs: norm gains start at exactly 1 (or 0 for ``1 + w``
norms), biases at 0, residual gates at 1, so a formula that forgets a gain or a bias still matches. ``perturb``
therefore moves every parameter or floating buffer whose values are all equal to random values away from its
init, and the config builders set every multiplier / soft-cap the family has to a non-trivial value.

Public API::

    FAMILIES                  # the family keys, in a fixed order
    tokenizer(vocab_size)     # offline WordLevel tokenizer "w0".."wN" + [UNK] + [PAD], left padding
    config(family)            # the tiny transformers Config
    build(family, seed=0)     # tiny perturbed transformers model (eval, float32)
    perturb(model, seed)      # the perturbation, in place
    standardized(family, seed=0)  # dla_recipes.load(build(family), tokenizer=tokenizer()) on CPU

``import dla_recipes`` (done here) must precede ``import nnterp``: it installs the nnsight-0.8 shim.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

import dla_recipes  # noqa: F401  (applies the nnterp-on-nnsight-0.8 shim before nnterp is imported)

VOCAB = 128
HIDDEN = 64
HEADS = 4
KV_HEADS = 2
INTER = 128
LAYERS = 3
MAX_POS = 256
SOFTCAP = 0.5  # tiny logits have std ~0.2: a cap of 0.5 bends them measurably (real models: 30)

FAMILIES: tuple[str, ...] = (
    "gpt2",
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "gemma",
    "olmo",
    "phi3",
    "smollm3",
    "apertus",
    "gptj",
    "gpt_neox",
    "gpt_neox_sequential",
    "mixtral",
    "qwen2_moe",
    "olmoe",
    "deepseek_v3",
    "gemma2",
    "gemma3",
    "glm4",
    "olmo2",
    "olmo3",
    "exaone4",
    "granite",
    "cohere",
    "recurrent_gemma",
    "falcon",
    "falcon_new_arch",
    "bloom",
    "opt",
    "phi",
    "gemma4",
    "gemma4_moe",
    "doge",
    "zaya",
    "deepseek_v4",
    # --- new term kinds (issue 12)
    "minicpm3",
    "beam",
    "minimax",
    "rwkv",
    "nanochat",
    "hy_v4",
    "inkling",
    "openai_gpt",
    # --- end new term kinds
    "zamba2",
    "jetmoe",
    # fam2 (issue 12)
    "gpt_oss",
    "aria_text",
    "llama4_text",
    "minimax_m3_vl_text",
    "cohere2_moe",
    "falcon_h1",
    "dbrx",
    "gemma4_moe_ple",
)


# --------------------------------------------------------------------------------------------------------------
# tokenizer
# --------------------------------------------------------------------------------------------------------------


def tokenizer(vocab_size: int = VOCAB):
    """An offline word-level tokenizer with exactly ``vocab_size`` ids.

    Tokens ``"w0" .. "w{vocab_size-3}"`` are ids ``0 .. vocab_size-3``; ``"[UNK]"`` is ``vocab_size-2`` and
    ``"[PAD]"`` is ``vocab_size-1`` (both inside the model vocabulary). Words are split on whitespace; padding is on
    the left, as nnterp expects.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < 3:
        raise ValueError("vocab_size must be at least 3")
    vocab = {f"w{i}": i for i in range(vocab_size - 2)}
    vocab["[UNK]"] = vocab_size - 2
    vocab["[PAD]"] = vocab_size - 1
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]")
    fast.padding_side = "left"
    return fast


PAD_ID = VOCAB - 1

# --------------------------------------------------------------------------------------------------------------
# configs
# --------------------------------------------------------------------------------------------------------------

_COMMON = dict(vocab_size=VOCAB, pad_token_id=PAD_ID, bos_token_id=0, eos_token_id=1, tie_word_embeddings=False)


def _llama_like(**over) -> dict:
    kw = dict(
        _COMMON,
        hidden_size=HIDDEN,
        intermediate_size=INTER,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=MAX_POS,
    )
    kw.update(over)
    return kw


def _cfg_gpt2():
    from transformers import GPT2Config

    return GPT2Config(
        vocab_size=VOCAB, n_positions=MAX_POS, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS, n_inner=INTER,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, pad_token_id=PAD_ID, bos_token_id=0, eos_token_id=1,
    )


def _cfg_llama():
    from transformers import LlamaConfig

    return LlamaConfig(**_llama_like())


def _cfg_mistral():
    from transformers import MistralConfig

    return MistralConfig(**_llama_like(sliding_window=None))


def _cfg_qwen2():
    from transformers import Qwen2Config

    return Qwen2Config(**_llama_like())


def _cfg_qwen3():
    from transformers import Qwen3Config

    return Qwen3Config(**_llama_like(head_dim=16))


def _cfg_gemma():
    from transformers import GemmaConfig

    return GemmaConfig(**_llama_like(head_dim=16, tie_word_embeddings=True))


def _cfg_olmo():
    from transformers import OlmoConfig

    return OlmoConfig(**_llama_like(clip_qkv=8.0))


def _cfg_phi3():
    from transformers import Phi3Config

    return Phi3Config(**_llama_like())


def _cfg_smollm3():
    from transformers import SmolLM3Config

    return SmolLM3Config(**_llama_like(no_rope_layer_interval=2, tie_word_embeddings=True))


def _cfg_apertus():
    from transformers import ApertusConfig

    return ApertusConfig(**_llama_like(max_position_embeddings=16384))


def _cfg_gptj():
    from transformers import GPTJConfig

    return GPTJConfig(
        vocab_size=VOCAB, n_positions=MAX_POS, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS, rotary_dim=8,
        n_inner=INTER, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, pad_token_id=PAD_ID, bos_token_id=0,
        eos_token_id=1,
    )


def _cfg_gpt_neox(parallel: bool = True):
    from transformers import GPTNeoXConfig

    return GPTNeoXConfig(
        **dict(
            _COMMON, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=LAYERS,
            num_attention_heads=HEADS, max_position_embeddings=MAX_POS, use_parallel_residual=parallel,
        )
    )


def _cfg_mixtral():
    from transformers import MixtralConfig

    return MixtralConfig(**_llama_like(num_local_experts=4, num_experts_per_tok=2))


def _cfg_qwen2_moe():
    from transformers import Qwen2MoeConfig

    return Qwen2MoeConfig(
        **_llama_like(
            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=64,
            decoder_sparse_step=1,
        )
    )


def _cfg_olmoe():
    from transformers import OlmoeConfig

    return OlmoeConfig(**_llama_like(intermediate_size=32, num_experts=4, num_experts_per_tok=2))


def _cfg_deepseek_v3():
    from transformers import DeepseekV3Config

    return DeepseekV3Config(
        **_llama_like(
            num_key_value_heads=HEADS, moe_intermediate_size=32, n_shared_experts=1, n_routed_experts=8,
            num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1, q_lora_rank=32,
            kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=12, routed_scaling_factor=2.5,
        )
    )


def _cfg_gemma2():
    from transformers import Gemma2Config

    return Gemma2Config(
        **_llama_like(
            head_dim=16, query_pre_attn_scalar=16, sliding_window=4, final_logit_softcapping=SOFTCAP,
            attn_logit_softcapping=3.0, tie_word_embeddings=True,
        )
    )


def _cfg_gemma3():
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(
        **_llama_like(
            head_dim=16, query_pre_attn_scalar=16, sliding_window=4, final_logit_softcapping=SOFTCAP,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"], tie_word_embeddings=True,
        )
    )


def _cfg_glm4():
    from transformers import Glm4Config

    return Glm4Config(**_llama_like(head_dim=16))


def _cfg_olmo2():
    from transformers import Olmo2Config

    return Olmo2Config(**_llama_like())


def _cfg_olmo3():
    from transformers import Olmo3Config

    return Olmo3Config(
        **_llama_like(
            sliding_window=4, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        )
    )


def _cfg_exaone4():
    from transformers import Exaone4Config

    return Exaone4Config(
        **_llama_like(
            sliding_window=4, layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        )
    )


def _cfg_granite():
    from transformers import GraniteConfig

    return GraniteConfig(
        **_llama_like(
            embedding_multiplier=2.5, residual_multiplier=0.6, logits_scaling=1.7, attention_multiplier=0.2,
        )
    )


def _cfg_cohere():
    from transformers import CohereConfig

    return CohereConfig(**_llama_like(logit_scale=0.3, use_qk_norm=True, tie_word_embeddings=True))


def _cfg_recurrent_gemma():
    from transformers import RecurrentGemmaConfig

    return RecurrentGemmaConfig(
        **_llama_like(
            num_key_value_heads=1, lru_width=HIDDEN, attention_window_size=4, conv1d_width=4, logits_soft_cap=SOFTCAP,
            block_types=["recurrent", "attention", "recurrent"], tie_word_embeddings=True,
        )
    )


def _cfg_falcon(new_arch: bool = False):
    from transformers import FalconConfig

    kw = dict(
        _COMMON, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS, ffn_hidden_size=INTER,
        max_position_embeddings=MAX_POS, tie_word_embeddings=True,
    )
    if new_arch:
        kw.update(new_decoder_architecture=True, num_kv_heads=KV_HEADS, num_ln_in_parallel_attn=2, parallel_attn=True)
    else:
        kw.update(new_decoder_architecture=False, multi_query=True, parallel_attn=True)
    return FalconConfig(**kw)


def _cfg_bloom():
    from transformers import BloomConfig

    return BloomConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, n_layer=LAYERS, n_head=HEADS, pad_token_id=PAD_ID, bos_token_id=0,
        eos_token_id=1,
    )


def _cfg_opt():
    from transformers import OPTConfig

    return OPTConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, ffn_dim=INTER, num_attention_heads=HEADS,
        max_position_embeddings=MAX_POS, word_embed_proj_dim=HIDDEN, dropout=0.0, pad_token_id=PAD_ID,
        bos_token_id=0, eos_token_id=1,
    )


def _cfg_phi():
    from transformers import PhiConfig

    return PhiConfig(**_llama_like(num_key_value_heads=HEADS, partial_rotary_factor=0.5))


def _cfg_gemma4(moe: bool = False):
    from transformers import Gemma4TextConfig

    if moe:
        # like google/gemma-4-26B-A4B: MoE block next to the dense MLP, k == v on full-attention layers, no PLE
        return Gemma4TextConfig(
            **_llama_like(
                head_dim=16, global_head_dim=32, num_global_key_value_heads=1, sliding_window=4,
                layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                final_logit_softcapping=SOFTCAP, hidden_size_per_layer_input=0, attention_k_eq_v=True,
                enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32,
                tie_word_embeddings=True,
            )
        )
    # like google/gemma-4-E2B: per-layer inputs (PLE), KV sharing on the last layer, double-wide MLP there
    return Gemma4TextConfig(
        **_llama_like(
            head_dim=16, global_head_dim=32, sliding_window=4,
            layer_types=["full_attention", "sliding_attention", "full_attention"], final_logit_softcapping=SOFTCAP,
            hidden_size_per_layer_input=8, vocab_size_per_layer_input=VOCAB, num_kv_shared_layers=1,
            use_double_wide_mlp=True, tie_word_embeddings=True,
        )
    )


def _cfg_doge():
    from transformers import DogeConfig

    return DogeConfig(**_llama_like(keep_window_size=4))


def _cfg_zaya():
    from transformers import ZayaConfig

    return ZayaConfig(
        **_llama_like(
            head_dim=16, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=1, router_hidden_size=16,
            sliding_window=4, layer_types=["hybrid", "hybrid_sliding", "hybrid"], tie_word_embeddings=True,
        )
    )


def _cfg_deepseek_v4():
    from transformers import DeepseekV4Config

    return DeepseekV4Config(
        **_llama_like(
            num_key_value_heads=1, head_dim=16, q_lora_rank=32, moe_intermediate_size=32, n_routed_experts=4,
            n_shared_experts=1, num_experts_per_tok=2, partial_rotary_factor=0.5, hc_mult=3, hc_sinkhorn_iters=5,
            layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
            compress_rates={"compressed_sparse_attention": 2, "heavily_compressed_attention": 4},
            mlp_layer_types=["hash_moe", "moe", "moe"], sliding_window=4, o_groups=2, o_lora_rank=16,
            index_n_heads=2, index_head_dim=8, index_topk=2,
        )
    )


# --- new term kinds (issue 12): computed scalars, norms on the stream, norms without weights ---------------------


def _cfg_minicpm3():
    from transformers import MiniCPM3Config

    return MiniCPM3Config(
        **_llama_like(
            num_key_value_heads=HEADS, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
            v_head_dim=12, scale_emb=2.5, scale_depth=1.4, dim_model_base=16,
        )
    )


def _cfg_beam():
    from transformers import BeamConfig

    return BeamConfig(
        **_llama_like(
            head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_group=2, topk_group=1,
            mlp_layer_types=["dense", "sparse", "sparse"], routed_scaling_factor=2.5, final_logit_softcapping=SOFTCAP,
        )
    )


def _cfg_minimax():
    from transformers import MiniMaxConfig

    return MiniMaxConfig(
        **_llama_like(
            head_dim=16, num_local_experts=4, num_experts_per_tok=2, block_size=4,
            layer_types=["linear_attention", "full_attention", "linear_attention"],
            full_attn_alpha_factor=0.7, full_attn_beta_factor=1.3, linear_attn_alpha_factor=0.8,
            linear_attn_beta_factor=1.2, mlp_alpha_factor=0.9, mlp_beta_factor=1.1,
        )
    )


def _cfg_rwkv():
    from transformers import RwkvConfig

    return RwkvConfig(
        vocab_size=VOCAB, context_length=MAX_POS, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
        attention_hidden_size=HIDDEN, intermediate_size=INTER, pad_token_id=PAD_ID, bos_token_id=0, eos_token_id=1,
        tie_word_embeddings=False,
    )


def _cfg_nanochat():
    from transformers import NanoChatConfig

    return NanoChatConfig(**_llama_like(num_key_value_heads=HEADS, final_logit_softcapping=SOFTCAP))


def _cfg_hy_v4():
    from transformers import HYV4Config

    return HYV4Config(
        **_llama_like(
            num_key_value_heads=HEADS, head_dim=16, moe_intermediate_size=32, n_routed_experts=4, n_shared_experts=1,
            num_experts_per_tok=2, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
            v_head_dim=12, mlp_layer_types=["dense", "sparse", "sparse"], hc_mult=3, index_topk=2, index_head_dim=8,
            index_n_heads=2, swiglu_limit=0.5,
        )
    )


def _cfg_inkling():
    from transformers.models.inkling.configuration_inkling import InklingTextConfig

    return InklingTextConfig(
        **_llama_like(
            head_dim=16, swa_num_attention_heads=HEADS, swa_num_key_value_heads=KV_HEADS, swa_head_dim=16,
            sliding_window_size=4, d_rel=4, rel_extent=16, layer_types=None, local_layer_ids=[0, 2],
            mlp_layer_types=["dense", "sparse", "sparse"], moe_intermediate_size=32, n_routed_experts=4,
            num_experts_per_tok=2, n_shared_experts=1, logits_mup_width_multiplier=0.5, conv_kernel_size=3,
            initializer_range=0.1,  # logits of order 1: a forgotten scale must show above the 1e-4 tolerance
        )
    )


def _cfg_openai_gpt():
    from transformers import OpenAIGPTConfig

    return OpenAIGPTConfig(
        vocab_size=VOCAB, n_positions=MAX_POS, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, pad_token_id=PAD_ID,
    )


# --- end new term kinds ------------------------------------------------------------------------------------------


def _cfg_zamba2():
    from transformers import Zamba2Config

    return Zamba2Config(
        **_llama_like(
            num_key_value_heads=HEADS, layers_block_type=["mamba", "hybrid", "mamba"], mamba_d_state=8,
            mamba_d_conv=4, mamba_expand=2, mamba_ngroups=1, n_mamba_heads=4, chunk_size=4, num_mem_blocks=1,
            use_mem_rope=True, tie_word_embeddings=True,
        )
    )


def _cfg_jetmoe():
    from transformers import JetMoeConfig

    return JetMoeConfig(
        **_llama_like(
            num_attention_heads=None, num_key_value_heads=KV_HEADS, kv_channels=16, intermediate_size=64,
            num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=True,
        )
    )


# --- fam2 (issue 12): experts with their own layouts, and composed optional terms ----------------------------------


def _cfg_gpt_oss():
    from transformers import GptOssConfig

    return GptOssConfig(
        **_llama_like(
            head_dim=16, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"], swiglu_limit=0.5,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        )
    )


def _cfg_aria_text():
    from transformers import AriaTextConfig

    return AriaTextConfig(**_llama_like(intermediate_size=32, moe_num_experts=4, moe_topk=2, moe_num_shared_experts=2))


def _cfg_llama4_text():
    from transformers import Llama4TextConfig

    # MoE blocks first (Llama-4 Scout) and a dense one (Maverick interleaves them); NoPE layers; chunked attention;
    # temperature tuning (floor_scale past the prompts, as on the real models, where it is 8192)
    return Llama4TextConfig(
        **_llama_like(
            head_dim=16, intermediate_size=32, intermediate_size_mlp=INTER, num_local_experts=4,
            num_experts_per_tok=1, moe_layers=[0, 2], no_rope_layers=[1, 0, 1], attention_chunk_size=4, floor_scale=MAX_POS,
        )
    )


def _cfg_minimax_m3_vl_text():
    from transformers import MiniMaxM3VLTextConfig

    return MiniMaxM3VLTextConfig(
        **_llama_like(
            head_dim=16, intermediate_size=32, dense_intermediate_size=INTER, shared_intermediate_size=48,
            num_local_experts=4, num_experts_per_tok=2, mlp_layer_types=["dense", "sparse", "sparse"],
            routed_scaling_factor=1.7, swiglu_limit=0.5, tie_word_embeddings=True,
        )
    )


def _cfg_cohere2_moe():
    from transformers import Cohere2MoeConfig

    return Cohere2MoeConfig(
        **_llama_like(
            intermediate_size=32, prefix_dense_intermediate_size=INTER, num_experts=4, num_experts_per_tok=2,
            num_shared_experts=1, shared_expert_combination_strategy="average",
            mlp_layer_types=["dense", "sparse", "sparse"], logit_scale=0.3, tie_word_embeddings=True,
        )
    )


def _cfg_falcon_h1():
    from transformers import FalconH1Config

    return FalconH1Config(
        **_llama_like(
            head_dim=16, mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8, mamba_chunk_size=4,
            mlp_multipliers=[1.3, 0.7], attention_out_multiplier=0.8, ssm_out_multiplier=0.6,
            attention_in_multiplier=1.2, lm_head_multiplier=0.9, embedding_multiplier=1.5,
        )
    )


def _cfg_dbrx():
    from transformers import DbrxConfig

    return DbrxConfig(
        d_model=HIDDEN, n_heads=HEADS, n_layers=LAYERS, max_seq_len=MAX_POS, vocab_size=VOCAB, pad_token_id=PAD_ID,
        bos_token_id=0, eos_token_id=1, tie_word_embeddings=False,
        attn_config={"kv_n_heads": KV_HEADS, "clip_qkv": 8.0, "rope_theta": 10000.0},
        ffn_config={"hidden_size": HIDDEN, "ffn_hidden_size": 32, "moe_num_experts": 4, "moe_top_k": 2},
    )


def _cfg_gemma4_moe_ple():
    from transformers import Gemma4TextConfig

    # both the MoE block and per-layer inputs (no released checkpoint has both; transformers builds it)
    return Gemma4TextConfig(
        **_llama_like(
            head_dim=16, global_head_dim=32, num_global_key_value_heads=1, sliding_window=4,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
            final_logit_softcapping=SOFTCAP, hidden_size_per_layer_input=8, vocab_size_per_layer_input=VOCAB,
            enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32, tie_word_embeddings=True,
        )
    )


FAM2_CONFIGS: dict[str, Callable[[], Any]] = {
    "gpt_oss": _cfg_gpt_oss,
    "aria_text": _cfg_aria_text,
    "llama4_text": _cfg_llama4_text,
    "minimax_m3_vl_text": _cfg_minimax_m3_vl_text,
    "cohere2_moe": _cfg_cohere2_moe,
    "falcon_h1": _cfg_falcon_h1,
    "dbrx": _cfg_dbrx,
    "gemma4_moe_ple": _cfg_gemma4_moe_ple,
}
FAM2_MODEL_CLASSES: dict[str, str] = {
    "gpt_oss": "GptOssForCausalLM",
    "aria_text": "AriaTextForCausalLM",
    "llama4_text": "Llama4ForCausalLM",
    "minimax_m3_vl_text": "MiniMaxM3VLForCausalLM",
    "cohere2_moe": "Cohere2MoeForCausalLM",
    "falcon_h1": "FalconH1ForCausalLM",
    "dbrx": "DbrxForCausalLM",
    "gemma4_moe_ple": "Gemma4ForCausalLM",
}
# --- end fam2 --------------------------------------------------------------------------------------------------------


_CONFIGS: dict[str, Callable[[], Any]] = {
    "gpt2": _cfg_gpt2,
    "llama": _cfg_llama,
    "mistral": _cfg_mistral,
    "qwen2": _cfg_qwen2,
    "qwen3": _cfg_qwen3,
    "gemma": _cfg_gemma,
    "olmo": _cfg_olmo,
    "phi3": _cfg_phi3,
    "smollm3": _cfg_smollm3,
    "apertus": _cfg_apertus,
    "gptj": _cfg_gptj,
    "gpt_neox": lambda: _cfg_gpt_neox(True),
    "gpt_neox_sequential": lambda: _cfg_gpt_neox(False),
    "mixtral": _cfg_mixtral,
    "qwen2_moe": _cfg_qwen2_moe,
    "olmoe": _cfg_olmoe,
    "deepseek_v3": _cfg_deepseek_v3,
    "gemma2": _cfg_gemma2,
    "gemma3": _cfg_gemma3,
    "glm4": _cfg_glm4,
    "olmo2": _cfg_olmo2,
    "olmo3": _cfg_olmo3,
    "exaone4": _cfg_exaone4,
    "granite": _cfg_granite,
    "cohere": _cfg_cohere,
    "recurrent_gemma": _cfg_recurrent_gemma,
    "falcon": lambda: _cfg_falcon(False),
    "falcon_new_arch": lambda: _cfg_falcon(True),
    "bloom": _cfg_bloom,
    "opt": _cfg_opt,
    "phi": _cfg_phi,
    "gemma4": lambda: _cfg_gemma4(False),
    "gemma4_moe": lambda: _cfg_gemma4(True),
    "doge": _cfg_doge,
    "zaya": _cfg_zaya,
    "deepseek_v4": _cfg_deepseek_v4,
    # --- new term kinds (issue 12)
    "minicpm3": _cfg_minicpm3,
    "beam": _cfg_beam,
    "minimax": _cfg_minimax,
    "rwkv": _cfg_rwkv,
    "nanochat": _cfg_nanochat,
    "hy_v4": _cfg_hy_v4,
    "inkling": _cfg_inkling,
    "openai_gpt": _cfg_openai_gpt,
    # --- end new term kinds
    "zamba2": _cfg_zamba2,
    "jetmoe": _cfg_jetmoe,
    **FAM2_CONFIGS,
}

_MODEL_CLASSES: dict[str, str] = {
    "gpt2": "GPT2LMHeadModel",
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma": "GemmaForCausalLM",
    "olmo": "OlmoForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "smollm3": "SmolLM3ForCausalLM",
    "apertus": "ApertusForCausalLM",
    "gptj": "GPTJForCausalLM",
    "gpt_neox": "GPTNeoXForCausalLM",
    "gpt_neox_sequential": "GPTNeoXForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "olmoe": "OlmoeForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "glm4": "Glm4ForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
    "olmo3": "Olmo3ForCausalLM",
    "exaone4": "Exaone4ForCausalLM",
    "granite": "GraniteForCausalLM",
    "cohere": "CohereForCausalLM",
    "recurrent_gemma": "RecurrentGemmaForCausalLM",
    "falcon": "FalconForCausalLM",
    "falcon_new_arch": "FalconForCausalLM",
    "bloom": "BloomForCausalLM",
    "opt": "OPTForCausalLM",
    "phi": "PhiForCausalLM",
    "gemma4": "Gemma4ForCausalLM",
    "gemma4_moe": "Gemma4ForCausalLM",
    "doge": "DogeForCausalLM",
    "zaya": "ZayaForCausalLM",
    "deepseek_v4": "DeepseekV4ForCausalLM",
    # --- new term kinds (issue 12)
    "minicpm3": "MiniCPM3ForCausalLM",
    "beam": "BeamForCausalLM",
    "minimax": "MiniMaxForCausalLM",
    "rwkv": "RwkvForCausalLM",
    "nanochat": "NanoChatForCausalLM",
    "hy_v4": "HYV4ForCausalLM",
    "inkling": "InklingForCausalLM",
    "openai_gpt": "OpenAIGPTLMHeadModel",
    # --- end new term kinds
    "zamba2": "Zamba2ForCausalLM",
    "jetmoe": "JetMoeForCausalLM",
    **FAM2_MODEL_CLASSES,
}


# --------------------------------------------------------------------------------------------------------------
# --- Families described by the shared shapes (issue 12): one tiny config per model type, from its AutoConfig
# --------------------------------------------------------------------------------------------------------------

# Small mixtures of experts under every name the configs use: 4 routed experts, 2 per token, 1 shared expert, the
# first block dense where the family has dense blocks, and a non-trivial routed scaling factor.
_MOE = dict(
    num_experts=4, num_local_experts=4, n_routed_experts=4, moe_num_experts=4, num_experts_per_tok=2, moe_k=2,
    moe_topk=2, moe_intermediate_size=32, n_shared_experts=1, num_shared_experts=1, moe_num_shared_experts=1,
    shared_expert_intermediate_size=32, shared_intermediate_size=32, first_k_dense_replace=1, num_dense_layers=1,
    n_group=2, topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.5, decoder_sparse_step=1,
)
_GRANITE = dict(embedding_multiplier=2.5, residual_multiplier=0.6, logits_scaling=1.7, attention_multiplier=0.2)
_SW = ["sliding_attention", "full_attention", "sliding_attention"]  # windows of 4 < the tiny prompts' 6 tokens
_LINEAR = ["linear_attention", "full_attention", "linear_attention"]
_DENSE_SPARSE = ["dense", "sparse", "sparse"]

# model type -> (ForCausalLM class, config overrides on top of _llama_like)
_SHAPED: dict[str, tuple[str, dict]] = {
    # llama-like blocks
    "arcee": ("ArceeForCausalLM", {}),
    "bitnet": ("BitNetForCausalLM", {}),
    "cwm": ("CwmForCausalLM", dict(sliding_window=4)),
    "diffllama": ("DiffLlamaForCausalLM", {}),
    "ernie4_5": ("Ernie4_5ForCausalLM", {}),
    "exaone": ("LlamaForCausalLM", {}),
    "glm": ("GlmForCausalLM", dict(head_dim=16)),
    "helium": ("HeliumForCausalLM", dict(head_dim=16)),
    "hunyuan_v1_dense": ("HunYuanDenseV1ForCausalLM", dict(head_dim=16)),
    "internlm3": ("LlamaForCausalLM", {}),
    "iquestcoder": ("LlamaForCausalLM", {}),
    "jais2": ("Jais2ForCausalLM", {}),
    "ministral": ("MinistralForCausalLM", dict(head_dim=16, sliding_window=4, layer_types=_SW)),
    "ministral3": ("Ministral3ForCausalLM", {}),
    "nemotron": ("NemotronForCausalLM", {}),
    "seed_oss": ("SeedOssForCausalLM", {}),
    "stablelm": ("StableLmForCausalLM", {}),
    "youtu": ("YoutuForCausalLM", dict(num_key_value_heads=HEADS, q_lora_rank=32, kv_lora_rank=16,
                                        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=12)),
    # other single-kind blocks
    "gpt_bigcode": ("GPTBigCodeForCausalLM", dict(n_inner=INTER, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)),
    "gpt_neo": ("GPTNeoForCausalLM", dict(attention_types=[[["global", "local"], 1], [["global"], 1]], window_size=4,
                                          resid_dropout=0.0, embed_dropout=0.0, attention_dropout=0.0)),
    "starcoder2": ("Starcoder2ForCausalLM", dict(sliding_window=4)),
    "persimmon": ("PersimmonForCausalLM", dict(qk_layernorm=True)),
    "codegen": ("CodeGenForCausalLM", dict(n_ctx=MAX_POS, rotary_dim=8, n_inner=INTER, resid_pdrop=0.0,
                                          embd_pdrop=0.0, attn_pdrop=0.0)),
    "xglm": ("XGLMForCausalLM", dict(ffn_dim=INTER, scale_embedding=True, dropout=0.0)),
    "biogpt": ("BioGptForCausalLM", dict(scale_embedding=True, hidden_dropout_prob=0.0)),
    "cohere2": ("Cohere2ForCausalLM", dict(sliding_window=4, layer_types=_SW, logit_scale=0.3)),
    "cohere_compass_text": ("CohereCompassForCausalLM", dict(logit_scale=0.3, layer_types=["full_attention"] * LAYERS,
                                                              rope_parameters={"full_attention": {
                                                                  "rope_type": "default", "rope_theta": 10000.0}})),
    "vaultgemma": ("VaultGemmaForCausalLM", dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=4,
                                                 layer_types=_SW, final_logit_softcapping=SOFTCAP,
                                                 attn_logit_softcapping=3.0)),
    "apertus1p5_text": ("Apertus1p5TextForCausalLM", dict(max_position_embeddings=16384)),
    "granite_swa": ("GraniteSWAForCausalLM", dict(_GRANITE, sliding_window=4, layer_types=_SW)),
    "hyperclovax": ("HyperCLOVAXForCausalLM", dict(_GRANITE, use_post_norm=True)),
    "gemma4_unified_text": ("Gemma4UnifiedForCausalLM", dict(head_dim=16, sliding_window=4, layer_types=_SW,
                                                              final_logit_softcapping=SOFTCAP)),
    "mpt": ("MptForCausalLM", dict(d_model=HIDDEN, n_heads=HEADS, n_layers=LAYERS, expansion_ratio=2,
                                   max_seq_len=MAX_POS, logit_scale=0.3)),
    "ctrl": ("CTRLLMHeadModel", dict(n_embd=HIDDEN, dff=INTER, n_layer=LAYERS, n_head=HEADS, n_positions=MAX_POS,
                                     resid_pdrop=0.0, embd_pdrop=0.0)),
    "gpt_neox_japanese": ("GPTNeoXJapaneseForCausalLM", dict(intermediate_multiple_size=2, rotary_pct=0.5,
                                                             hidden_dropout=0.0, attention_dropout=0.0)),
    # mixtures of experts
    "qwen3_moe": ("Qwen3MoeForCausalLM", dict(_MOE, head_dim=16)),
    "phimoe": ("PhimoeForCausalLM", dict(_MOE)),
    "minimax_m2": ("MiniMaxM2ForCausalLM", dict(_MOE, head_dim=16)),
    "mellum": ("MellumForCausalLM", dict(_MOE, head_dim=16)),
    "deepseek_v2": ("DeepseekV2ForCausalLM", dict(_MOE, num_key_value_heads=HEADS, q_lora_rank=32, kv_lora_rank=16,
                                                  qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=12)),
    "deepseek_v32": ("DeepseekV32ForCausalLM", dict(_MOE, num_key_value_heads=HEADS, q_lora_rank=32, kv_lora_rank=16,
                                                    qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=12,
                                                    index_n_heads=2, index_head_dim=16, index_topk=2)),
    "glm4_moe": ("Glm4MoeForCausalLM", dict(_MOE, head_dim=16)),
    "glm4_moe_lite": ("Glm4MoeLiteForCausalLM", dict(_MOE, num_key_value_heads=HEADS, q_lora_rank=32,
                                                     kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
                                                     v_head_dim=12)),
    "glm_moe_dsa": ("GlmMoeDsaForCausalLM", dict(_MOE, num_key_value_heads=HEADS, q_lora_rank=32, kv_lora_rank=16,
                                                 qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=12,
                                                 index_n_heads=2, index_head_dim=16, index_topk=2)),
    "dots1": ("Dots1ForCausalLM", dict(_MOE, head_dim=16, sliding_window=4, layer_types=_SW)),
    "exaone_moe": ("ExaoneMoeForCausalLM", dict(_MOE, head_dim=16, sliding_window=4, layer_types=_SW,
                                                mlp_layer_types=_DENSE_SPARSE)),
    "solar_open": ("SolarOpenForCausalLM", dict(_MOE, head_dim=16)),
    "sarvam_mla": ("DeepseekV3ForCausalLM", dict(_MOE, num_key_value_heads=HEADS, q_lora_rank=None, kv_lora_rank=16,
                                                 qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=12)),
    "sarvam_moe": ("Glm4MoeForCausalLM", dict(_MOE, head_dim=16)),
    "hy_v3": ("HYV3ForCausalLM", dict(_MOE, head_dim=16, router_scaling_factor=2.5, mlp_layer_types=_DENSE_SPARSE)),
    "axk1": ("AXK1ForCausalLM", dict(_MOE, num_key_value_heads=HEADS, q_lora_rank=32, kv_lora_rank=16,
                                     qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=12,
                                     mlp_layer_types=_DENSE_SPARSE)),
    "axk2": ("AXK2ForCausalLM", dict(_MOE, num_key_value_heads=HEADS, q_lora_rank=32, kv_lora_rank=16,
                                     qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=12, index_n_heads=2,
                                     index_head_dim=16, index_topk=2, mlp_layer_types=_DENSE_SPARSE)),
    "mimo_v2_flash": ("MiMoV2FlashForCausalLM", dict(_MOE, head_dim=16, sliding_window=4, layer_types=_SW,
                                                     mlp_layer_types=_DENSE_SPARSE)),
    "hunyuan_v1_moe": ("HunYuanMoEV1ForCausalLM", dict(_MOE, head_dim=16)),
    "ernie4_5_moe": ("Ernie4_5_MoeForCausalLM", dict(_MOE, moe_layer_start_index=1)),
    "flex_olmo": ("FlexOlmoForCausalLM", dict(_MOE)),
    "afmoe": ("AfmoeForCausalLM", dict(_MOE, head_dim=16, sliding_window=4, layer_types=_SW)),
    "kolibri1": ("Kolibri1ForCausalLM", dict(_MOE, head_dim=16, sliding_window=4, layer_types=_SW)),
    # linear attention beside full attention
    "qwen3_next": ("Qwen3NextForCausalLM", dict(_MOE, head_dim=16, layer_types=_LINEAR, linear_num_key_heads=2,
                                                linear_num_value_heads=4, linear_key_head_dim=8,
                                                linear_value_head_dim=8)),
    "qwen3_5_text": ("Qwen3_5ForCausalLM", dict(head_dim=16, layer_types=_LINEAR, linear_num_key_heads=2,
                                                linear_num_value_heads=4, linear_key_head_dim=8,
                                                linear_value_head_dim=8)),
    "qwen3_5_moe_text": ("Qwen3_5MoeForCausalLM", dict(_MOE, head_dim=16, layer_types=_LINEAR, linear_num_key_heads=2,
                                                       linear_num_value_heads=4, linear_key_head_dim=8,
                                                       linear_value_head_dim=8)),
    "lara_mini": ("LaraMiniForCausalLM", dict(_MOE, head_dim=16, sliding_window=4,
                                              layer_types=["linear_attention", "sliding_attention", "full_attention"],
                                              linear_num_key_heads=2, linear_num_value_heads=4,
                                              linear_key_head_dim=8, linear_value_head_dim=8)),
    "flint": ("FlintForCausalLM", dict(_MOE, head_dim=16, sliding_window=4, layer_types=_SW)),
    "kimi_linear": ("KimiLinearForCausalLM", dict(_MOE, num_key_value_heads=HEADS, q_lora_rank=32, kv_lora_rank=16,
                                                  qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=12,
                                                  layer_types=_LINEAR,
                                                  mlp_layer_types=_DENSE_SPARSE, linear_head_dim=16,
                                                  linear_num_heads=2)),
    "bailing_hybrid": ("BailingHybridForCausalLM", dict(_MOE, num_key_value_heads=HEADS, q_lora_rank=32,
                                                        kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
                                                        v_head_dim=12, layer_group_size=2)),
    # Granite mixtures of experts and hybrids
    "granitemoe": ("GraniteMoeForCausalLM", dict(_MOE, **_GRANITE)),
    "granitemoe_swa": ("GraniteMoeSWAForCausalLM", dict(_MOE, **_GRANITE, sliding_window=4, layer_types=_SW)),
    "granitemoeshared": ("GraniteMoeSharedForCausalLM", dict(_MOE, **_GRANITE)),
    "granitemoehybrid": ("GraniteMoeHybridForCausalLM", dict(_MOE, **_GRANITE,
                                                          layer_types=["mamba", "attention", "mamba"],
                                                          mamba_d_state=8, mamba_n_heads=4, mamba_d_head=32,
                                                          mamba_chunk_size=4)),
    # state-space and recurrent mixers
    "mamba": ("MambaForCausalLM", dict(state_size=8, expand=2, conv_kernel=4)),
    "mamba2": ("Mamba2ForCausalLM", dict(state_size=8, expand=2, conv_kernel=4, num_heads=8, head_dim=16, n_groups=1,
                                         chunk_size=4)),
    "falcon_mamba": ("FalconMambaForCausalLM", dict(state_size=8, expand=2, conv_kernel=4)),
    "nemotron_h": ("NemotronHForCausalLM", dict(_MOE, head_dim=16,
                                                layers_block_type=["mamba", "attention", "moe", "mlp"],
                                                num_hidden_layers=4, mamba_num_heads=8, mamba_head_dim=16,
                                                ssm_state_size=8, n_groups=1, chunk_size=4,
                                                moe_shared_expert_intermediate_size=32)),
    "zamba": ("ZambaForCausalLM", dict(num_key_value_heads=HEADS, attn_layer_period=2, attn_layer_offset=1,
                                       mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=8)),
    "jamba": ("JambaForCausalLM", dict(_MOE, num_hidden_layers=4, attn_layer_period=2, attn_layer_offset=1,
                                       expert_layer_period=2, expert_layer_offset=0, mamba_d_state=8,
                                       mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=8, use_mamba_kernels=False)),
    "bamba": ("BambaForCausalLM", dict(attn_layer_indices=[1], mamba_n_heads=8, mamba_d_head=16, mamba_d_state=8,
                                       mamba_n_groups=1, mamba_chunk_size=4)),
    "lfm2": ("Lfm2ForCausalLM", dict(layer_types=["conv", "full_attention", "conv"], conv_L_cache=3)),
    "lfm2_moe": ("Lfm2MoeForCausalLM", dict(_MOE, layer_types=["conv", "full_attention", "conv"], conv_L_cache=3)),
    "lfm3": ("Lfm3ForCausalLM", dict(sliding_window=4, layer_types=["conv", "sliding_attention", "full_attention"],
                                     conv_L_cache=3)),
    "olmo_hybrid": ("OlmoHybridForCausalLM", dict(layer_types=_LINEAR, linear_num_key_heads=2,
                                                  linear_num_value_heads=4, linear_key_head_dim=8,
                                                  linear_value_head_dim=8)),
    "xlstm": ("xLSTMForCausalLM", dict(embedding_dim=HIDDEN, num_blocks=LAYERS, num_heads=HEADS, qk_dim_factor=1.0,
                                       chunk_size=4,
                                       mode="inference", output_logit_soft_cap=SOFTCAP)),
}


def _cfg_shaped(model_type: str):
    from transformers import AutoConfig

    return AutoConfig.for_model(model_type, **_llama_like(**_SHAPED[model_type][1]))


SHAPED_FAMILIES: tuple[str, ...] = tuple(_SHAPED)
FAMILIES = FAMILIES + SHAPED_FAMILIES
_CONFIGS.update({t: (lambda t=t: _cfg_shaped(t)) for t in _SHAPED})
_MODEL_CLASSES.update({t: cls for t, (cls, _) in _SHAPED.items()})


def _check(family: str) -> None:
    if family not in _CONFIGS:
        raise KeyError(f"unknown family {family!r}; known: {', '.join(FAMILIES)}")


def config(family: str):
    """The tiny ``transformers`` config of ``family`` (a fresh object each call)."""
    _check(family)
    return _CONFIGS[family]()


# --------------------------------------------------------------------------------------------------------------
# build + perturb
# --------------------------------------------------------------------------------------------------------------


def build(family: str, seed: int = 0, *, perturbed: bool = True) -> "transformers.PreTrainedModel":  # noqa: F821
    """A tiny random ``family`` model, float32, eval mode, with ``perturb(model, seed)`` applied.

    ``perturbed=False`` skips the perturbation (plain transformers init) -- only to demonstrate what it catches.
    """
    import transformers

    _check(family)
    cfg = config(family)
    cls = getattr(transformers, _MODEL_CLASSES[family])
    torch.manual_seed(seed)
    model = cls(cfg)
    model = model.to(torch.float32).eval()
    if perturbed:
        perturb(model, seed)
    return model


@torch.no_grad()
def perturb(model: nn.Module, seed: int = 0) -> nn.Module:
    """Move every constant parameter / floating buffer of ``model`` to random values, in place; return ``model``.

    Generic rule, applied to every floating parameter / persistent buffer whose elements are all equal (and to
    every scalar); non-persistent buffers (Gemma ``embed_scale``, RecurrentGemma ``normalizer``, rotary tables) are
    architecture constants rebuilt on load and are left alone, so ``save_pretrained`` / ``from_pretrained`` round-trip
    the perturbed model exactly:

    * all zeros  -> ``0.1 * randn`` (biases, zero-init gates, ``1 + w`` norm weights get ``0.3 * randn``);
    * all ones   -> ``1 + 0.3 * randn`` (norm gains, residual scales, router scales);
    * constant c -> ``c * (1 + 0.3 * randn)`` (e.g. scalar parameters such as xIELU's ``alpha_p``).

    Family specifics: decoder-layer ``layer_scalar`` buffers (Gemma 4) go to ``U[0.5, 1.5]``; DeepSeek-V4 hash
    routing tables ``tid2eid`` get random expert ids (distinct per row); DeepSeek-V4 hyper-connection biases
    (``attn_hc.base``, ``ffn_hc.base``, ``hc_head.hc_base``) get ``randn`` so the stream mixing is far from uniform;
    ZAYA ``qk_norm.temp`` (0 makes every key zero) goes to ``1 + 0.3 * randn``.
    """
    gen = torch.Generator().manual_seed(10_000 + seed)

    def randn(t: torch.Tensor) -> torch.Tensor:
        return torch.randn(t.shape, generator=gen, dtype=torch.float32).to(t.dtype)

    modules = dict(model.named_modules())
    seen: set[int] = set()
    tensors = [(n, p, True) for n, p in model.named_parameters(remove_duplicate=True)]
    tensors += [(n, b, False) for n, b in model.named_buffers(remove_duplicate=True)]
    for name, t, _ in tensors:
        if id(t) in seen or t.numel() == 0:
            continue
        seen.add(id(t))
        owner_name, _, leaf = name.rpartition(".")
        owner = modules.get(owner_name, model)
        if leaf == "tid2eid":  # DeepSeek-V4 hash routing: random distinct experts per token
            n_exp = model.config.n_routed_experts
            rows = torch.stack([torch.randperm(n_exp, generator=gen)[: t.shape[1]] for _ in range(t.shape[0])])
            t.copy_(rows.to(t.dtype))
            continue
        if not t.is_floating_point():
            continue
        if leaf in getattr(owner, "_non_persistent_buffers_set", ()):
            # fixed by the architecture and rebuilt on load (Gemma `embed_scale`, RecurrentGemma `normalizer`,
            # rotary tables): perturbing them would not survive save_pretrained / from_pretrained
            continue
        if leaf == "layer_scalar":  # Gemma 4
            t.copy_((0.5 + torch.rand(t.shape, generator=gen)).to(t.dtype))
            continue
        if type(owner).__name__ in ("DeepseekV4HyperConnection", "DeepseekV4HyperHead") and leaf in ("base", "hc_base"):
            t.copy_(randn(t))  # O(1) biases: the hyper-connection mixing must be far from uniform to show up
            continue
        if leaf == "temp" and type(owner).__name__ == "ZayaQKNorm":
            t.copy_(1.0 + 0.3 * randn(t))
            continue
        if "inv_freq" in leaf or leaf == "eps":  # rotary tables, numerical epsilons: not learned gains
            continue
        flat = t.detach().reshape(-1).float()
        if not torch.isfinite(flat).all():
            continue
        if t.numel() > 1 and not bool((flat == flat[0]).all()):
            continue
        value = float(flat[0])
        if value == 0.0:
            gain_like = leaf == "weight" and "norm" in (type(owner).__name__.lower() + owner_name.lower())
            t.copy_((0.3 if gain_like else 0.1) * randn(t))
        elif value == 1.0:
            t.copy_(1.0 + 0.3 * randn(t))
        else:
            t.copy_((value * (1.0 + 0.3 * randn(t).float())).to(t.dtype))
    return model


# --------------------------------------------------------------------------------------------------------------
# nnterp loading
# --------------------------------------------------------------------------------------------------------------


def standardized(family: str, seed: int = 0, **kwargs):
    """``build(family, seed)`` loaded with ``dla_recipes.load`` (on CPU, with its tokenizer).

    The family table supplies what nnterp needs to load the family (a ``RenameConfig``, ``allow_multimodal``,
    ``check_renaming``); ``kwargs`` are passed on to ``StandardizedTransformer``.
    """
    model = build(family, seed)
    kwargs.setdefault("device_map", "cpu")
    return dla_recipes.load(model, tokenizer=tokenizer(model.config.vocab_size), **kwargs)


__all__ = ["FAMILIES", "tokenizer", "config", "build", "perturb", "standardized", "VOCAB"]
