"""The tiny configs of the mixture-of-experts families: routed experts (and shared ones) in the MLP slot.

Each ``_cfg_<family>()`` returns a fresh ``transformers`` config with the shared sizes of ``base``; ``CONFIGS`` and
``MODEL_CLASSES`` (family -> ForCausalLM class name in ``transformers``) are this group's part of the registry.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .base import HEADS, HIDDEN, INTER, KV_HEADS, LAYERS, MAX_POS, PAD_ID, SOFTCAP, VOCAB, llama_like


def _cfg_mixtral():
    from transformers import MixtralConfig

    return MixtralConfig(**llama_like(num_local_experts=4, num_experts_per_tok=2))


def _cfg_qwen2_moe():
    from transformers import Qwen2MoeConfig

    return Qwen2MoeConfig(
        **llama_like(
            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=64,
            decoder_sparse_step=1,
        )
    )


def _cfg_olmoe():
    from transformers import OlmoeConfig

    return OlmoeConfig(**llama_like(intermediate_size=32, num_experts=4, num_experts_per_tok=2))


def _cfg_deepseek_v3():
    from transformers import DeepseekV3Config

    return DeepseekV3Config(
        **llama_like(
            num_key_value_heads=HEADS, moe_intermediate_size=32, n_shared_experts=1, n_routed_experts=8,
            num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1, q_lora_rank=32,
            kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=12, routed_scaling_factor=2.5,
        )
    )


def _cfg_gemma4_moe():
    from transformers import Gemma4TextConfig

    # like google/gemma-4-26B-A4B: MoE block next to the dense MLP, k == v on full-attention layers, no PLE
    return Gemma4TextConfig(
        **llama_like(
            head_dim=16, global_head_dim=32, num_global_key_value_heads=1, sliding_window=4,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
            final_logit_softcapping=SOFTCAP, hidden_size_per_layer_input=0, attention_k_eq_v=True,
            enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32,
            tie_word_embeddings=True,
        )
    )


def _cfg_zaya():
    from transformers import ZayaConfig

    return ZayaConfig(
        **llama_like(
            head_dim=16, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=1, router_hidden_size=16,
            sliding_window=4, layer_types=["hybrid", "hybrid_sliding", "hybrid"], tie_word_embeddings=True,
        )
    )


def _cfg_deepseek_v4():
    from transformers import DeepseekV4Config

    return DeepseekV4Config(
        **llama_like(
            num_key_value_heads=1, head_dim=16, q_lora_rank=32, moe_intermediate_size=32, n_routed_experts=4,
            n_shared_experts=1, num_experts_per_tok=2, partial_rotary_factor=0.5, hc_mult=3, hc_sinkhorn_iters=5,
            layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
            compress_rates={"compressed_sparse_attention": 2, "heavily_compressed_attention": 4},
            mlp_layer_types=["hash_moe", "moe", "moe"], sliding_window=4, o_groups=2, o_lora_rank=16,
            index_n_heads=2, index_head_dim=8, index_topk=2,
        )
    )


# --- computed scalars, norms on the stream, norms without weights ----------------------------------------------------


def _cfg_beam():
    from transformers import BeamConfig

    return BeamConfig(
        **llama_like(
            head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_group=2, topk_group=1,
            mlp_layer_types=["dense", "sparse", "sparse"], routed_scaling_factor=2.5, final_logit_softcapping=SOFTCAP,
        )
    )


def _cfg_hy_v4():
    from transformers import HYV4Config

    return HYV4Config(
        **llama_like(
            num_key_value_heads=HEADS, head_dim=16, moe_intermediate_size=32, n_routed_experts=4, n_shared_experts=1,
            num_experts_per_tok=2, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
            v_head_dim=12, mlp_layer_types=["dense", "sparse", "sparse"], hc_mult=3, index_topk=2, index_head_dim=8,
            index_n_heads=2, swiglu_limit=0.5,
        )
    )


def _cfg_inkling():
    from transformers.models.inkling.configuration_inkling import InklingTextConfig

    return InklingTextConfig(
        **llama_like(
            head_dim=16, swa_num_attention_heads=HEADS, swa_num_key_value_heads=KV_HEADS, swa_head_dim=16,
            sliding_window_size=4, d_rel=4, rel_extent=16, layer_types=None, local_layer_ids=[0, 2],
            mlp_layer_types=["dense", "sparse", "sparse"], moe_intermediate_size=32, n_routed_experts=4,
            num_experts_per_tok=2, n_shared_experts=1, logits_mup_width_multiplier=0.5, conv_kernel_size=3,
            initializer_range=0.1,  # logits of order 1: a forgotten scale must show above the 1e-4 tolerance
        )
    )


def _cfg_jetmoe():
    from transformers import JetMoeConfig

    return JetMoeConfig(
        **llama_like(
            num_attention_heads=None, num_key_value_heads=KV_HEADS, kv_channels=16, intermediate_size=64,
            num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=True,
        )
    )


# --- experts with their own layouts, and composed optional terms -----------------------------------------------------


def _cfg_gpt_oss():
    from transformers import GptOssConfig

    return GptOssConfig(
        **llama_like(
            head_dim=16, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"], swiglu_limit=0.5,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        )
    )


def _cfg_aria_text():
    from transformers import AriaTextConfig

    return AriaTextConfig(**llama_like(intermediate_size=32, moe_num_experts=4, moe_topk=2, moe_num_shared_experts=2))


def _cfg_llama4_text():
    from transformers import Llama4TextConfig

    # MoE blocks first (Llama-4 Scout) and a dense one (Maverick interleaves them); NoPE layers; chunked attention;
    # temperature tuning (floor_scale past the prompts, as on the real models, where it is 8192)
    return Llama4TextConfig(
        **llama_like(
            head_dim=16, intermediate_size=32, intermediate_size_mlp=INTER, num_local_experts=4,
            num_experts_per_tok=1, moe_layers=[0, 2], no_rope_layers=[1, 0, 1], attention_chunk_size=4,
            floor_scale=MAX_POS,
        )
    )


def _cfg_minimax_m3_vl_text():
    from transformers import MiniMaxM3VLTextConfig

    return MiniMaxM3VLTextConfig(
        **llama_like(
            head_dim=16, intermediate_size=32, dense_intermediate_size=INTER, shared_intermediate_size=48,
            num_local_experts=4, num_experts_per_tok=2, mlp_layer_types=["dense", "sparse", "sparse"],
            routed_scaling_factor=1.7, swiglu_limit=0.5, tie_word_embeddings=True,
        )
    )


def _cfg_cohere2_moe():
    from transformers import Cohere2MoeConfig

    return Cohere2MoeConfig(
        **llama_like(
            intermediate_size=32, prefix_dense_intermediate_size=INTER, num_experts=4, num_experts_per_tok=2,
            num_shared_experts=1, shared_expert_combination_strategy="average",
            mlp_layer_types=["dense", "sparse", "sparse"], logit_scale=0.3, tie_word_embeddings=True,
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
        **llama_like(
            head_dim=16, global_head_dim=32, num_global_key_value_heads=1, sliding_window=4,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
            final_logit_softcapping=SOFTCAP, hidden_size_per_layer_input=8, vocab_size_per_layer_input=VOCAB,
            enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32, tie_word_embeddings=True,
        )
    )


CONFIGS: dict[str, Callable[[], Any]] = {
    "mixtral": _cfg_mixtral,
    "qwen2_moe": _cfg_qwen2_moe,
    "olmoe": _cfg_olmoe,
    "deepseek_v3": _cfg_deepseek_v3,
    "gemma4_moe": _cfg_gemma4_moe,
    "zaya": _cfg_zaya,
    "deepseek_v4": _cfg_deepseek_v4,
    "beam": _cfg_beam,
    "hy_v4": _cfg_hy_v4,
    "inkling": _cfg_inkling,
    "jetmoe": _cfg_jetmoe,
    "gpt_oss": _cfg_gpt_oss,
    "aria_text": _cfg_aria_text,
    "llama4_text": _cfg_llama4_text,
    "minimax_m3_vl_text": _cfg_minimax_m3_vl_text,
    "cohere2_moe": _cfg_cohere2_moe,
    "dbrx": _cfg_dbrx,
    "gemma4_moe_ple": _cfg_gemma4_moe_ple,
}

MODEL_CLASSES: dict[str, str] = {
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "olmoe": "OlmoeForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "gemma4_moe": "Gemma4ForCausalLM",
    "zaya": "ZayaForCausalLM",
    "deepseek_v4": "DeepseekV4ForCausalLM",
    "beam": "BeamForCausalLM",
    "hy_v4": "HYV4ForCausalLM",
    "inkling": "InklingForCausalLM",
    "jetmoe": "JetMoeForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
    "aria_text": "AriaTextForCausalLM",
    "llama4_text": "Llama4ForCausalLM",
    "minimax_m3_vl_text": "MiniMaxM3VLForCausalLM",
    "cohere2_moe": "Cohere2MoeForCausalLM",
    "dbrx": "DbrxForCausalLM",
    "gemma4_moe_ple": "Gemma4ForCausalLM",
}
