"""Every position (issue 18): ``python benchmarks/positions.py time|mem|remote --spec SPEC --model M ...``.

All positions of a batch in ONE forward pass: ``dla_recipes.attribute(model, ids, "next", position="all", by=...)``
on ``--batch`` prompts of ``--tokens`` token ids each (no padding; ``"next"`` leaves the last position out, so a
prompt of 128 tokens is 127 sites), against a trace that saves the full logits ``[batch, pos, vocab]`` (what a
user who wants every position's logit runs anyway), in the same process.

``time``: the methods interleaved (``common.time_methods``), ``trace_full_logits`` the baseline of every ratio.
``mem``: peak RSS of one call above the loaded model (``common.measure_peak``), one method per process, with the
bytes of the result's values (``n_sites x n_components x 4``) for reference: the memory target is "linear in
positions x components". ``remote``: the loopback NDIF server's request and result bytes of one ``remote=True``
call (``by=...``, all positions), next to the packed readout's size ``n_sites x (n_components +
len(Readout.FIELDS)) x 4`` bytes.

Methods: ``trace_full_logits``, ``plain_forward`` (transformers alone, for scale), ``pos_block`` / ``pos_head`` /
``pos_neuron``.

``run.py`` runs this as its ``positions`` section (``section``, ``markdown``, ``targets`` below); alone:
``python benchmarks/positions.py section --out DIR [--threads 1] [--repeats 5]`` writes ``DIR/positions.json`` and
``DIR/positions.md``. Targets (issue 18, reported, never asserted): the ratio to ``trace_full_logits`` of all
positions by block and by head <= 1.25, by neuron <= 1.5.
"""

from __future__ import annotations

import argparse
import os
import secrets
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common

METHODS = ["trace_full_logits", "plain_forward", "pos_block", "pos_head", "pos_neuron"]
TARGETS = {"pos_block": 1.25, "pos_head": 1.25, "pos_neuron": 1.5}
MODELS = ("smollm2", "wide")
BATCH, TOKENS, SMALL_TOKENS = 4, 128, 32  # the memory runs also measure SMALL_TOKENS: linear in positions?
LABELS = {"trace_full_logits": "trace saving the full logits [batch, pos, vocab] (the baseline)",
          "plain_forward": "plain transformers forward", "pos_block": "attribute(position='all', 'next'), by block",
          "pos_head": "... by head", "pos_neuron": "... by neuron"}


def prompt_ids(entry: dict, batch: int, tokens: int) -> list[list[int]]:
    """``batch`` distinct id lists of ``tokens`` ids: SmolLM2 windows of natural text, the tiny model's word ids."""
    import spec
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(entry["folder"])
    if entry["target"] == " Paris":
        ids = tokenizer(" ".join(spec.SENTENCES * 4), add_special_tokens=False)["input_ids"]
        return [ids[17 * i: 17 * i + tokens] for i in range(batch)]
    return [tokenizer(p, add_special_tokens=False)["input_ids"] for p in spec.tiny_prompts(batch, tokens)]


def build(name: str, model, plain, ids):
    """A no-argument callable running ``name`` once; returns the attribution's error or None."""
    import torch

    import dla_recipes

    encoding = {"input_ids": torch.tensor(ids), "attention_mask": torch.ones(len(ids), len(ids[0]), dtype=torch.long)}
    if name == "trace_full_logits":
        def run():
            with torch.no_grad(), model.trace(dict(encoding)):
                model.logits.save()
        return run
    if name == "plain_forward":
        def run():
            with torch.no_grad():
                plain(**encoding)
        return run
    if name.startswith("pos_"):
        by = name[4:]

        def run():
            return dla_recipes.attribute(model, ids, "next", position="all", by=by).error
        return run
    raise ValueError(f"unknown method {name!r}")


def shape_of(model, ids, by: str) -> dict:
    import dla_recipes

    attr = dla_recipes.attribute(model, ids, "next", position="all", by=by)
    n_sites, n_components = len(attr.sites), len(attr.labels)
    return {"n_sites": n_sites, "n_components": n_components, "values_mb": n_sites * n_components * 4 / 2**20,
            "error": attr.error}


