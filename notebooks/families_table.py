"""Generate the docs page listing every decoder model type dla_recipes knows, from the family table itself.

    python notebooks/families_table.py            # print the page (Markdown)
    python notebooks/families_table.py OUT.md     # write it

``notebooks/mkdocs_hook.py`` calls ``render()`` at build time and adds the result to the site as
``family-table.md``, so the page always lists what ``dla_recipes/families/`` holds: each model type, what each
kind of block writes into the residual stream, the granularities it splits into, whether left padding is safe, a
few well-known checkpoints of that type, and the model types refused with the reason (``families.REFUSED``).
``count()`` is the number of model types with an entry (the README quotes it; a test keeps the two equal).
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# Well-known public checkpoints per model type (hub ids), for orientation only: nothing here is downloaded.
CHECKPOINTS: dict[str, tuple[str, ...]] = {
    "gpt2": ("openai-community/gpt2", "openai-community/gpt2-xl"),
    "llama": ("meta-llama/Llama-3.1-8B", "meta-llama/Llama-3.2-1B", "HuggingFaceTB/SmolLM2-135M-Instruct"),
    "mistral": ("mistralai/Mistral-7B-v0.3",),
    "qwen2": ("Qwen/Qwen2.5-7B-Instruct",),
    "qwen3": ("Qwen/Qwen3-8B", "Qwen/Qwen3-0.6B"),
    "gemma": ("google/gemma-7b", "google/gemma-2b"),
    "olmo": ("allenai/OLMo-1B-hf",),
    "phi3": ("microsoft/Phi-3-mini-4k-instruct", "microsoft/phi-4"),
    "smollm3": ("HuggingFaceTB/SmolLM3-3B",),
    "apertus": ("swiss-ai/Apertus-8B-2509",),
    "gptj": ("EleutherAI/gpt-j-6b",),
    "gpt_neox": ("EleutherAI/pythia-160m", "EleutherAI/gpt-neox-20b"),
    "phi": ("microsoft/phi-2",),
    "cohere": ("CohereForAI/c4ai-command-r-v01",),
    "gemma2": ("google/gemma-2-9b", "google/gemma-2-2b-it"),
    "gemma3_text": ("google/gemma-3-270m", "google/gemma-3-1b-it"),
    "gemma3": ("google/gemma-3-4b-it",),
    "olmo2": ("allenai/OLMo-2-1124-7B",),
    "exaone4": ("LGAI-EXAONE/EXAONE-4.0-1.2B",),
    "glm4": ("THUDM/GLM-4-9B-0414",),
    "mixtral": ("mistralai/Mixtral-8x7B-v0.1",),
    "olmoe": ("allenai/OLMoE-1B-7B-0924",),
    "qwen2_moe": ("Qwen/Qwen1.5-MoE-A2.7B",),
    "deepseek_v3": ("deepseek-ai/DeepSeek-V3", "deepseek-ai/DeepSeek-R1"),
    "doge": ("SmallDoge/Doge-160M",),
    "recurrent_gemma": ("google/recurrentgemma-2b",),
    "zamba2": ("Zyphra/Zamba2-1.2B",),
    "jetmoe": ("jetmoe/jetmoe-8b",),
    "granite": ("ibm-granite/granite-3.3-8b-instruct",),
    "bloom": ("bigscience/bloom-560m",),
    "falcon": ("tiiuae/falcon-7b",),
    "opt": ("facebook/opt-125m",),
    "arcee": ("arcee-ai/AFM-4.5B",),
    "bitnet": ("microsoft/bitnet-b1.58-2B-4T",),
    "cwm": ("facebook/cwm",),
    "ernie4_5": ("baidu/ERNIE-4.5-0.3B-PT",),
    "exaone": ("LGAI-EXAONE/EXAONE-3.5-7.8B-Instruct",),
    "glm": ("THUDM/glm-4-9b-hf",),
    "helium": ("kyutai/helium-1-2b",),
    "hunyuan_v1_dense": ("tencent/Hunyuan-7B-Instruct",),
    "internlm3": ("internlm/internlm3-8b-instruct",),
    "ministral": ("mistralai/Ministral-8B-Instruct-2410",),
    "nemotron": ("nvidia/Minitron-4B-Base",),
    "seed_oss": ("ByteDance-Seed/Seed-OSS-36B-Instruct",),
    "stablelm": ("stabilityai/stablelm-2-1_6b", "stabilityai/stablelm-3b-4e1t"),
    "gpt_bigcode": ("bigcode/starcoderbase-1b", "bigcode/gpt_bigcode-santacoder"),
    "gpt_neo": ("EleutherAI/gpt-neo-125m", "EleutherAI/gpt-neo-2.7B"),
    "starcoder2": ("bigcode/starcoder2-3b", "bigcode/starcoder2-15b"),
    "persimmon": ("adept/persimmon-8b-base",),
    "codegen": ("Salesforce/codegen-350M-mono",),
    "xglm": ("facebook/xglm-564M",),
    "biogpt": ("microsoft/biogpt",),
    "cohere2": ("CohereForAI/c4ai-command-r7b-12-2024", "CohereLabs/command-a-03-2025"),
    "vaultgemma": ("google/vaultgemma-1b",),
    "mpt": ("mosaicml/mpt-7b",),
    "ctrl": ("Salesforce/ctrl",),
    "qwen3_moe": ("Qwen/Qwen3-30B-A3B", "Qwen/Qwen3-235B-A22B"),
    "phimoe": ("microsoft/Phi-3.5-MoE-instruct",),
    "minimax_m2": ("MiniMaxAI/MiniMax-M2",),
    "deepseek_v2": ("deepseek-ai/DeepSeek-V2-Lite",),
    "deepseek_v32": ("deepseek-ai/DeepSeek-V3.2-Exp",),
    "glm4_moe": ("zai-org/GLM-4.5-Air", "zai-org/GLM-4.6"),
    "dots1": ("rednote-hilab/dots.llm1.inst",),
    "hunyuan_v1_moe": ("tencent/Hunyuan-A13B-Instruct",),
    "ernie4_5_moe": ("baidu/ERNIE-4.5-21B-A3B-PT",),
    "mimo_v2_flash": ("XiaomiMiMo/MiMo-V2-Flash",),
    "kimi_linear": ("moonshotai/Kimi-Linear-48B-A3B-Instruct",),
    "flex_olmo": ("allenai/FlexOlmo-7x7B-1T",),
    "qwen3_next": ("Qwen/Qwen3-Next-80B-A3B-Instruct",),
    "granitemoe": ("ibm-granite/granite-3.1-3b-a800m-instruct",),
    "granitemoehybrid": ("ibm-granite/granite-4.0-h-small", "ibm-granite/granite-4.0-micro"),
    "mamba": ("state-spaces/mamba-130m-hf", "state-spaces/mamba-2.8b-hf"),
    "mamba2": ("mistralai/Mamba-Codestral-7B-v0.1",),
    "falcon_mamba": ("tiiuae/falcon-mamba-7b",),
    "nemotron_h": ("nvidia/NVIDIA-Nemotron-Nano-9B-v2", "nvidia/Nemotron-H-8B-Base-8K"),
    "zamba": ("Zyphra/Zamba-7B-v1",),
    "jamba": ("ai21labs/AI21-Jamba-Mini-1.6", "ai21labs/Jamba-v0.1"),
    "bamba": ("ibm-ai-platform/Bamba-9B-v2",),
    "lfm2": ("LiquidAI/LFM2-1.2B", "LiquidAI/LFM2-350M"),
    "lfm2_moe": ("LiquidAI/LFM2-8B-A1B",),
    "xlstm": ("NX-AI/xLSTM-7b",),
}

GRANULARITY = {"heads": "head", "neurons": "neuron", "experts": "neuron, expert"}


def _splits(term) -> str | None:
    """What the term splits into, in words: ``"heads"``, ``"neurons"``, ``"experts"`` (None: never split)."""
    return next((word for word, splits in (("heads", term.splits_heads), ("neurons", term.splits_neurons),
                                           ("experts", term.splits_experts)) if splits), None)


def _write(term) -> str:
    """One term in words: its label and where it is read (and what shapes it)."""
    where = term.output.rsplit(".", 1)[0]
    parts = [f"`{term.name}` = `{where}`"]
    if term.split:
        parts.append(f"split into {_splits(term)} at `{term.split.projection}`")
    shared = getattr(term.split, "shared", None)  # Experts only
    if shared:
        parts.append(f"+ shared `{shared.rsplit('.', 1)[0]}`")
    if term.write.multiplier:
        parts.append(f"× `{term.write.multiplier}`")
    if term.write.outer_norm:
        parts.append(f"under `{term.write.outer_norm}`")
    if term.parallel:
        parts.append("parallel")
    return " ".join(parts)


def _granularities(family) -> str:
    splits = {_splits(t) for kind in family.kinds for t in kind.terms if t.split}
    found = ["block"] + sorted({g for s in splits for g in GRANULARITY[s].split(", ")},
                               key=["head", "neuron", "expert"].index)
    return ", ".join(found)


def _blocks(family) -> str:
    rows = []
    for kind in family.kinds:
        when = kind.when if isinstance(kind.when, (tuple, type(None))) else (kind.when,)
        label = f"*where {' and '.join(f'`{w}`' for w in when)}*: " if when else ""
        rows.append(label + "; ".join(_write(t) for t in kind.terms))
    head = []
    if family.layer_scale:
        head.append(f"stream × `{family.layer_scale}` after each block")
    if family.logits_times:
        head.append(f"logits × `{family.logits_times}`")
    if family.logits_over:
        head.append(f"logits ÷ `{family.logits_over}`")
    if family.softcap:
        head.append(f"logits soft-capped by `{family.softcap}`")
    return "<br>".join(rows + head)


def model_types() -> list[tuple[str, object]]:
    """``(model_type, Family)`` for every model type with an entry, in table order."""
    from dla_recipes.families import FAMILIES

    return [(t, f) for f in FAMILIES for t in f.model_types]


def count() -> int:
    """The number of model types with a family entry."""
    return len({t for t, _ in model_types()})


def render() -> str:
    """The page, as Markdown."""
    from dla_recipes.families import FAMILIES, REFUSED

    lines = [
        "# Family table",
        "",
        (f"dla_recipes has an entry for **{count()} model types** (`config.model_type`) in {len(FAMILIES)} family "
         "entries; every entry's tiny perturbed model is checked in the test suite against the model's own logits "
         "at every granularity, and its padded batch against each prompt alone. This page is generated from "
         "`dla_recipes/families/` (`notebooks/families_table.py`)."),
        "",
        ("*What each block writes*: each term's label, the module whose output is added (paths below "
         "`model.layers[i]` in nnterp's renamed vocabulary: `self_attn`, `mlp`, then native names), where it splits "
         "into heads / neurons / experts, and the kind of block it applies to when a family has several."),
        "",
        ("*Padding safe*: left padding leaves each prompt's logits unchanged (measured on the tiny model; declared "
         "unsafe where a recurrent state, a convolution or a sparse-attention indexer may read the pads). A "
         "padding-unsafe family's prompts are never attributed padded."),
        "",
        "## Model types",
        "",
        "| model type | entry | what each block writes | granularities | padding safe | checkpoints (examples) |",
        "|---|---|---|---|---|---|",
    ]
    for model_type, family in model_types():
        checkpoints = ", ".join(f"`{c}`" for c in CHECKPOINTS.get(model_type, ())) or "–"
        lines.append(
            f"| `{model_type}` | {family.name} | {_blocks(family)} | {_granularities(family)} | "
            f"{'yes' if family.padding_safe else 'no'} | {checkpoints} |"
        )
    lines += ["", "## Refused model types", ""]
    if REFUSED:
        lines += ["| model type | why there is no exact entry yet |", "|---|---|"]
        lines += [f"| `{t}` | {reason} |" for t, reason in sorted(REFUSED.items())]
        lines += ["", "`dla_recipes.families.family_of` raises `UnknownFamilyError` with this reason for these types."]
    else:
        lines.append("None.")
    lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    text = render()
    if len(sys.argv) > 1:
        Path(sys.argv[1]).write_text(text, encoding="utf-8")
    else:
        print(text)
