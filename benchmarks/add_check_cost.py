"""The cost of the per-add check (``math.adds``): ``attribute(by="block")`` at batch 16 on SmolLM2, ``check="adds"``
against the default ``check="logit"`` (the whole-logit bound only, main's reads).

Each round runs both, in alternating order; the medians of their times and of the per-round ratios are reported
(same run, same process). Prints one JSON line per dtype.

    OMP_NUM_THREADS=1 python benchmarks/add_check_cost.py --dtypes float32 bfloat16 --rounds 15
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

import dla_recipes
from dla_recipes import models

PROMPTS = ["The Eiffel Tower is in the city of", "The capital of France is", "Berlin is the capital of",
           "The opposite of hot is", "One, two, three, four,", "The sun rises in the", "A week has seven",
           "Shakespeare wrote Romeo and", "To be or not to", "The Great Wall is in", "Tokyo is the capital of",
           "Water is made of hydrogen and", "The currency of Japan is the", "Mount Everest is the tallest",
           "Cats and dogs are common household", "In 1969, humans first walked on the"]


def timed(model, by: str, check: str) -> float:
    start = time.perf_counter()
    dla_recipes.attribute(model, PROMPTS, " the", by=by, check=check)
    return time.perf_counter() - start


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--by", default="block")
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args(argv)
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    for dtype in args.dtypes:
        model = dla_recipes.load(str(models.default_model_path()), dtype=getattr(torch, dtype))
        on, off, ratios = [], [], []
        for k in range(args.rounds + 1):
            pair = {}
            for mode in (("on", "off") if k % 2 else ("off", "on")):
                pair[mode] = timed(model, args.by, "adds" if mode == "on" else "logit")
            if k:  # the first round warms both up (the norms are probed once per model)
                on.append(pair["on"])
                off.append(pair["off"])
                ratios.append(pair["on"] / pair["off"])
        print(json.dumps({"dtype": dtype, "by": args.by, "batch": len(PROMPTS), "rounds": args.rounds,
                          "median_on_s": round(statistics.median(on), 4), "median_off_s": round(statistics.median(off), 4),
                          "median_ratio": round(statistics.median(ratios), 4)}), flush=True)


if __name__ == "__main__":
    sys.exit(main())
