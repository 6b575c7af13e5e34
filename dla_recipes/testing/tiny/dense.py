"""The tiny configs of the dense families: one attention block and one MLP per layer, no experts, no recurrence.

Each ``_cfg_<family>()`` returns a fresh ``transformers`` config with the shared sizes of ``base``; ``CONFIGS`` and
``MODEL_CLASSES`` (family -> ForCausalLM class name in ``transformers``) are this group's part of the registry.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .base import COMMON, HEADS, HIDDEN, INTER, KV_HEADS, LAYERS, MAX_POS, PAD_ID, SOFTCAP, VOCAB, llama_like


def _cfg_gpt2():
    from transformers import GPT2Config

    return GPT2Config(
        vocab_size=VOCAB, n_positions=MAX_POS, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS, n_inner=INTER,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, pad_token_id=PAD_ID, bos_token_id=0, eos_token_id=1,
    )


def _cfg_llama():
    from transformers import LlamaConfig

    return LlamaConfig(**llama_like())


def _cfg_mistral():
    from transformers import MistralConfig

    return MistralConfig(**llama_like(sliding_window=None))


def _cfg_qwen2():
    from transformers import Qwen2Config

    return Qwen2Config(**llama_like())


def _cfg_qwen3():
    from transformers import Qwen3Config

    return Qwen3Config(**llama_like(head_dim=16))


def _cfg_gemma():
    from transformers import GemmaConfig

    return GemmaConfig(**llama_like(head_dim=16, tie_word_embeddings=True))


def _cfg_olmo():
    from transformers import OlmoConfig

    return OlmoConfig(**llama_like(clip_qkv=8.0))


def _cfg_phi3():
    from transformers import Phi3Config

    return Phi3Config(**llama_like())


def _cfg_smollm3():
    from transformers import SmolLM3Config

    return SmolLM3Config(**llama_like(no_rope_layer_interval=2, tie_word_embeddings=True))


def _cfg_apertus():
    from transformers import ApertusConfig

    return ApertusConfig(**llama_like(max_position_embeddings=16384))


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
            COMMON, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=LAYERS,
            num_attention_heads=HEADS, max_position_embeddings=MAX_POS, use_parallel_residual=parallel,
        )
    )


def _cfg_gemma2():
    from transformers import Gemma2Config

    return Gemma2Config(
        **llama_like(
            head_dim=16, query_pre_attn_scalar=16, sliding_window=4, final_logit_softcapping=SOFTCAP,
            attn_logit_softcapping=3.0, tie_word_embeddings=True,
        )
    )


def _cfg_gemma3():
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(
        **llama_like(
            head_dim=16, query_pre_attn_scalar=16, sliding_window=4, final_logit_softcapping=SOFTCAP,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"], tie_word_embeddings=True,
        )
    )


def _cfg_glm4():
    from transformers import Glm4Config

    return Glm4Config(**llama_like(head_dim=16))


def _cfg_olmo2():
    from transformers import Olmo2Config

    return Olmo2Config(**llama_like())


def _cfg_olmo3():
    from transformers import Olmo3Config

    return Olmo3Config(
        **llama_like(
            sliding_window=4, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        )
    )


def _cfg_exaone4():
    from transformers import Exaone4Config

    return Exaone4Config(
        **llama_like(
            sliding_window=4, layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        )
    )


def _cfg_granite():
    from transformers import GraniteConfig

    return GraniteConfig(
        **llama_like(
            embedding_multiplier=2.5, residual_multiplier=0.6, logits_scaling=1.7, attention_multiplier=0.2,
        )
    )


def _cfg_cohere():
    from transformers import CohereConfig

    return CohereConfig(**llama_like(logit_scale=0.3, use_qk_norm=True, tie_word_embeddings=True))


def _cfg_falcon(new_arch: bool = False):
    from transformers import FalconConfig

    kw = dict(
        COMMON, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS, ffn_hidden_size=INTER,
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

    return PhiConfig(**llama_like(num_key_value_heads=HEADS, partial_rotary_factor=0.5))


def _cfg_gemma4():
    from transformers import Gemma4TextConfig

    # like google/gemma-4-E2B: per-layer inputs (PLE), KV sharing on the last layer, double-wide MLP there
    return Gemma4TextConfig(
        **llama_like(
            head_dim=16, global_head_dim=32, sliding_window=4,
            layer_types=["full_attention", "sliding_attention", "full_attention"], final_logit_softcapping=SOFTCAP,
            hidden_size_per_layer_input=8, vocab_size_per_layer_input=VOCAB, num_kv_shared_layers=1,
            use_double_wide_mlp=True, tie_word_embeddings=True,
        )
    )


def _cfg_doge():
    from transformers import DogeConfig

    return DogeConfig(**llama_like(keep_window_size=4))


# --- computed scalars, norms on the stream, norms without weights ----------------------------------------------------


def _cfg_minicpm3():
    from transformers import MiniCPM3Config

    return MiniCPM3Config(
        **llama_like(
            num_key_value_heads=HEADS, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
            v_head_dim=12, scale_emb=2.5, scale_depth=1.4, dim_model_base=16,
        )
    )


def _cfg_nanochat():
    from transformers import NanoChatConfig

    return NanoChatConfig(**llama_like(num_key_value_heads=HEADS, final_logit_softcapping=SOFTCAP))


def _cfg_openai_gpt():
    from transformers import OpenAIGPTConfig

    return OpenAIGPTConfig(
        vocab_size=VOCAB, n_positions=MAX_POS, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, pad_token_id=PAD_ID,
    )


CONFIGS: dict[str, Callable[[], Any]] = {
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
    "gemma2": _cfg_gemma2,
    "gemma3": _cfg_gemma3,
    "glm4": _cfg_glm4,
    "olmo2": _cfg_olmo2,
    "olmo3": _cfg_olmo3,
    "exaone4": _cfg_exaone4,
    "granite": _cfg_granite,
    "cohere": _cfg_cohere,
    "falcon": lambda: _cfg_falcon(False),
    "falcon_new_arch": lambda: _cfg_falcon(True),
    "bloom": _cfg_bloom,
    "opt": _cfg_opt,
    "phi": _cfg_phi,
    "gemma4": _cfg_gemma4,
    "doge": _cfg_doge,
    "minicpm3": _cfg_minicpm3,
    "nanochat": _cfg_nanochat,
    "openai_gpt": _cfg_openai_gpt,
}

MODEL_CLASSES: dict[str, str] = {
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
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "glm4": "Glm4ForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
    "olmo3": "Olmo3ForCausalLM",
    "exaone4": "Exaone4ForCausalLM",
    "granite": "GraniteForCausalLM",
    "cohere": "CohereForCausalLM",
    "falcon": "FalconForCausalLM",
    "falcon_new_arch": "FalconForCausalLM",
    "bloom": "BloomForCausalLM",
    "opt": "OPTForCausalLM",
    "phi": "PhiForCausalLM",
    "gemma4": "Gemma4ForCausalLM",
    "doge": "DogeForCausalLM",
    "minicpm3": "MiniCPM3ForCausalLM",
    "nanochat": "NanoChatForCausalLM",
    "openai_gpt": "OpenAIGPTLMHeadModel",
}
