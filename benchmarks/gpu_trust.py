"""GPU trust check: every tiny family in bfloat16 and float16 on CUDA — no false alarm, no NaN, injections caught.

    python benchmarks/gpu_trust.py --device cuda --budget-s 240      # on the lent GPU machine
    python benchmarks/gpu_trust.py --device cpu --families llama gpt2 # a smoke test here

NDIF serves bfloat16 on GPUs, whose kernels (cuBLAS, SDPA) round differently from the CPU's. For each family of
``dla_recipes.testing.tiny`` (perturbed), in each dtype, on a padded batch of three prompts with a contrast token,
at block, head and neuron granularity, ``attribute`` must either return parts whose sum is within its own bound of
the model's logit, or raise a clear error naming a non-finite value. Each prompt's logit is also compared with a
plain transformers forward of that prompt alone on the same device and dtype. An ``ExactnessError`` on a healthy
model is a false alarm. Then a vector added to a middle block's output by a forward hook (a write no component
makes, a few percent of the stream's norm) must raise ``ExactnessError``.

Writes ``gpu_trust.json`` to ``$OUT`` (or ``--out``): per (family, dtype, by) the outcome and the relative error.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PROMPTS = ["w5 w6 w7 w8 w9 w10", "w11 w12", "w13 w14 w15 w16"]
TARGET, CONTRAST = "w20", "w21"


def _plain_logits(model, prompt, device):
    import torch

    ids = model.tokenizer(prompt, return_tensors="pt")
    with torch.no_grad():
        out = model._module(input_ids=ids["input_ids"].to(device), attention_mask=ids["attention_mask"].to(device))
    return out.logits[0, -1].float().cpu()


def check_family(family: str, dtype, device: str, granularities) -> list[dict]:
    import torch

    import dla_recipes
    from dla_recipes.errors import ExactnessError
    from dla_recipes.testing import tiny

    rows = []
    hf = tiny.build(family).to(dtype).to(device)
    model = dla_recipes.load(hf, tokenizer=tiny.tokenizer(), device_map=device)
    target, contrast = (model.tokenizer.convert_tokens_to_ids(t) for t in (TARGET, CONTRAST))
    plain = [_plain_logits(model, p, device) for p in PROMPTS]
    for by in granularities:
        row = {"family": family, "dtype": str(dtype).removeprefix("torch."), "by": by}
        try:
            attr = dla_recipes.attribute(model, PROMPTS, TARGET, contrast=CONTRAST, by=by)
            gap = (attr.values.sum(-1) + attr.constant - attr.logit).abs()
            row.update(outcome="ok", error=float(gap.max()), logit_abs=float(attr.logit.abs().max()),
                       finite=bool(torch.isfinite(attr.values).all()))
            own = torch.stack([lg[target] - lg[contrast] for lg in plain])
            row["vs_plain_forward"] = float((attr.output_logit - own).abs().max())
        except ExactnessError as error:
            row.update(outcome=type(error).__name__, message=str(error)[:400])
        except Exception as error:  # noqa: BLE001 - recorded, not hidden
            row.update(outcome="crash", message=f"{type(error).__name__}: {error}"[:400],
                       trace=traceback.format_exc()[-1500:])
        rows.append(row)
    # Detection: a write no component makes, added to a middle block's output, at two sizes (of the stream's norm).
    if len(model.layers) > 1:
        block = model.layers[len(model.layers) // 2]._module
        for size in (0.05, 0.3):

            def inject(_module, _args, output, size=size):
                hidden = output[0] if isinstance(output, tuple) else output
                push = torch.randn(hidden.shape[-1], generator=torch.Generator().manual_seed(0)).to(hidden)
                push = push / push.norm() * size * hidden.float().norm(dim=-1, keepdim=True).to(hidden.dtype)
                hidden = hidden + push
                return (hidden, *output[1:]) if isinstance(output, tuple) else hidden

            handle = block.register_forward_hook(inject)
            row = {"family": family, "dtype": str(dtype).removeprefix("torch."), "by": "block", "injected": size}
            try:
                dla_recipes.attribute(model, PROMPTS, TARGET, contrast=CONTRAST)
                row["outcome"] = "missed"
            except ExactnessError as error:
                row["outcome"] = "caught"
                row["message"] = str(error)[:300]
            except Exception as error:  # noqa: BLE001
                row.update(outcome="crash", message=f"{type(error).__name__}: {error}"[:400])
            finally:
                handle.remove()
            rows.append(row)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float16"])
    parser.add_argument("--families", nargs="*", default=None)
    parser.add_argument("--by", nargs="+", default=["block", "head", "neuron"])
    parser.add_argument("--budget-s", type=float, default=240.0, help="stop starting families after this long")
    parser.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "4")
    import torch

    import dla_recipes  # noqa: F401  (compat shim first)
    from dla_recipes.testing import tiny

    families = args.families or list(tiny.FAMILIES)
    rows, start = [], time.monotonic()
    for dtype_name in args.dtypes:
        for family in families:
            if time.monotonic() - start > args.budget_s:
                rows.append({"family": family, "dtype": dtype_name, "outcome": "not run (budget)"})
                continue
            try:
                rows.extend(check_family(family, getattr(torch, dtype_name), args.device, args.by))
            except Exception as error:  # noqa: BLE001 - a family that does not even build is recorded
                rows.append({"family": family, "dtype": dtype_name, "outcome": "crash",
                             "message": f"{type(error).__name__}: {error}"[:400]})
    summary: dict = {}
    for row in rows:
        key = f"{row.get('dtype')}:{row['outcome']}" + (f"@{row['injected']}" if "injected" in row else "")
        summary[key] = summary.get(key, 0) + 1
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    result = {"device": device_name, "torch": torch.__version__, "seconds": round(time.monotonic() - start, 1),
              "summary": summary, "rows": rows}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    Path(args.out, "gpu_trust.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(summary, indent=1))
    for row in rows:
        if row["outcome"] not in ("ok", "caught", "missed"):
            print(row["family"], row.get("dtype"), row.get("by"), row["outcome"], row.get("message", "")[:200])
    print(f"{len(rows)} rows in {result['seconds']} s on {device_name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
