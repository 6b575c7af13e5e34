"""The tiny configs of the hybrid and recurrent families: recurrent, linear-attention or state-space mixers.

RecurrentGemma (RG-LRU blocks beside local attention), MiniMax (lightning attention beside full attention), RWKV,
Zamba2 (Mamba-2 blocks and a shared attention block) and Falcon-H1 (attention and Mamba-2 side by side). Each
``_cfg_<family>()`` returns a fresh ``transformers`` config with the shared sizes of ``base``; ``CONFIGS`` and
``MODEL_CLASSES`` (family -> ForCausalLM class name in ``transformers``) are this group's part of the registry.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .base import HEADS, HIDDEN, INTER, LAYERS, MAX_POS, PAD_ID, SOFTCAP, VOCAB, llama_like


def _cfg_recurrent_gemma():
    from transformers import RecurrentGemmaConfig

    return RecurrentGemmaConfig(
        **llama_like(
            num_key_value_heads=1, lru_width=HIDDEN, attention_window_size=4, conv1d_width=4, logits_soft_cap=SOFTCAP,
            block_types=["recurrent", "attention", "recurrent"], tie_word_embeddings=True,
        )
    )


def _cfg_minimax():
    from transformers import MiniMaxConfig

    return MiniMaxConfig(
        **llama_like(
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


def _cfg_zamba2():
    from transformers import Zamba2Config

    return Zamba2Config(
        **llama_like(
            num_key_value_heads=HEADS, layers_block_type=["mamba", "hybrid", "mamba"], mamba_d_state=8,
            mamba_d_conv=4, mamba_expand=2, mamba_ngroups=1, n_mamba_heads=4, chunk_size=4, num_mem_blocks=1,
            use_mem_rope=True, tie_word_embeddings=True,
        )
    )


def _cfg_falcon_h1():
    from transformers import FalconH1Config

    return FalconH1Config(
        **llama_like(
            head_dim=16, mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8, mamba_chunk_size=4,
            mlp_multipliers=[1.3, 0.7], attention_out_multiplier=0.8, ssm_out_multiplier=0.6,
            attention_in_multiplier=1.2, lm_head_multiplier=0.9, embedding_multiplier=1.5,
        )
    )


CONFIGS: dict[str, Callable[[], Any]] = {
    "recurrent_gemma": _cfg_recurrent_gemma,
    "minimax": _cfg_minimax,
    "rwkv": _cfg_rwkv,
    "zamba2": _cfg_zamba2,
    "falcon_h1": _cfg_falcon_h1,
}

MODEL_CLASSES: dict[str, str] = {
    "recurrent_gemma": "RecurrentGemmaForCausalLM",
    "minimax": "MiniMaxForCausalLM",
    "rwkv": "RwkvForCausalLM",
    "zamba2": "Zamba2ForCausalLM",
    "falcon_h1": "FalconH1ForCausalLM",
}
