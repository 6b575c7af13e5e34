"""What one ``attribute`` call costs a device, counted on the CPU (issue 23): ``python benchmarks/launches.py [--quick]
[--out DIR]``.

Inside the trace only (``transport.run.run_trace`` wrapped in ``dla_recipes.testing.launches.Launches``), per model,
dtype (bfloat16, float32) and granularity (block, head, neuron; and head with ``position="all"``), batch 4 prompts x
16 tokens, target ``"w20"``:

- aten ops (a GPU's kernel launches) by issuer: the recipe, the model (transformers / ``torch.nn``), other (nnsight);
- the recipe's host syncs (``.cpu()``, ``.item()``, ``bool(t)``, ... on a device tensor) and uploads (host data
  copied to the device), each with its ``file:line``, and how many of them came while the forward pass ran;
- the recipe's largest bfloat16 / float16 -> float32 cast (``numel``) of a weight and of an activation, also
  relative to ``batch * pos * d_model``;
- the trace's reads: every ``.input`` / ``.output`` the recipe asks nnsight for (``Mediator.value``).

The models are random Llamas with Llama-3.1-8B's structure (32 heads / 8 KV heads, untied head, rope_theta 500000)
at small widths (d_model 256, d_mlp 896, vocab 512), at 32 and at 8 layers, so every count splits into
``fixed + per_layer * layers``; and a tiny Gemma-3 (post-norms: more per-layer work) at 8 and 32 layers. None of the
counts depends on the width. Timing (``--repeats``, default 15, interleaved, ``OMP_NUM_THREADS`` fixed): the
logits-only trace against ``attribute`` at batch 1, the median per-round ratio (``common.time_methods``).

``--quick``: the 8-layer Llama, bfloat16, block / head / neuron, 3 timed rounds. Writes ``launches.json`` and
``launches.md`` to ``--out`` (default ``build/launches``), prints the table, and emits the result line
``benchmarks/run.py`` reads (its ``launches`` section).
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(HERE.parent))

import common

BATCH, TOKENS, TARGET = 4, 16, "w20"
LLAMA_8B_STRUCTURE = {"num_attention_heads": 32, "num_key_value_heads": 8, "tie_word_embeddings": False,
                      "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "max_position_embeddings": 256}
WIDTHS = {"hidden_size": 256, "intermediate_size": 896, "vocab_size": 512}
CASES = (("block", -1), ("head", -1), ("neuron", -1), ("head", "all"))


def llama(layers: int):
    """A perturbed random Llama: Llama-3.1-8B's structure at ``layers`` layers and small widths, float32."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from dla_recipes.testing import tiny

    vocab = WIDTHS["vocab_size"]
    config = LlamaConfig(**LLAMA_8B_STRUCTURE, **WIDTHS, num_hidden_layers=layers, pad_token_id=vocab - 1,
                         bos_token_id=0, eos_token_id=1)
    torch.manual_seed(0)
    return tiny.perturb(LlamaForCausalLM(config).eval(), 0)


def gemma3(layers: int):
    """The test suite's tiny Gemma-3 (post-norms, sliding / full attention) at ``layers`` layers."""
    import torch
    import transformers

    from dla_recipes.testing import tiny

    config = tiny.config("gemma3")
    pattern = list(config.layer_types)
    config.num_hidden_layers = layers
    config.layer_types = [pattern[i % len(pattern)] for i in range(layers)]
    torch.manual_seed(0)
    return tiny.perturb(transformers.Gemma3ForCausalLM(config).eval(), 0)


MODELS = {"llama": llama, "gemma3": gemma3}


def prompts(vocab: int, batch: int = BATCH, tokens: int = TOKENS) -> list[str]:
    words = vocab - 2
    return [" ".join(f"w{(97 * i + 31 * j + 7) % words}" for j in range(tokens)) for i in range(batch)]


