"""Families described by the shared shapes: one tiny config per model type, from its ``AutoConfig``.

``_SHAPED`` maps a ``transformers`` model type to its ForCausalLM class and the config overrides on top of
``llama_like``; ``SHAPED_FAMILIES`` are its keys (they follow the explicit families in ``FAMILIES``), and
``CONFIGS`` / ``MODEL_CLASSES`` are this group's part of the registry.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

from .base import HEADS, HIDDEN, INTER, LAYERS, MAX_POS, SOFTCAP, llama_like

# Config keyword arguments are spelled as keyword arguments: dict(name=value), as in Config(name=value).
# ruff: noqa: C408

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

# model type -> (ForCausalLM class, config overrides on top of llama_like)
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
    # logit_scale None (its default: the head applies none), sliding layers with RoPE, a global layer without (NoPE)
    "cohere_compass_text": ("CohereCompassForCausalLM", dict(logit_scale=None, sliding_window=4, layer_types=_SW,
                                                              rope_parameters={"full_attention": None,
                                                                               "sliding_attention": {
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
    # a batch longer than max_inference_chunksize runs chunk by chunk, through a bfloat16 cache without use_cache
    # (refused); 16 is above every suite prompt, so the tests can cross it
    "xlstm": ("xLSTMForCausalLM", dict(embedding_dim=HIDDEN, num_blocks=LAYERS, num_heads=HEADS, qk_dim_factor=1.0,
                                       chunk_size=4, mode="inference", output_logit_soft_cap=SOFTCAP,
                                       max_inference_chunksize=16, use_cache=False)),
}


def _cfg_shaped(model_type: str):
    """A fresh config: the overrides are deep-copied, since a config may edit a list it is given in place
    (Gemma4UnifiedConfig forces its last layer type to ``full_attention`` inside ``layer_types``); sharing ``_SW``
    made every later ministral / cohere2 / vaultgemma / granite_swa model depend on whether gemma4_unified_text was
    built before it in the process (its last block full instead of sliding: logits moved by up to 0.11)."""
    from transformers import AutoConfig

    return AutoConfig.for_model(model_type, **llama_like(**copy.deepcopy(_SHAPED[model_type][1])))


SHAPED_FAMILIES: tuple[str, ...] = tuple(_SHAPED)
CONFIGS: dict[str, Callable[[], Any]] = {t: (lambda t=t: _cfg_shaped(t)) for t in _SHAPED}
MODEL_CLASSES: dict[str, str] = {t: cls for t, (cls, _) in _SHAPED.items()}