def cmd_time(args, entry, ids) -> dict:
    from local import load_standardized

    model, plain = load_standardized(entry["folder"]), None
    methods, failures, errors = {}, {}, {}
    for name in args.methods:
        try:
            if name == "plain_forward" and plain is None:
                plain = common.load_plain(entry["folder"])
            fn = build(name, model, plain, ids)
            value = fn()
            errors[name] = None if value is None else float(value)
            methods[name] = fn
        except Exception as error:  # noqa: BLE001 - recorded in the results; the rest still runs
            failures[name] = f"{type(error).__name__}: {error}\n{traceback.format_exc(limit=6)}"
    timings = common.time_methods(methods, repeats=args.repeats, warmup=args.warmup, baseline="trace_full_logits")
    shapes = {name: shape_of(model, ids, name[4:]) for name in methods if name.startswith("pos_")}
    return {"timings": timings, "max_error": errors, "shapes": shapes, "failures": failures}


def cmd_mem(args, entry, ids) -> dict:
    from local import load_standardized

    out, failures = {}, {}
    for name in args.methods:
        try:
            model = load_standardized(entry["folder"]) if name != "plain_forward" else None
            plain = common.load_plain(entry["folder"]) if name == "plain_forward" else None
            out[name] = common.measure_peak(build(name, model, plain, ids), warmup=1)
            if name.startswith("pos_"):
                out[name].update(shape_of(model, ids, name[4:]))
        except Exception as error:  # noqa: BLE001 - recorded in the results; the rest still runs
            failures[name] = f"{type(error).__name__}: {error}\n{traceback.format_exc(limit=6)}"
        common.trim()
    return {"memory": out, "failures": failures}


def cmd_remote(args, entry, ids) -> dict:
    import dla_recipes
    from dla_recipes.testing.loopback import LoopbackServer
    from dla_recipes.trace import Readout

    records, failures = [], {}
    with LoopbackServer({args.model: entry["folder"]}, api_key=secrets.token_hex(16)) as server:
        model = server.remote_model(args.model)
        with server.client():  # the first request of a session ships the package: not recorded
            dla_recipes.attribute(model, ids[:1], "next", position=-2, remote=True)
        for name in args.methods:
            by = name[4:]
            try:
                server.clear_stats()
                with server.client():
                    attr = dla_recipes.attribute(model, ids, "next", position="all", by=by, remote=True)
                stats = [s for s in server.stats() if s.get("status") == "COMPLETED"]
                if len(stats) != 1:
                    raise RuntimeError(f"expected one completed request, got {server.stats()}")
                n_sites, n_components = len(attr.sites), len(attr.labels)
                records.append({"method": name, "n_sites": n_sites, "n_components": n_components,
                                "fields": len(Readout.FIELDS),
                                "packed_bytes": n_sites * (n_components + len(Readout.FIELDS)) * 4,
                                "request_bytes": stats[0]["request_bytes"], "result_bytes": stats[0]["result_bytes"],
                                "round_trip_s": stats[0]["seconds"], "error": attr.error})
            except Exception as error:  # noqa: BLE001 - recorded in the results; the rest still runs
                failures[name] = f"{type(error).__name__}: {error}\n{traceback.format_exc(limit=6)}"
    return {"remote": records, "failures": failures}


# ----------------------------------------------------------------------------------------------------------------
# the section (run.py's ``positions``, or ``positions.py section`` alone)
# ----------------------------------------------------------------------------------------------------------------

