"""Detection of hidden writes: a vector no component makes, added by a plain torch forward hook (not ``intervene=``).

The hook sits on one block's output (``block``) or on its MLP's output (``mlp``). For each dtype, site, layer
(early / middle / late) and size (a fraction of the median norm of the stream leaving that block, read by a plain
transformers forward), the hook adds the same vector at every position, in a few random
directions and along the attributed logit's direction (``lm_head``'s target row minus its contrast row), and
``dla_recipes.attribute(..., by="block")`` is called on a few prompts: a write is caught when the call raises
``ExactnessError``; a returned attribution is a miss. Writes a markdown table (caught / tried per cell) and JSON.

    OMP_NUM_THREADS=1 python benchmarks/hidden_writes.py --models smollm2 gemma3 --randoms 2 --check adds \\
        --label "after, check='adds'" --out after.md

Works on ``main`` before the per-add check (it needs only ``dla_recipes.attribute``), so the same script measures
before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch

import dla_recipes
from dla_recipes import models
from dla_recipes.testing.hooks import adding

PATHS = {"smollm2": models.default_model_path, "gemma3": models.gemma3_270m_path}
PROMPTS = ["The Eiffel Tower is in the city of", "The capital of Italy is", "Berlin is the capital of"]
TARGET, CONTRAST = " Paris", " Rome"
SIZES = (0.0003, 0.001, 0.003, 0.01, 0.03, 0.1)


def hf_layers(model):
    """The transformers decoder layers (``nn.ModuleList``) of a loaded model."""
    return model._module.model.layers


def median_norms(model) -> list[float]:
    """The median norm over the prompts' positions of the stream leaving each block (a plain forward)."""
    hf = model._module
    enc = model.tokenizer(PROMPTS, return_tensors="pt", padding=True)
    with torch.no_grad():
        states = hf(**enc, output_hidden_states=True).hidden_states  # embeddings, then each block's output
    mask = enc["attention_mask"].bool()
    return [float(s.float()[mask].norm(dim=-1).median()) for s in states[1:]]


def directions(model, seed: int, randoms: int) -> list[tuple[str, torch.Tensor]]:
    """``randoms`` random unit directions and the logit's (the head rows' difference, unit)."""
    weight = model._module.lm_head.weight.float()
    tok = model.tokenizer
    t, c = (tok(s, add_special_tokens=False)["input_ids"][0] for s in (TARGET, CONTRAST))
    logit = weight[t] - weight[c]
    gen = torch.Generator().manual_seed(seed)
    out = [(f"random{k}", torch.randn(weight.shape[-1], generator=gen)) for k in range(randoms)]
    out.append(("logit", logit))
    return [(name, v / v.norm()) for name, v in out]


def sublayer(block):
    """The module whose output the stream receives from the MLP: its post-norm where the family has one (Gemma-3's
    ``post_feedforward_layernorm``: a hook on the MLP itself changes what the post-norm reads, which the MLP's part
    then includes), else the MLP."""
    return getattr(block, "post_feedforward_layernorm", None) or block.mlp


def caught(model, layer: int, vector: torch.Tensor, site: str = "block", check: dict | None = None) -> tuple[bool, str]:
    """Whether attributing with ``vector`` added to ``layer``'s output (``site="mlp"``: to what its MLP writes)
    raises ``ExactnessError`` (and its message); ``check``: extra keyword arguments of ``attribute``."""
    module = hf_layers(model)[layer]
    handle = (sublayer(module) if site == "mlp" else module).register_forward_hook(adding(vector))
    try:
        dla_recipes.attribute(model, PROMPTS, TARGET, contrast=CONTRAST, by="block", **(check or {}))
        return False, ""
    except dla_recipes.ExactnessError as error:
        return True, str(error)[:300]
    finally:
        handle.remove()


