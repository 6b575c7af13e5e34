"""The scaling sweep's models and prompts: a small random Llama grown along one axis at a time.

Base point: batch 4, 32 tokens, d_model 256, 8 layers, 4 heads (2 KV), d_mlp 1024, vocab 128. Axes:

- ``batch``: 1, 4, 16, 64 prompts (32 tokens, d_mlp 1024)
- ``seq``: 32, 128, 512, 1024 tokens (batch 4, d_mlp 1024)
- ``d_mlp``: 512, 2048, 8192 (batch 4, 32 tokens)

Each point becomes one spec entry (the same layout as ``spec.py``'s), so ``local.py`` times and measures it.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import spec as spec_module

BASE = {"batch": 4, "seq": 32, "d_mlp": 1024}
FULL_AXES = {"batch": [1, 4, 16, 64], "seq": [32, 128, 512, 1024], "d_mlp": [512, 2048, 8192]}
QUICK_AXES = {"seq": [16, 64]}
SWEEP_MODEL = {"hidden_size": 256, "num_hidden_layers": 8, "num_attention_heads": 4, "num_key_value_heads": 2}
METHODS = ["trace_logits", "dla_head", "dla_neuron", "save_all_block"]


def points(quick: bool) -> list[dict]:
    axes = QUICK_AXES if quick else FULL_AXES
    out = []
    for axis, values in axes.items():
        for value in values:
            point = dict(BASE, **{axis: value})
            point["axis"] = axis
            point["key"] = f"sweep-{axis}-{value}"
            out.append(point)
    return out


def write_spec(out: Path, quick: bool) -> tuple[Path, list[dict]]:
    out = Path(out)
    entries = {}
    pts = points(quick)
    for p in pts:
        config = spec_module.wide_config(intermediate_size=p["d_mlp"], **SWEEP_MODEL)
        folder = spec_module.build_tiny_folder(out / "models" / f"sweep-dmlp{p['d_mlp']}", config)
        prompts = spec_module.tiny_prompts(p["batch"], p["seq"])
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(folder)
        entries[p["key"]] = {
            "folder": str(folder),
            "prompts": prompts,
            "input_ids": [tokenizer(x, add_special_tokens=False)["input_ids"] for x in prompts],
            "target": "w20",
            "target_id": tokenizer("w20", add_special_tokens=False)["input_ids"][0],
            "n_layers": config.num_hidden_layers, "d_model": config.hidden_size, "d_mlp": p["d_mlp"],
            "n_heads": config.num_attention_heads, "vocab": config.vocab_size,
            "description": f"sweep Llama d_model 256, 8 layers, d_mlp {p['d_mlp']}",
        }
    path = out / "sweep_spec.json"
    path.write_text(json.dumps({"models": entries}, indent=1))
    return path, pts


def exponent(xs: list[float], ys: list[float]) -> float | None:
    """Least-squares slope of log(y) on log(x): 1 is linear growth, below 1 sublinear (fixed costs dominate)."""
    pairs = [(math.log(x), math.log(y)) for x, y in zip(xs, ys) if x > 0 and y and y > 0]
    if len(pairs) < 2:
        return None
    mx = sum(p[0] for p in pairs) / len(pairs)
    my = sum(p[1] for p in pairs) / len(pairs)
    den = sum((p[0] - mx) ** 2 for p in pairs)
    return sum((p[0] - mx) * (p[1] - my) for p in pairs) / den if den else None


def cache_bytes(point: dict) -> int:
    """Bytes of a ``[layers, pos, d_model]`` float32 activation cache per prompt, times the batch."""
    return SWEEP_MODEL["num_hidden_layers"] * point["seq"] * SWEEP_MODEL["hidden_size"] * 4 * point["batch"]


def slope(xs: list[float], ys: list[float]) -> float | None:
    """Least-squares slope of ``ys`` on ``xs`` (None when ``xs`` does not vary)."""
    if len(xs) < 2:
        return None
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    den = sum((x - mx) ** 2 for x in xs)
    if den <= 1e-12 * max(1.0, mx * mx):
        return None
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / den