def section(runner, spec_path, models=MODELS, repeats: int = 5, warmup: int = 1, batch: int = BATCH,
            tokens: int = TOKENS, small_tokens: int = SMALL_TOKENS, quick: bool = False) -> dict:
    """Timing (one process per model), memory (a fresh process per method and length), remote bytes (batch 1,
    by head, the loopback server) for each model; the workers' results, keyed by model. ``quick`` (CI's smoke run):
    the memory runs share one process per length and wait in ``runner``'s memory queue (``runner.run_deferred``
    runs them beside each other), and the remote bytes are left to run.py's remote section, which measures the
    same packed readout (its own loopback server start is the cost saved)."""
    out = {}
    base = ["--spec", str(spec_path), "--batch", str(batch)]
    for model in models:
        entry = {"timing": runner.run(["benchmarks/positions.py", "time", *base, "--model", model, "--tokens",
                                       str(tokens), "--repeats", str(repeats), "--warmup", str(warmup)],
                                      label=f"positions time {model}"), "memory": {}}
        long, short = [m for m in METHODS if m != "plain_forward"], ["pos_head", "pos_neuron"]
        jobs = ([(long, tokens), (short, small_tokens)] if quick  # one shared process per length
                else [([m], tokens) for m in long] + [([m], small_tokens) for m in short])
        for methods, n in jobs:
            args = ["benchmarks/positions.py", "mem", *base, "--model", model, "--tokens", str(n), "--methods",
                    ",".join(methods)]

            def done(result, entry=entry, n=n):
                for method, value in ((result or {}).get("memory") or {}).items():
                    entry["memory"][f"{method}/{n}"] = value
            if quick:
                runner.defer(args, None, f"positions mem {model} {n}", done)
            else:
                done(runner.run(args, memory=True, label=f"positions mem {model} {','.join(methods)} {n}"))
        entry["remote"] = None if quick else runner.run(
            ["benchmarks/positions.py", "remote", "--spec", str(spec_path), "--batch", "1", "--model", model,
             "--tokens", str(tokens), "--methods", "pos_head"], label=f"positions remote {model}")
        out[model] = entry
    return {"models": out, "batch": batch, "tokens": tokens, "small_tokens": small_tokens, "repeats": repeats,
            "quick": quick}


def targets(positions: dict) -> list[dict]:
    out = []
    for model, entry in (positions or {}).get("models", {}).items():
        timings = ((entry.get("timing") or {}).get("timings") or {})
        for method, bound in TARGETS.items():
            ratio = timings.get(method, {}).get("paired_ratio")
            if ratio is not None:
                out.append({"target": f"all positions, {method[4:]}: time / trace saving full logits <= {bound}",
                            "where": f"{model}, {positions['batch']} x {positions['tokens']} tokens",
                            "value": ratio, "bound": bound, "met": ratio <= bound})
    return out


def markdown(positions: dict, spec: dict) -> list[str]:
    if not positions or not positions.get("models"):
        return []
    b, n, small = positions["batch"], positions["tokens"], positions["small_tokens"]
    lines = [f"## All positions (positions.py; batch {b} x {n} tokens, target 'next': {n - 1} sites a prompt)", "",
             ("`dla_recipes.attribute(model, ids, \"next\", position=\"all\", by=...)`: every position in one forward "
             "pass, against a trace that saves the full logits in the same process (ratio: median over rounds of the "
             f"per-round ratio, {positions['repeats']} rounds). Memory: peak RSS of one call above the loaded model, "
             "a fresh process per method; `values MB` is the result's `n_sites x n_components x 4` bytes."), ""]
    for model, entry in positions["models"].items():
        timing = (entry.get("timing") or {})
        timings, shapes = timing.get("timings") or {}, timing.get("shapes") or {}
        memory = entry.get("memory") or {}
        lines += [f"### {model}", "", spec["models"][model]["description"], "",
                  (f"| method | median ms | ratio | components | peak above loaded MB ({n} tok) | values MB | "
                  f"peak above loaded MB ({small} tok) | max error |"), "|---|---:|---:|---:|---:|---:|---:|---:|"]
        for method in METHODS:
            t = timings.get(method)
            if t is None:
                continue
            shape, big, little = shapes.get(method, {}), memory.get(f"{method}/{n}", {}), memory.get(f"{method}/{small}", {})
            error = (timing.get("max_error") or {}).get(method)
            lines.append(f"| {LABELS[method]} | {t['median_s'] * 1e3:.0f} | {t['paired_ratio']:.3f} | "
                         f"{shape.get('n_components', '—')} | {_mb(big)} | "
                         f"{'—' if 'values_mb' not in shape else format(shape['values_mb'], '.1f')} | {_mb(little)} | "
                         f"{'—' if error is None else format(error, '.1e')} |")
        lines.append("")
        for rec in (entry.get("remote") or {}).get("remote", []):
            lines += [(f"Remote (loopback NDIF server, batch 1 x {n} tokens, {rec['method']}): {rec['n_sites']} sites x "
                      f"{rec['n_components']} components; result {rec['result_bytes']} B, request "
                      f"{rec['request_bytes']} B; the packed readout n_sites x (n_components + {rec['fields']}) x 4 = "
                      f"{rec['packed_bytes']} B; round trip {rec['round_trip_s']:.2f} s, error {rec['error']:.1e}."), ""]
    return lines


