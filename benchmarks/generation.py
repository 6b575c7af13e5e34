"""What the model says (issue 33): ``python benchmarks/generation.py [--model smollm2] [--tokens 32] [--repeats 5]``.

``attribute_generation`` is the model's own generation, then ONE teacher-forced attribution pass over prompt +
answer. This measures, on chat prompts of SmolLM2-135M-Instruct (the default model) in the same process:

- cost: the attribution pass (``attribute(model, prompt + answer, "next", position=<each answer's span>, by=...)``,
  runner-up contrast) as a ratio to the generation itself (``generation.run.generate``: nnsight's
  ``model.generate`` of ``--tokens`` tokens with each step's logits reduced in the trace), the two interleaved
  (``common.time_methods``), the median of the per-round ratios;
- per dtype (float32, bfloat16): the largest generation-vs-teacher-forced logit gap (``generation.gap``: the
  generation's own logit difference of each step minus the teacher-forced one the parts sum to), absolute and over
  ``max(1, |logit|)``, and the largest error of the parts against a plain transformers forward of each prompt +
  answer alone (no nnsight: ``model._module``, soft-cap none on SmolLM2), over ``max(1, |logit|)``.

It prints one JSON object (and a markdown table with ``--markdown``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common

CHATS = [[{"role": "user", "content": "What is the capital of France? Answer in one word."}],
         [{"role": "user", "content": "Name a primary color."}],
         [{"role": "user", "content": "Write a haiku about the sea."}],
         [{"role": "user", "content": "What is 2 + 2?"}]]


def plain_error(model, attr) -> tuple[float, float]:
    """Max over the generated steps of ``|parts + constant - plain forward's logit difference|``, over ``max(1,
    |logit|)`` and over twice the step's self-check bound (two forwards, each within it)."""
    import torch

    worst, over_bound = 0.0, 0.0
    for b, (answer, contrasts) in enumerate(zip(attr.generation.answers, attr.generation.contrast_ids)):
        start = attr.generation.prompt_lengths[b] - 1
        ids = torch.tensor([ids_of(attr, b)])
        with torch.no_grad():
            z = model._module(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0].double()
        for k, (token, other) in enumerate(zip(answer, contrasts)):
            want = float(z[start + k, token] - z[start + k, other])
            total = float(attr.values[b, k].double().sum() + attr.constant[b, k].double())
            worst = max(worst, abs(total - want) / max(1.0, abs(want)))
            over_bound = max(over_bound, abs(total - want) / (2 * float(attr.diagnostics["bound"][b, k])))
    return worst, over_bound


def ids_of(attr, b: int) -> list[int]:
    """Prompt ``b`` + its answer: the teacher-forced sequence (the prompt's ids from the chat template)."""
    return list(PROMPT_IDS[b]) + list(attr.generation.answers[b])


PROMPT_IDS: list = []


def measure(dtype, args) -> dict:
    """One dtype's numbers (see the module docstring)."""
    import dla_recipes
    from dla_recipes import models
    from dla_recipes.generation import inputs, run
    from dla_recipes.plan import build_plan

    model = dla_recipes.load(models.REGISTRY[models.canonical_key(args.model)](), dtype=dtype, device_map="cpu",
                             dispatch=True)
    plan, problems = build_plan(model), []
    PROMPT_IDS[:] = inputs.prompt_ids(model.tokenizer, CHATS, problems)[0]
    settings = inputs.check_settings(model._module.generation_config, args.tokens, None, None, problems)
    attr = dla_recipes.attribute_generation(model, CHATS, args.tokens, contrast="runner-up", by=args.by)
    generated = run.generate(model, plan, PROMPT_IDS, settings, None)
    sequences, spans = run.forced(generated.prompts, generated.answers)
    grid = run.contrast_grid("runner-up", generated.answers, generated.runner_up, None)
    methods = {
        "generation": lambda: run.generate(model, plan, PROMPT_IDS, settings, None),
        "attribution": lambda: dla_recipes.attribute(model, sequences, "next", contrast=grid, position=spans,
                                                     by=args.by),
    }
    timed = common.time_methods(methods, args.repeats, warmup=1, baseline="generation")
    gap = attr.generation.gap[attr.mask].double()
    logit = attr.output_logit[attr.mask].double()
    bound = attr.diagnostics["bound"][attr.mask].double()
    error, error_over_bound = plain_error(model, attr)
    return {
        "steps": int(attr.mask.sum()),
        "answers": [t[:60] for t in attr.generation.texts],
        "gap_max_abs": float(gap.abs().max()),
        "gap_max_rel": float((gap.abs() / logit.abs().clamp(min=1.0)).max()),
        "gap_median_abs": float(gap.abs().median()),
        "gap_over_2_bound": float((gap.abs() / (2 * bound)).max()),
        "error_vs_plain_forward_rel": error,
        "error_vs_plain_forward_over_2_bound": error_over_bound,
        "self_check_error": float(attr.error),
        "generation_s": timed["generation"]["median_s"],
        "attribution_s": timed["attribution"]["median_s"],
        "attribution_over_generation": timed["attribution"].get("paired_ratio"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--by", default="head")
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    common.set_threads()
    import torch

    out = {"model": args.model, "tokens": args.tokens, "by": args.by, "prompts": len(CHATS),
           "threads": torch.get_num_threads(), "torch": torch.__version__,
           "dtypes": {str(d).removeprefix("torch."): measure(d, args) for d in (torch.float32, torch.bfloat16)}}
    out["load_average"] = common.load_average()
    print(json.dumps(out, indent=1))
    if args.markdown:
        print("\n| dtype | steps | attribution / generation | gap max (abs) | gap max / max(1,|z|) | gap / 2 bound | "
              "error vs plain forward / max(1,|z|) | error / 2 bound |\n|---|---:|---:|---:|---:|---:|---:|---:|")
        for name, d in out["dtypes"].items():
            print(f"| {name} | {d['steps']} | {d['attribution_over_generation']:.3f} | {d['gap_max_abs']:.3g} | "
                  f"{d['gap_max_rel']:.3g} | {d['gap_over_2_bound']:.3g} | {d['error_vs_plain_forward_rel']:.3g} | "
                  f"{d['error_vs_plain_forward_over_2_bound']:.3g} |")


if __name__ == "__main__":
    main()
