"""False alarms of the self-check in low precision: many (prompt, target, contrast) calls on healthy models.

A healthy model must never raise ``ExactnessError``; a model whose numbers overflow (Gemma-3 in float16) must raise
``NonFiniteError`` and never return NaN values. The calls are generated deterministically: for each prompt of a fixed
list, the model's own top tokens are paired (top-1 minus top-2, top-1 minus top-3, ...: small differences of large
logits, the hardest case for a rounding bound), plus a few fixed pairs (" the" - " a" on "The Vatican is in",
" Paris" - " Rome"). Granularity cycles head, block, head, neuron.

    OMP_NUM_THREADS=1 python benchmarks/false_alarms.py --models smollm2 gemma3 --dtypes bfloat16 float16 \\
        --device cpu --calls 200 --out false_alarms.json

Calls are run in batches; a batch that raises is rerun one call at a time, so each call is counted on its own.
Works with the code on ``main`` before the precision-derived tolerance (it only needs ``dla_recipes.attribute``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch

import dla_recipes
from dla_recipes import models

PROMPTS = [
    "The Eiffel Tower is in the city of",
    "The Vatican is in",
    "The capital of France is",
    "The capital of Italy is",
    "The Colosseum is in the city of",
    "Berlin is the capital of",
    "The largest planet in the solar system is",
    "Water is made of hydrogen and",
    "The opposite of hot is",
    "One, two, three, four,",
    "The sun rises in the",
    "Shakespeare wrote Romeo and",
    "The chemical symbol for gold is",
    "A week has seven",
    "The color of the sky on a clear day is",
    "Mount Everest is the tallest",
    "The currency of Japan is the",
    "To be or not to",
    "The first president of the United States was George",
    "Cats and dogs are common household",
    "The Great Wall is in",
    "Paris and Rome are both European",
    "She opened the door and saw a",
    "In 1969, humans first walked on the",
    "The author of Harry Potter is J. K.",
    "def add(a, b):\n    return a",
    "The boiling point of water is 100 degrees",
    "Tokyo is the capital of",
]
FIXED = [("The Vatican is in", " the", " a"), ("The Eiffel Tower is in the city of", " Paris", " Rome"),
         ("The capital of France is", " Paris", " Rome"), ("The Colosseum is in the city of", " Rome", " Paris")]
GRANULARITIES = ("head", "block", "head", "neuron")
PATHS = {"smollm2": models.default_model_path, "gemma3": models.gemma3_270m_path}


def make_calls(model, n: int) -> list[tuple[str, int, int, str]]:
    """``n`` deterministic ``(prompt, target id, contrast id, by)``: fixed pairs, then each prompt's top tokens."""
    tok = model.tokenizer
    calls = []
    for prompt, target, contrast in FIXED:
        ids = [tok(t, add_special_tokens=False)["input_ids"] for t in (target, contrast)]
        if all(len(i) == 1 for i in ids):
            calls.append((prompt, ids[0][0], ids[1][0]))
    hf = model._module
    device = next(hf.parameters()).device
    top = {}
    with torch.no_grad():
        for prompt in PROMPTS:
            enc = tok(prompt, return_tensors="pt").to(device)
            logits = hf(**enc).logits[0, -1].float()
            top[prompt] = torch.topk(torch.nan_to_num(logits, nan=0.0), 12).indices.tolist()
    rank = 1
    while len(calls) < n and rank < 12:
        for prompt in PROMPTS:
            if len(calls) >= n:
                break
            calls.append((prompt, top[prompt][0], top[prompt][rank]))
        rank += 1
    return [(p, t, c, GRANULARITIES[k % len(GRANULARITIES)]) for k, (p, t, c) in enumerate(calls)]


CHECK: dict = {}  # extra keyword arguments of attribute (--check adds: check="adds"; main has no such argument)


def run_one(model, prompts, targets, contrasts, by) -> list[dict]:
    """Attribute a batch; one record per call: ok (gap, bound) or the error's class and message."""
    try:
        attr = dla_recipes.attribute(model, list(prompts), list(targets), contrast=list(contrasts), by=by, **CHECK)
    except dla_recipes.DLAError as error:
        if type(error).__name__ == "NonFiniteError":  # the model overflows: every call of the batch is refused
            return [{"outcome": "NonFiniteError", "message": str(error)[:400]} for _ in prompts]
        if len(prompts) > 1:
            return [r for k in range(len(prompts))
                    for r in run_one(model, prompts[k:k + 1], targets[k:k + 1], contrasts[k:k + 1], by)]
        return [{"outcome": type(error).__name__, "message": str(error)[:400]}]
    out = []
    bounds = attr.diagnostics.get("bound")
    for k in range(len(prompts)):
        gap = float((attr.values[k].sum() + attr.constant[k] - attr.logit[k]).abs())
        finite = bool(torch.isfinite(attr.values[k]).all()) and bool(torch.isfinite(attr.logit[k]))
        record = {"outcome": "ok" if finite else "nan_returned", "gap": gap, "logit": float(attr.logit[k])}
        if bounds is not None:
            record["bound"] = float(bounds[k])
        out.append(record)
    return out


def sweep(name: str, dtype: torch.dtype, device: str, n: int, batch: int) -> dict:
    path = PATHS[name]()
    kwargs = {"dtype": dtype, "dispatch": True}
    kwargs["device_map"] = "cuda" if device == "cuda" else "cpu"
    model = dla_recipes.load(str(path), **kwargs)
    calls = make_calls(model, n)
    start = time.perf_counter()
    records = []
    for by in ("head", "block", "neuron"):
        mine = [c for c in calls if c[3] == by]
        for i in range(0, len(mine), batch):
            chunk = mine[i:i + batch]
            results = run_one(model, [c[0] for c in chunk], [c[1] for c in chunk], [c[2] for c in chunk], by)
            for (prompt, t, c, _), r in zip(chunk, results):
                r.update(prompt=prompt, target=model.tokenizer.decode([t]), contrast=model.tokenizer.decode([c]), by=by)
                records.append(r)
    counts: dict[str, int] = {}
    for r in records:
        counts[r["outcome"]] = counts.get(r["outcome"], 0) + 1
    ratios = [r["gap"] / r["bound"] for r in records if r.get("bound")]
    return {
        "model": name, "dtype": str(dtype).replace("torch.", ""), "device": device, "calls": len(records),
        "counts": counts, "false_alarms": counts.get("ExactnessError", 0),
        "max_gap_over_bound": max(ratios) if ratios else None,
        "seconds": round(time.perf_counter() - start, 1), "records": records,
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["smollm2", "gemma3"], choices=sorted(PATHS))
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float16"])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--batch", type=int, default=10, help="calls per attribute() (a failing batch is split)")
    parser.add_argument("--out", default="false_alarms.json")
    parser.add_argument("--check", default=None, help="attribute(check=...): 'adds', the per-add check")
    args = parser.parse_args(argv)
    if args.check is not None:
        CHECK["check"] = args.check
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    results = []
    for name in args.models:
        for dtype in args.dtypes:
            result = sweep(name, getattr(torch, dtype), args.device, args.calls, args.batch)
            results.append(result)
            summary = {k: v for k, v in result.items() if k != "records"}
            print(json.dumps(summary), flush=True)
            with open(args.out, "w") as f:
                json.dump(results, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
