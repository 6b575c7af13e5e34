"""Measure the low-precision gaps the tests' tolerances are sized from (issue 17): run from the repository root,
``OMP_NUM_THREADS=1 python notes/low_precision_gaps.py [--seeds 0 1 2] [--threads 1 2]``.

For each bfloat16 / float16 check in tests/ (test_compose, test_trust, test_low_precision, test_experts_layouts,
test_sources, test_frozen_norm) it prints the largest gap between the attribution and the model's OWN output (a
plain transformers forward of each prompt alone, in the model's dtype, the same edit made by a torch hook where
the test makes one), and the largest ``diagnostics["bound"] / max(1, |logit|)``, over the tests' own families,
granularities and prompts, for the seeds and torch thread counts asked for (the tests use seed 0; make test runs
two threads, the suite's default one).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import dla_recipes
from dla_recipes.testing import tiny

PROMPTS = ["w5 w6 w7 w8 w9 w10", "w11 w12", "w13 w14 w15 w16"]  # conftest's
TARGET, CONTRAST = "w20", "w21"


def own_logit(model, prompt, edit_hook=None) -> float:
    """The model's own logit difference at the last token of ``prompt`` alone (a plain forward in its dtype), before
    the soft-cap where the family has one; ``edit_hook(hf)`` installs a torch hook and returns its handle."""
    hf = model._module
    handle = edit_hook(hf) if edit_hook else None
    try:
        ids = model.tokenizer(prompt, return_tensors="pt")
        with torch.no_grad():
            logits = hf(input_ids=ids["input_ids"], attention_mask=ids["attention_mask"]).logits[0, -1].float()
    finally:
        if handle is not None:
            handle.remove()
    z = logits[model.tokenizer.convert_tokens_to_ids([TARGET, CONTRAST])].double()
    cap = dla_recipes.plan.build_plan(model).softcap
    if cap is not None:
        z = cap * torch.atanh(z / cap)
    return float(z[0] - z[1])


def gaps(attr, references) -> dict:
    """Largest |total - own|, |total + split - own|, |logit - own| relative to max(1, |own|); largest bound ratio."""
    own = torch.tensor(references, dtype=torch.float64)
    size = torch.clamp(own.abs(), min=1.0)
    split = attr.diagnostics.get("split_rounding", torch.zeros_like(attr.total)).double()
    return {
        "total": float(((attr.total.double() - own).abs() / size).max()),
        "total+split": float(((attr.total.double() + split - own).abs() / size).max()),
        "logit": float(((attr.logit.double() - own).abs() / size).max()),
        "bound": float((attr.diagnostics["bound"].double() / torch.clamp(attr.logit.double().abs(), min=1.0)).max()),
    }


def worst(rows: list[dict]) -> dict:
    return {key: max(row[key] for row in rows) for key in rows[0]}


def load(family, dtype, seed, **kwargs):
    return dla_recipes.load(tiny.build(family, seed).to(dtype), tokenizer=tiny.tokenizer(), device_map="cpu", **kwargs)


def compose_ablation(seed):
    """test_compose.test_ablated_head_bf16: llama in bfloat16, head 1 of block 1 zeroed."""
    from test_compose import HEAD, LAYER, ablate_fn, head_slice

    model = load("llama", torch.bfloat16, seed)
    path, sl = head_slice(model, LAYER, HEAD)
    attr = dla_recipes.attribute(model, PROMPTS, TARGET, contrast=CONTRAST, by="head", intervene=ablate_fn(path, sl))
    module = dla_recipes.plan.module_at(model.layers[LAYER], path)._module

    def hook(hf):
        def zero(_, args):
            x = args[0].clone()
            x[..., sl] = 0
            return (x, *args[1:])
        return module.register_forward_pre_hook(zero)

    refs = [own_logit(model, p, hook) for p in PROMPTS]
    row = gaps(attr, refs)
    row["abs_total"] = float((attr.total.double() - torch.tensor(refs, dtype=torch.float64)).abs().max())
    row["abs_logit"] = float((attr.logit.double() - torch.tensor(refs, dtype=torch.float64)).abs().max())
    row["|own|max"] = max(abs(r) for r in refs)
    return row


def plain_case(family, dtype, seed, by, **kwargs):
    model = load(family, dtype, seed, **kwargs)
    attr = dla_recipes.attribute(model, PROMPTS, TARGET, contrast=CONTRAST, by=by)
    return gaps(attr, [own_logit(model, p) for p in PROMPTS]), model, attr


def sources_case(family, dtype, seed):
    """test_sources.test_low_precision: by="source" against by="head" and the model's own logit."""
    row, model, attr = plain_case(family, dtype, seed, "source", attn_implementation="eager")
    heads = dla_recipes.attribute(model, PROMPTS, TARGET, contrast=CONTRAST, by="head")
    size = max(1.0, float(heads.values.abs().max()))
    row["heads_rel"] = float((attr.heads().values - heads.values).abs().max()) / size
    row["norm_fit_error"] = float(attr.diagnostics["norm_fit_error"])
    return row


