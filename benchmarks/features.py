"""Dictionary features (issue 32): time and peak memory of ``dictionaries=`` as ratios to ``by="neuron"``.

``python benchmarks/features.py [--batch 4] [--tokens 64] [--width 16384] [--repeats 5]`` on SmolLM2-135M, every
position (``"next"``, ``position="all"``) of ``--batch`` prompts of ``--tokens`` token ids, in one run:

- ``neuron``: ``by="neuron"`` (every MLP neuron of every block a column: 30 x 1536), the baseline of every ratio;
- ``sae_16k``: ``by="block"`` with one ``--width``-latent SAE on ``L12.mlp``;
- ``four_16k``: ``by="block"`` with four: an SAE on ``L4.resid`` (the stream entering block 4), one on
  ``L10.attn``, a skip transcoder on ``L12.mlp`` and an SAE on ``L20.mlp``.

Time: the methods interleaved in this process (``common.time_methods``: the median of the paired ratios). Memory:
peak RSS of one call above the loaded model (``common.measure_peak``), each method in a process of its own. The
dictionaries are random (about a fifth of the latents fire). Locally the readout is the trace's own (each site's
``min(d_sae, 256)`` largest latent parts are packed the same way as remotely: ``trace.sparse``; its bytes back
from a server: ``features_wire.py``). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common
import torch

METHODS = ("neuron", "sae_16k", "four_16k")


def dictionary(d: int, width: int, seed: int, skip: bool = False):
    from dla_recipes.features import Dictionary, Encoder

    g = torch.Generator().manual_seed(seed)
    W_enc = torch.randn(d, width, generator=g) / d ** 0.5
    encoder = Encoder(W_enc, torch.full((width,), -0.8), "relu")
    return Dictionary(torch.randn(width, d, generator=g) / d ** 0.5, torch.zeros(d), encoder,
                      0.01 * torch.randn(d, d, generator=g) if skip else None, "input" if skip else "output")


def calls(batch: int, tokens: int, width: int) -> dict:
    import dla_recipes

    model = dla_recipes.load("smollm2")
    d = int(model.lm_head.weight.shape[-1])
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(100, 20000, (batch, tokens), generator=g)
    one = {"L12.mlp": dictionary(d, width, 1)}
    four = {"L4.resid": dictionary(d, width, 5), "L10.attn": dictionary(d, width, 2),
            "L12.mlp": dictionary(d, width, 3, skip=True), "L20.mlp": dictionary(d, width, 4)}

    def run(**kw):
        return lambda: dla_recipes.attribute(model, ids, "next", position="all", **kw)

    return {"neuron": run(by="neuron"), "sae_16k": run(by="block", dictionaries=one),
            "four_16k": run(by="block", dictionaries=four)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--width", type=int, default=16384)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--mem", choices=METHODS)
    args = parser.parse_args()
    common.set_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    methods = calls(args.batch, args.tokens, args.width)
    if args.mem:
        print(json.dumps(common.measure_peak(methods[args.mem])))
        return
    timing = common.time_methods(methods, args.repeats, warmup=1, baseline="neuron")
    out = {"batch": args.batch, "tokens": args.tokens, "width": args.width,
           "time": {k: {"median_s": v["median_s"], "paired_ratio": v["paired_ratio"]} for k, v in timing.items()}}
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")
    memory = {}
    for name in METHODS:
        done = subprocess.run([sys.executable, __file__, "--mem", name, "--batch", str(args.batch), "--tokens",
                               str(args.tokens), "--width", str(args.width)], env=env, capture_output=True,
                              text=True, check=True)
        memory[name] = json.loads(done.stdout.strip().splitlines()[-1])["peak_above_loaded_mb"]
    out["peak_above_loaded_mb"] = memory
    out["memory_ratio"] = {k: v / memory["neuron"] for k, v in memory.items()}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
