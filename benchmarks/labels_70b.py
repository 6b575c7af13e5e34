"""The time of a ``by="neuron"`` plan's labels at Llama-3.1-70B's shape (2.3M columns), and of the views that read
every column: the timing ``tests/test_costs.py`` used to assert (a timed test fails on a busy machine), measured here.

    .venv/bin/python benchmarks/labels_70b.py [--repeats 5] [--out build/labels_70b.json]

The model is Llama-3.1-70B's config loaded on the meta device (no weights). Each repeat clears the plan cache and
times, in one process: the plan, its components and labels, ``components_of`` and the ``Attribution`` (``build``),
then ``top(5)``, ``blocks()``, ``labels.index`` of the last neuron and ``grid("N")`` (``views``). Prints the medians
and the ranges; ``tests/test_costs.py`` checks structurally that none of this makes a per-neuron object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import torch

LLAMA_70B = {"hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64,
             "num_key_value_heads": 8, "vocab_size": 128256}


def load_70b(folder: Path):
    """A StandardizedTransformer of Llama-3.1-70B's shape on the meta device."""
    from transformers import LlamaConfig

    import dla_recipes
    from dla_recipes.testing import tiny

    LlamaConfig(**LLAMA_70B).save_pretrained(folder)
    return dla_recipes.load(str(folder), tokenizer=tiny.tokenizer(128), check_renaming=False)


def one_round(model, values: torch.Tensor) -> dict[str, float]:
    """Seconds to build the plan's neuron labels and an Attribution, and to read the views."""
    from dla_recipes.plan import build_plan
    from dla_recipes.present.attribution import Attribution
    from dla_recipes.result import components_of

    build_plan.cache_clear()
    start = time.perf_counter()
    plan = build_plan(model)
    plan.components("neuron")
    plan.labels("neuron")
    cached, cached_labels = components_of(plan, "neuron")
    attr = Attribution(values=values, labels=cached_labels, constant=torch.zeros(1), logit=torch.ones(1),
                       output_logit=torch.ones(1), error=0.0, by="neuron", components=cached)
    built = time.perf_counter() - start
    start = time.perf_counter()
    attr.top(5, kind="neuron")
    attr.blocks()
    attr.labels.index(f"L{LLAMA_70B['num_hidden_layers'] - 1}.N{LLAMA_70B['intermediate_size'] - 1}")
    attr.grid("N")
    return {"build_s": built, "views_s": time.perf_counter() - start}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    import pandas  # noqa: F401 - top() builds a DataFrame: its first import is not the labels' cost

    with tempfile.TemporaryDirectory() as folder:
        model = load_70b(Path(folder))
    layers, d_mlp = LLAMA_70B["num_hidden_layers"], LLAMA_70B["intermediate_size"]
    values = torch.randn(1, 1 + layers * (1 + d_mlp), generator=torch.Generator().manual_seed(0))
    rounds = [one_round(model, values) for _ in range(args.repeats)]
    result = {"columns": 1 + layers * (1 + d_mlp), "threads": int(os.environ["OMP_NUM_THREADS"]),
              "rounds": rounds}
    for field in ("build_s", "views_s"):
        seen = [r[field] for r in rounds]
        result[field] = {"median": statistics.median(seen), "min": min(seen), "max": max(seen)}
        print(f"{field}: median {result[field]['median']:.4f} s (range {min(seen):.4f}-{max(seen):.4f}) over "
              f"{len(seen)} rounds, {result['columns']} columns")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