def frozen_norm_case(draws):
    """test_frozen_norm.test_bfloat16_norm_is_frozen_at_its_own_precision over ``draws`` random draws."""
    from test_frozen_norm import _layernorm

    from dla_recipes.math import FrozenNorm

    ratios = []
    for draw in range(draws):
        torch.manual_seed(draw)
        norm = _layernorm()[0].to(torch.bfloat16)
        stream = torch.randn(4, 24, dtype=torch.bfloat16)
        frozen = FrozenNorm(norm, stream)
        with torch.no_grad():
            reference = norm(stream).float()
            ratios.append(float((frozen(stream) + frozen.bias - reference).abs().max() / reference.abs().max()))
    return {"ratio": max(ratios)}


def float64_case(family, seed):
    """test_trust.test_bfloat16_parts_match_a_float64_recomputation (its ``float64_gaps``, the ratio kept instead of
    asserted): the worst block part's gap to the float64 recomputation / the largest part."""
    from test_trust import float64_gaps

    return {"ratio": max(worst / largest for _, worst, largest in float64_gaps(load(family, torch.bfloat16, seed), family))}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args()
    bf16, fp16 = torch.bfloat16, torch.float16
    results: dict[str, list[dict]] = {}

    def add(name, row):
        results.setdefault(name, []).append(row)
        print(f"  {name}: " + ", ".join(f"{k} {v:.3g}" for k, v in row.items()), flush=True)

    for threads in args.threads:
        torch.set_num_threads(threads)
        for seed in args.seeds:
            print(f"threads {threads}, seed {seed}", flush=True)
            add("compose.ablated_head_bf16", compose_ablation(seed))
            for dtype in (bf16, fp16):
                for family in ("llama", "gemma3", "gpt2"):
                    for by in ("block", "head", "neuron"):
                        add(f"trust.low_precision.{dtype}", plain_case(family, dtype, seed, by)[0])
            for family in ("llama", "mixtral", "gpt2"):
                add("low_precision.bf16_neuron", plain_case(family, bf16, seed, "neuron")[0])
            for family in ("gpt_oss", "dbrx", "llama4_text"):
                add("experts_layouts.bf16_neuron", plain_case(family, bf16, seed, "neuron")[0])
            for dtype in (bf16, fp16):
                for family in ("llama", "gemma3"):
                    add(f"sources.low_precision.{dtype}", sources_case(family, dtype, seed))
            for family in ("llama", "gemma3"):
                add("trust.float64_recomputation", float64_case(family, seed))
    add("frozen_norm.bf16 (200 draws)", frozen_norm_case(200))
    print("\nlargest over every run:")
    for name, rows in results.items():
        print(f"{name}: " + ", ".join(f"{k} {v:.3g}" for k, v in worst(rows).items()))


if __name__ == "__main__":
    main()