class Counter:
    """Wraps ``run_trace`` in ``Launches`` and ``Mediator.value`` in a read counter; ``take()`` the last call's."""

    def __init__(self, model):
        from nnsight.intervention.interleaver import Mediator

        import dla_recipes.transport.run as run_module
        from dla_recipes.testing.launches import Launches

        self.model, self.run_module, self.mediator = model, run_module, Mediator
        self.original_trace, self.original_value = run_module.run_trace, Mediator.__dict__["value"]
        self.records: list = []
        self.reads: list | None = None
        original_value = self.original_value.__func__
        counter = self

        def value(cls, location):
            if counter.reads is not None:
                counter.reads.append(location)  # every read a trace makes is the recipe's (it runs the trace)
            return original_value(cls, location)

        def run_trace(*args, **kwargs):
            counter.reads = []
            with Launches(model) as launches:
                try:
                    return counter.original_trace(*args, **kwargs)
                finally:
                    counter.records.append((launches.counts, counter.reads))
                    counter.reads = None

        self.value, self.run_trace = classmethod(value), run_trace

    def __enter__(self):
        self.run_module.run_trace = self.run_trace
        self.mediator.value = self.value
        return self

    def __exit__(self, *exc):
        self.run_module.run_trace = self.original_trace
        self.mediator.value = self.original_value
        return False

    def take(self) -> dict:
        """The calls' counts since the last ``take``, summed over their traces."""
        records, self.records = self.records, []
        ops, by_op, syncs, reads = collections.Counter(), collections.Counter(), collections.Counter(), collections.Counter()
        uploads, mid = collections.Counter(), 0
        sites: dict = {}  # the recipe's largest cast to float32 per file:line, of a weight / of an activation
        activations: dict = {}
        for counts, read in records:
            for who, where, numel, weight in counts.widenings:
                if who == "recipe":
                    table = sites if weight else activations
                    table[where] = max(table.get(where, 0), numel)
            ops.update(counts.ops)
            by_op.update({op: n for (who, op), n in counts.by_op.items() if who == "recipe"})
            syncs.update(f"{where} {call}" for who, where, call, _ in counts.syncs if who == "recipe")
            uploads.update(f"{where} {what}" for who, where, what, _ in counts.uploads if who == "recipe")
            mid += len(counts.mid_forward(counts.syncs)) + len(counts.mid_forward(counts.uploads))
            reads["recipe"] += len(read)
        return {"traces": len(records), "ops": dict(ops), "recipe_syncs": sum(syncs.values()),
                "recipe_uploads": sum(uploads.values()), "recipe_waits_mid_forward": mid,
                "upload_sites": dict(uploads.most_common()),
                "widening_sites": dict(sorted(sites.items(), key=lambda kv: -kv[1])[:5]),
                "activation_widening_sites": dict(sorted(activations.items(), key=lambda kv: -kv[1])[:5]),
                "largest_activation_widening": max(activations.values(), default=0),
                "largest_weight_widening": max(sites.values(), default=0),
                "sync_sites": dict(syncs.most_common()), "reads": dict(reads),
                "top_recipe_ops": dict(by_op.most_common(12))}


def count_model(family: str, layers: int, dtype_name: str, cases) -> dict:
    import torch

    import dla_recipes
    from dla_recipes.testing import tiny

    hf = MODELS[family](layers).to(getattr(torch, dtype_name))
    model = dla_recipes.load(hf, tokenizer=tiny.tokenizer(hf.config.vocab_size))
    batch, d_model = prompts(hf.config.vocab_size), hf.config.hidden_size
    out = {}
    with Counter(model) as counter:
        for by, position in cases:
            first = dla_recipes.attribute(model, batch, TARGET, by=by, position=position, progress=False)
            cold = counter.take()
            attr = dla_recipes.attribute(model, batch, TARGET, by=by, position=position, progress=False)
            warm = counter.take()
            warm["cold_ops"] = cold["ops"]
            warm["error"] = float(attr.error)
            warm["first_error"] = float(first.error)
            # relative to one [batch, pos, d_model] activation: a cast of a weight (W_O, W_down widened a slice at
            # a time for the pullbacks: an input sharing a parameter's storage), and of an activation
            warm["widening_over_batch_pos_d"] = warm["largest_weight_widening"] / (BATCH * TOKENS * d_model)
            warm["activation_widening_over_batch_pos_d"] = (warm["largest_activation_widening"]
                                                            / (BATCH * TOKENS * d_model))
            out[f"{by}/{position}"] = warm
    return {"family": family, "layers": layers, "dtype": dtype_name, "d_model": d_model, "cases": out}


