"""The registry of the tiny families and what builds them: ``config``, ``build``, ``perturb``, ``standardized``.

``FAMILIES`` fixes the order (the explicit families, then the shaped ones); the config builders and model classes
come from the groups ``dense``, ``experts``, ``hybrid`` and ``shaped``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

import dla_recipes  # standardized() loads with it (and it applies the nnterp-on-nnsight-0.8 shim)

from . import dense, experts, hybrid, shaped
from .base import tokenizer
from .shaped import SHAPED_FAMILIES

if TYPE_CHECKING:
    import transformers


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
    # --- computed scalars, norms on the stream, norms without weights
    "minicpm3",
    "beam",
    "minimax",
    "rwkv",
    "nanochat",
    "hy_v4",
    "inkling",
    "openai_gpt",
    # --- end of the computed scalars and norms
    "zamba2",
    "jetmoe",
    # --- experts with their own layouts, and composed optional terms
    "gpt_oss",
    "aria_text",
    "llama4_text",
    "minimax_m3_vl_text",
    "cohere2_moe",
    "falcon_h1",
    "dbrx",
    "gemma4_moe_ple",
) + SHAPED_FAMILIES


_CONFIGS: dict[str, Callable[[], Any]] = {**dense.CONFIGS, **experts.CONFIGS, **hybrid.CONFIGS, **shaped.CONFIGS}
_MODEL_CLASSES: dict[str, str] = {
    **dense.MODEL_CLASSES, **experts.MODEL_CLASSES, **hybrid.MODEL_CLASSES, **shaped.MODEL_CLASSES
}


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


def build(family: str, seed: int = 0, *, perturbed: bool = True) -> transformers.PreTrainedModel:
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
    routing tables ``tid2eid`` get random expert ids (distinct per row, except every third row: one expert in every
    slot, as an untrained table of zeros has it); DeepSeek-V4 hyper-connection biases
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
        if leaf == "tid2eid":  # DeepSeek-V4 hash routing: random experts per token, every third one repeated
            n_exp = model.config.n_routed_experts
            rows = torch.stack([torch.randperm(n_exp, generator=gen)[: t.shape[1]] for _ in range(t.shape[0])])
            rows[::3] = rows[::3, :1]  # tokens 0, 3, 6, ...: one expert in every slot (the model adds each slot)
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