def _mb(measured: dict) -> str:
    return "—" if "peak_above_loaded_mb" not in measured else f"{measured['peak_above_loaded_mb']:.1f}"


def standalone(argv) -> None:
    """``positions.py section``: this section alone, into ``--out`` (spec written there)."""
    import json
    import platform
    import time

    import run
    import spec as spec_module

    parser = argparse.ArgumentParser(description="the all-positions benchmark section alone")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "positions"))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--models", default=",".join(MODELS))
    args = parser.parse_args(argv)
    out = Path(args.out).resolve()
    os.environ.update({"OMP_NUM_THREADS": str(args.threads), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    models = args.models.split(",")
    t0, load_before = time.perf_counter(), common.load_average()
    spec_path = spec_module.write_spec(out, models, [BATCH], False)
    runner = run.Runner(args.threads, sys.executable, 1800)
    result = section(runner, spec_path, models, repeats=args.repeats)
    import torch

    result["meta"] = {"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
                      "cpus": os.cpu_count(), "threads": args.threads, "load_before": load_before,
                      "load_after": common.load_average(), "total_s": time.perf_counter() - t0}
    result["targets"], result["failures"] = targets(result), runner.failures
    (out / "positions.json").write_text(json.dumps(result, indent=1, default=str))
    meta = result["meta"]
    text = [(f"{meta['platform']}, {meta['cpus']} CPUs, Python {meta['python']}, torch {meta['torch']}, "
            f"OMP_NUM_THREADS={meta['threads']}, load average {meta['load_before']} -> {meta['load_after']}, "
            f"{meta['total_s']:.0f} s"), "", *markdown(result, common.read_json(spec_path))]
    text += ["| target | where | value | bound | met |", "|---|---|---:|---:|:---:|"]
    text += [f"| {t['target']} | {t['where']} | {t['value']:.3f} | {t['bound']} | {'yes' if t['met'] else '**NO**'} |"
             for t in result["targets"]]
    text += [f"- FAILED {f['label']}: {(f.get('error') or f.get('stderr', ''))[-300:]!r}" for f in runner.failures]
    (out / "positions.md").write_text("\n".join(text) + "\n")
    print("\n".join(text))


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["section"]:
        standalone(argv[1:])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["time", "mem", "remote"])
    parser.add_argument("--spec", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    args = parser.parse_args(argv)
    args.methods = [m for m in args.methods.split(",") if m]
    common.offline()
    threads = common.set_threads()
    import dla_recipes  # noqa: F401 - its nnterp shim must load before nnterp

    entry = common.read_json(args.spec)["models"][args.model]
    ids = prompt_ids(entry, args.batch, args.tokens)
    assert all(len(i) == args.tokens for i in ids), [len(i) for i in ids]
    command = {"time": cmd_time, "mem": cmd_mem, "remote": cmd_remote}[args.command]
    result = command(args, entry, ids)
    result.update({"model": args.model, "batch": args.batch, "tokens": args.tokens, "threads": threads,
                   "pid": os.getpid()})
    common.emit(result)


if __name__ == "__main__":
    main()