def sweep(name: str, dtype: torch.dtype, randoms: int, check: dict, sites=("block", "mlp")) -> list[dict]:
    model = dla_recipes.load(str(PATHS[name]()), dtype=dtype, dispatch=True, device_map="cpu")
    n = len(hf_layers(model))
    norms = median_norms(model)
    records = []
    healthy = caught(model, 0, torch.zeros(model._module.lm_head.weight.shape[-1]), "block", check)
    for site in sites:
        records.append({"model": name, "dtype": str(dtype)[6:], "site": site, "layer": -1, "size": 0.0,
                        "direction": "none", "caught": healthy[0], "message": healthy[1]})
    for site in sites:
        for layer in (1, n // 2, n - 2):
            for size in SIZES:
                for direction, v in directions(model, layer, randoms):
                    hit, message = caught(model, layer, size * norms[layer] * v, site, check)
                    records.append({"model": name, "dtype": str(dtype)[6:], "site": site, "layer": layer,
                                    "size": size, "direction": direction, "caught": hit, "message": message,
                                    "names_its_block": f"block {layer}'s" in message})
                    print(json.dumps({k: records[-1][k] for k in ("model", "dtype", "site", "layer", "size",
                                                                    "direction", "caught")}), flush=True)
    return records


def table(records: list[dict], label: str) -> str:
    """A markdown table: one row per (model, dtype, hooked site, layer), one column per size: random directions
    caught / tried, then the logit's direction (``2/2 + caught``)."""
    sizes = sorted({r["size"] for r in records if r["layer"] >= 0})
    lines = [f"### {label}", "", "| model | dtype | hook on | layer | healthy call | "
             + " | ".join(f"{100 * s:g}% of the stream's norm" for s in sizes) + " |",
             "| --- | --- | --- | --- | --- | " + " | ".join("---" for _ in sizes) + " |"]
    keys = sorted({(r["model"], r["dtype"], r["site"], r["layer"]) for r in records if r["layer"] >= 0})
    for model, dtype, site, layer in keys:
        healthy = [r for r in records if (r["model"], r["dtype"], r["layer"]) == (model, dtype, -1)]
        cells = []
        for size in sizes:
            mine = [r for r in records
                    if (r["model"], r["dtype"], r["site"], r["layer"], r["size"]) == (model, dtype, site, layer, size)]
            rand = [r for r in mine if r["direction"].startswith("random")]
            logit = [r for r in mine if r["direction"] == "logit"]
            cells.append(f"{sum(r['caught'] for r in rand)}/{len(rand)} + {'caught' if logit and logit[0]['caught'] else 'missed'}")
        alarm = "false alarm" if healthy and healthy[0]["caught"] else "ok"
        lines.append(f"| {model} | {dtype} | {site} output | {layer} | {alarm} | " + " | ".join(cells) + " |")
    caught = [r for r in records if r["layer"] >= 0 and r["caught"]]
    named = sum(r["names_its_block"] for r in caught)
    lines += ["", f"{named} of the {len(caught)} errors raised name the hooked block (\"block i's ...\")."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["smollm2"], choices=sorted(PATHS))
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16", "float16"])
    parser.add_argument("--randoms", type=int, default=3, help="random directions per cell (plus the logit's)")
    parser.add_argument("--label", default="after")
    parser.add_argument("--check", default=None, help="attribute(check=...): 'adds' (main has no such argument)")
    parser.add_argument("--out", default="hidden_writes.md")
    args = parser.parse_args(argv)
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    records = []
    for name in args.models:
        for dtype in args.dtypes:
            if name == "gemma3" and dtype == "float16":
                continue  # overflows: NonFiniteError on every call (benchmarks/FALSE_ALARMS.md)
            records += sweep(name, getattr(torch, dtype), args.randoms, {} if args.check is None else {"check": args.check})
    with open(args.out, "w") as f:
        f.write(table(records, args.label))
    with open(args.out.rsplit(".", 1)[0] + ".json", "w") as f:
        json.dump(records, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