def time_model(family: str, layers: int, dtype_name: str, bys, repeats: int) -> dict:
    import torch

    import dla_recipes
    from dla_recipes.testing import tiny

    hf = MODELS[family](layers).to(getattr(torch, dtype_name))
    model = dla_recipes.load(hf, tokenizer=tiny.tokenizer(hf.config.vocab_size))
    one = prompts(hf.config.vocab_size, batch=1)
    enc = model.tokenizer(one, return_tensors="pt")
    enc = {k: enc[k] for k in ("input_ids", "attention_mask")}

    def trace_logits():
        with torch.no_grad():  # noqa: SIM117 - nnsight finds a trace by its own `with` line
            with model.trace(dict(enc)):
                model.logits.save()

    methods = {"trace_logits": trace_logits}
    for by in bys:
        methods[f"dla_{by}"] = (lambda by=by: dla_recipes.attribute(model, one, TARGET, by=by, progress=False))
    timings = common.time_methods(methods, repeats=repeats, warmup=2, baseline="trace_logits")
    return {name: {k: v for k, v in t.items() if k != "samples_s"} for name, t in timings.items()}


def split(counts: dict, key) -> dict:
    """``fixed + per_layer * layers`` of ``key(case)`` from two depths of one family and dtype."""
    out = {}
    for (family, dtype), by_depth in counts.items():
        if len(by_depth) < 2:
            continue
        (l0, c0), (l1, c1) = sorted(by_depth.items())[:1] + sorted(by_depth.items())[-1:]
        for case in c0["cases"]:
            v0, v1 = key(c0["cases"][case]), key(c1["cases"][case])
            per_layer = (v1 - v0) / (l1 - l0)
            out[f"{family}/{dtype}/{case}"] = {"per_layer": per_layer, "fixed": v0 - per_layer * l0,
                                               "layers": [l0, l1], "values": [v0, v1]}
    return out


def markdown(result: dict) -> list[str]:
    """The section's Markdown lines (``benchmarks/run.py`` adds them to its report)."""
    if not result or not result.get("counts"):
        return []
    lines = [(f"## Device cost of one call, counted on the CPU (launches.py; batch {BATCH} x {TOKENS} tokens, "
              "inside the trace)"), "",
             ("| model | dtype | by / position | recipe ops | model ops | other ops | recipe syncs / uploads "
              "(of them while the forward ran) | recipe reads | "
              "largest weight cast / (B*T*d) (site) | largest activation cast / (B*T*d) (site) | error |"),
             "|---|---|---|---:|---:|---:|---:|---:|---|---|---:|"]
    for entry in result["counts"]:
        for case, c in entry["cases"].items():
            lines.append(f"| {entry['family']} L{entry['layers']} | {entry['dtype']} | {case} | "
                         f"{c['ops'].get('recipe', 0)} | {c['ops'].get('model', 0)} | {c['ops'].get('other', 0)} | "
                         f"{c['recipe_syncs']} / {c['recipe_uploads']} ({c['recipe_waits_mid_forward']}) | "
                         f"{c['reads'].get('recipe', 0)} | "
                         f"{c['widening_over_batch_pos_d']:.3f} ({next(iter(c['widening_sites']), '-')}) | "
                         f"{c['activation_widening_over_batch_pos_d']:.3f} "
                         f"({next(iter(c['activation_widening_sites']), '-')}) | {c['error']:.1e} |")
    lines.append("")
    if result.get("split"):
        lines += ["Per layer and fixed (two depths: `count = fixed + per_layer * layers`):", "",
                  ("| model / dtype / case | recipe ops per layer | fixed | model ops per layer | fixed | "
                   "recipe reads per layer | fixed | recipe syncs per layer | fixed | waits mid-forward per layer |"),
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for name, s in result["split"]["recipe_ops"].items():
            m, r, y, w = (result["split"][k][name] for k in ("model_ops", "recipe_reads", "recipe_syncs",
                                                              "recipe_waits_mid_forward"))
            lines.append(f"| {name} | {s['per_layer']:.1f} | {s['fixed']:.0f} | {m['per_layer']:.1f} | "
                         f"{m['fixed']:.0f} | {r['per_layer']:.2f} | {r['fixed']:.0f} | {y['per_layer']:.2f} | "
                         f"{y['fixed']:.0f} | {w['per_layer']:.2f} |")
        lines.append("")
    sites = collections.Counter()
    for entry in result["counts"]:
        for c in entry["cases"].values():
            sites.update({k: 1 for k in c["sync_sites"]})
    if sites:
        lines += ["Recipe sync sites (file:line call; in how many of the cases above):", ""]
        lines += [f"- `{site}`: {n}" for site, n in sorted(sites.items())] + [""]
    if result.get("timing"):
        lines += ["Batch 1: `attribute` over the logits-only trace (median per-round ratio):", "",
                  "| model | dtype | trace ms | " + " | ".join(f"{b} ratio" for b in result["bys"]) + " |",
                  "|---|---|---:|" + "---:|" * len(result["bys"])]
        for t in result["timing"]:
            cells = [f"{t['timings'][f'dla_{b}']['paired_ratio']:.2f}" for b in result["bys"]]
            lines.append(f"| {t['family']} L{t['layers']} | {t['dtype']} | "
                         f"{t['timings']['trace_logits']['median_s'] * 1e3:.1f} | " + " | ".join(cells) + " |")
        lines.append("")
    return lines


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the 8-layer Llama, bfloat16, block / head / neuron")
    parser.add_argument("--out", default=str(HERE.parent / "build" / "launches"))
    parser.add_argument("--repeats", type=int, default=None, help="timed rounds (default 15; quick 3)")
    args = parser.parse_args(argv)
    common.offline()
    threads = common.set_threads()
    import warnings

    warnings.filterwarnings("ignore")
    import dla_recipes  # noqa: F401 - its nnterp shim must load before nnterp

    t0 = time.perf_counter()
    if args.quick:
        plan = [("llama", (8,), ("bfloat16",))]
        cases, bys, repeats = CASES[:3], ("block", "head", "neuron"), args.repeats or 3
    else:
        plan = [("llama", (8, 32), ("bfloat16", "float32")), ("gemma3", (8, 32), ("bfloat16", "float32"))]
        cases, bys, repeats = CASES, ("block", "head", "neuron"), args.repeats or 15
    # timing first, in a process nothing has patched yet; a failure is recorded and the rest still runs
    timing, failures = [], {}
    for family, depths, _ in plan:
        for layers in depths:
            for dtype in ("bfloat16", "float32") if not args.quick else ("bfloat16",):
                try:
                    timing.append({"family": family, "layers": layers, "dtype": dtype,
                                   "timings": time_model(family, layers, dtype, bys, repeats)})
                except Exception as error:  # noqa: BLE001 - recorded in the result
                    failures[f"time {family} L{layers} {dtype}"] = f"{type(error).__name__}: {error}"
                print(f"timed {family} L{layers} {dtype}", file=sys.stderr, flush=True)
    counts, by_key = [], {}
    for family, depths, dtypes in plan:
        for dtype in dtypes:
            for layers in depths:
                try:
                    entry = count_model(family, layers, dtype, cases)
                except Exception as error:  # noqa: BLE001 - recorded in the result
                    failures[f"count {family} L{layers} {dtype}"] = f"{type(error).__name__}: {error}"
                    continue
                counts.append(entry)
                by_key.setdefault((family, dtype), {})[layers] = entry
                print(f"counted {family} L{layers} {dtype}", file=sys.stderr, flush=True)
    result = {"quick": args.quick, "threads": threads, "batch": BATCH, "tokens": TOKENS, "target": TARGET,
              "widths": WIDTHS, "structure": LLAMA_8B_STRUCTURE, "bys": list(bys), "repeats": repeats,
              "counts": counts, "timing": timing, "failures": failures, "total_s": 0.0}
    result["split"] = {
        "recipe_ops": split(by_key, lambda c: c["ops"].get("recipe", 0)),
        "model_ops": split(by_key, lambda c: c["ops"].get("model", 0)),
        "recipe_reads": split(by_key, lambda c: c["reads"].get("recipe", 0)),
        "recipe_syncs": split(by_key, lambda c: c["recipe_syncs"]),
        "recipe_waits_mid_forward": split(by_key, lambda c: c["recipe_waits_mid_forward"]),
    }
    result["total_s"] = time.perf_counter() - t0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "launches.json").write_text(json.dumps(result, indent=1))
    text = "\n".join(markdown(result))
    (out / "launches.md").write_text(text + "\n")
    print(text)
    for name, text in failures.items():
        print(f"FAILED {name}: {text}")
    print(f"wrote {out / 'launches.json'} and {out / 'launches.md'} ({result['total_s']:.0f} s)")
    common.emit(result)


if __name__ == "__main__":
    main()
