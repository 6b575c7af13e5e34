"""dla_recipes benchmarks: one command, a JSON file and a Markdown table.

    .venv/bin/python benchmarks/run.py            # full run (SmolLM2-135M + wide tiny model, TransformerLens,
                                                  # remote, scaling sweep): ~20-30 min on 2 cores
    .venv/bin/python benchmarks/run.py --quick    # CI smoke run: wide tiny model only, one run each, < 2 min
                                                  # (TransformerLens memory at batch 1 only, a 2-point sweep)

With a CUDA device the GPU section runs ``benchmarks/gpu_llama8b.py`` (Llama-3.1-8B shapes, bfloat16) and records
it (``gpu`` in the JSON, a ``GPU`` table in the Markdown); without one the output says so: "GPU section: skipped,
no CUDA device on this machine".

Writes ``<out>/bench-<mode>-<timestamp>.json`` and ``.md`` and copies them to ``<out>/latest-<mode>.json|md``
(``--out`` default: ``benchmarks/results``, git-ignored). See ``benchmarks/README.md`` for how to read them.

Every measurement runs in a worker subprocess with ``OMP_NUM_THREADS`` fixed (``--threads``, default 1) and
recorded: timings of all methods of one model and batch size in one process, interleaved, so their ratios come from
the same process run; peak memory in a fresh process per method (``--quick``: one shared process per model and
batch, methods one after another with the peak mark reset in between). TransformerLens runs in ``.venv-tl``
(``--tl-python``); it is skipped when that interpreter does not exist.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime as dt
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

import common

DEFAULT_TL_PYTHON = ROOT / ".venv-tl" / "bin" / "python"
MEMORY_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}

# Targets (reported, never asserted).
T_BLOCK_HEAD = 1.10
T_NEURON = 1.5
T_TL_MEMORY = 1 / 3


def log(message: str) -> None:
    print(f"[bench {dt.datetime.now():%H:%M:%S}] {message}", flush=True)


class Runner:
    """Runs worker subprocesses with the fixed thread count and collects their marked JSON results. ``forked``
    (the quick run, CI's smoke test): a worker on this interpreter is forked from a zygote that has imported torch,
    transformers, nnsight and the package (``dla_recipes.testing.zygote``: about 5 s of CPU saved a worker), a
    memory worker from one started in the memory workers' environment (glibc reads ``MALLOC_*`` at process start,
    and a fork keeps its parent's allocator settings; ``common.measure_peak`` resets the peak after the model is
    loaded, so the zygote's pages are not counted above it). The full run keeps a fresh process for each worker,
    as do workers on another interpreter (TransformerLens's)."""

    def __init__(self, threads: int, python: str, timeout: float, forked: bool = False):
        from dla_recipes.testing.zygote import Zygote

        self.threads, self.python, self.timeout = threads, python, timeout
        self.failures: list[dict] = []
        self.pending: list = []
        self.zygotes = {memory: Zygote(python, self.env(memory)) for memory in (False, True)} if forked else {}

    def env(self, memory: bool = False) -> dict:
        env = dict(os.environ)
        env.update({"OMP_NUM_THREADS": str(self.threads), "MKL_NUM_THREADS": str(self.threads),
                    "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                    "PYTHONWARNINGS": "ignore", "TQDM_DISABLE": "1"})
        if memory:
            env.update(MEMORY_ENV)
        return env

    def run(self, args: list[str], python: str | None = None, memory: bool = False, label: str = "") -> dict | None:
        command = [python or self.python, *args]
        if self.zygotes and python in (None, self.python):
            command = self.zygotes[memory].command("script", args, os.devnull)
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(command, capture_output=True, text=True, env=self.env(memory), cwd=ROOT, check=False,
                                  timeout=self.timeout)
        except subprocess.TimeoutExpired as error:
            self.failures.append({"label": label, "command": command, "error": f"timeout after {error.timeout}s"})
            log(f"  FAILED {label}: timeout")
            return None
        for line in proc.stdout.splitlines():
            if line.startswith(common.RESULT_MARK):
                result = json.loads(line[len(common.RESULT_MARK):])
                result["wall_s"] = time.perf_counter() - t0
                for method, text in (result.get("failures") or {}).items():
                    self.failures.append({"label": f"{label}: {method}", "command": command, "error": text})
                    log(f"  FAILED {label}: {method}: {text.splitlines()[0] if text else ''}")
                return result
        tail = (proc.stderr or "")[-3000:]
        self.failures.append({"label": label, "command": command, "returncode": proc.returncode, "stderr": tail})
        log(f"  FAILED {label}: exit {proc.returncode}\n{tail[-800:]}")
        return None

    def defer(self, args: list[str], python: str | None, label: str, done) -> None:
        """Queue a memory job; ``done(result)`` gets its result when ``run_deferred`` runs the queue."""
        self.pending.append((args, python, label, done))

    def run_deferred(self, parallel: int) -> None:
        """Run the queued memory jobs, ``parallel`` at a time: peak RSS does not depend on CPU sharing, so these
        (unlike the timing runs, which run one at a time) may share the cores."""
        jobs, self.pending = self.pending, []
        log(f"peak memory: {len(jobs)} worker processes, {parallel} at a time")
        with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, parallel)) as pool:
            futures = [pool.submit(self.run, args, python, True, label) for args, python, label, _ in jobs]
            for (_, _, _, done), future in zip(jobs, futures):
                done(future.result())


# ----------------------------------------------------------------------------------------------------------------
# sections
# ----------------------------------------------------------------------------------------------------------------

def local_section(runner: Runner, spec_path: Path, models: list[str], batches: list[int], opts) -> dict:
    import local

    out: dict = {}
    for model in models:
        for batch in batches:
            key = f"{model}/b{batch}"
            log(f"local timing {key}")
            timing = runner.run(["benchmarks/local.py", "time", "--spec", str(spec_path), "--model", model,
                                 "--batch", str(batch), "--repeats", str(opts.repeats), "--warmup", str(opts.warmup)],
                                label=f"local time {key}")
            tl_timing = None
            if opts.tl_python:
                log(f"TransformerLens timing {key}")
                tl_timing = runner.run(["benchmarks/tl_worker.py", "time", "--spec", str(spec_path), "--model", model,
                                        "--batch", str(batch), "--repeats", str(opts.repeats), "--warmup",
                                        str(opts.warmup)], python=opts.tl_python, label=f"tl time {key}")
            out[key] = {"model": model, "batch": batch, "timing": timing, "tl_timing": tl_timing}
    # memory: a fresh process per method (full) or one per model and batch (quick: the main methods only)
    for model in models:
        for batch in batches:
            key = f"{model}/b{batch}"
            base = ["--spec", str(spec_path), "--model", model, "--batch", str(batch)]
            groups = [[m] for m in local.ALL_METHODS] if not opts.quick else [local.CORE]
            tl_groups = []
            if opts.tl_python and not (opts.quick and batch != batches[0]):  # quick: TL memory at batch 1 only
                import tl_worker

                tl_groups = [[m] for m in tl_worker.METHODS] if not opts.quick else [tl_worker.METHODS]
            for group, script, python, field in ([(g, "local.py", None, "memory") for g in groups]
                                                 + [(g, "tl_worker.py", opts.tl_python, "tl_memory") for g in tl_groups]):
                def done(result, key=key, field=field):
                    slot = out[key].setdefault(field, {"memory": {}, "failures": {}})
                    if result:
                        slot["memory"].update(result.get("memory", {}))
                        slot["failures"].update(result.get("failures", {}))
                        slot["shared_process"] = result.get("shared_process", False)
                runner.defer([f"benchmarks/{script}", "mem", *base, "--methods", ",".join(group)], python,
                             f"{script} mem {key} {','.join(group)}", done)
    return out


def breakdown_section(runner: Runner, spec_path: Path, models: list[str], batches: list[int], opts) -> dict:
    out = {}
    for model in models:
        for batch in batches if not opts.quick else batches[:1]:
            key = f"{model}/b{batch}"
            log(f"breakdown {key}")
            out[key] = runner.run(["benchmarks/breakdown.py", "--spec", str(spec_path), "--model", model, "--batch",
                                   str(batch), "--repeats", str(opts.repeats), "--profile-runs",
                                   "1" if opts.quick else "5"], label=f"breakdown {key}")
    return out


def remote_section(runner: Runner, spec_path: Path, opts) -> dict | None:
    log("remote (loopback NDIF server)")
    args = ["benchmarks/remote.py", "--spec", str(spec_path), "--repeats", str(max(1, min(opts.repeats, 3)))]
    if opts.quick:
        args += ["--models", "tiny", "--methods", "dla_block,dla_head,dla_neuron,save_all_block",
                 "--long-tokens", "128", "--warmup", "0"]
    return runner.run(args, label="remote")


def scaling_section(runner: Runner, out_dir: Path, opts) -> dict | None:
    import sweep

    spec_path, points = sweep.write_spec(out_dir, opts.quick)
    results = []
    for p in points:
        log(f"scaling timing {p['key']}")
        timing = runner.run(["benchmarks/local.py", "time", "--spec", str(spec_path), "--model", p["key"],
                             "--batch", str(p["batch"]), "--methods", ",".join(sweep.METHODS),
                             "--repeats", str(max(1, min(opts.repeats, 5))), "--warmup", "1"],
                            label=f"sweep time {p['key']}")
        results.append({"point": p, "timing": timing, "memory": {}})
    for i, p in enumerate(points):
        base = ["--spec", str(spec_path), "--model", p["key"], "--batch", str(p["batch"])]
        groups = [[m] for m in sweep.METHODS] if not opts.quick else [sweep.METHODS]
        for group in groups:
            def done(result, i=i):
                if result:
                    results[i]["memory"].update(result.get("memory", {}))
            runner.defer(["benchmarks/local.py", "mem", *base, "--methods", ",".join(group)], None,
                         f"sweep mem {p['key']} {','.join(group)}", done)
    return {"points": results, "methods": sweep.METHODS}


def launches_section(runner: Runner, out_dir: Path, opts) -> dict | None:
    """``benchmarks/launches.py``: aten ops, host syncs, widenings and reads of one call inside the trace, counted
    on the CPU (``--quick``: the 8-layer Llama, bfloat16, block / head / neuron)."""
    log("launches (device cost counted on the CPU)")
    args = ["benchmarks/launches.py", "--out", str(out_dir / "launches")]
    if opts.quick:
        args.append("--quick")
    return runner.run(args, label="launches")


GPU_SKIPPED = "skipped, no CUDA device on this machine"


def gpu_section(runner: Runner, out_dir: Path, opts) -> dict:
    """``benchmarks/gpu_llama8b.py`` (Llama-3.1-8B shapes, bfloat16, batch 64 x 128; ``--quick``: 8 x 32, one
    repeat) on the CUDA device when this machine has one, its JSON recorded; else a record that it was skipped."""
    import torch

    if not torch.cuda.is_available():
        log(f"GPU section: {GPU_SKIPPED}")
        return {"skipped": GPU_SKIPPED}
    log(f"GPU section: {torch.cuda.get_device_name(0)}")
    folder = out_dir / "gpu"
    command = [runner.python, "benchmarks/gpu_llama8b.py", "--out", str(folder)]
    if opts.quick:
        command += ["--batch", "8", "--seq", "32", "--repeats", "1", "--warmup", "1"]
    try:
        proc = subprocess.run(command, capture_output=True, text=True, env=runner.env(), cwd=ROOT, check=False,
                              timeout=runner.timeout)
    except subprocess.TimeoutExpired as error:
        runner.failures.append({"label": "gpu", "command": command, "error": f"timeout after {error.timeout}s"})
        return {"error": f"timeout after {error.timeout}s"}
    path = folder / "gpu_llama8b.json"
    if not path.exists():
        runner.failures.append({"label": "gpu", "command": command, "returncode": proc.returncode,
                                "stderr": (proc.stderr or "")[-3000:]})
        return {"error": f"exit {proc.returncode}"}
    return json.loads(path.read_text())


def gpu_markdown(gpu: dict | None) -> list[str]:
    """The GPU section's lines: its table, or the line saying it was skipped (or failed)."""
    if not gpu:
        return []
    if gpu.get("skipped") or gpu.get("error"):
        return [f"GPU section: {gpu.get('skipped') or 'FAILED, ' + gpu['error']}", ""]
    shape = gpu["shape"]
    lines = [f"## GPU: {gpu['device_name']}, torch {gpu['torch']}", "",
             (f"Llama-3.1-8B shapes ({shape['num_hidden_layers']} layers, d_model {shape['hidden_size']}, d_mlp "
             f"{shape['intermediate_size']}), {gpu['dtype']}, batch {gpu['batch']} x {gpu['seq']} tokens, median of "
             f"{gpu['repeats']} runs; ratios to (2) in the same process."), "",
             "| method | median ms | ratio to (2) | peak above loaded MB | max error |", "|---|---:|---:|---:|---:|"]
    for name, r in gpu["results"].items():
        lines.append(f"| {LABELS.get(name, name)} | {r['median_s'] * 1e3:.1f} | {_f(r.get('ratio_to_trace_logits'), '{:.3f}')} | "
                     f"{_f(r.get('peak_above_loaded_mb'), '{:.0f}')} | {_f(r.get('max_error'), '{:.1e}')} |")
    return [*lines, ""]


def scaling_analysis(scaling: dict) -> dict:
    import sweep

    results, points = scaling["points"], [r["point"] for r in scaling["points"]]
    analysis = {}
    for axis in sorted({p["axis"] for p in points}):
        rows = [r for r in results if r["point"]["axis"] == axis and r["timing"]]
        xs = [r["point"][axis] for r in rows]
        entry = {"values": xs}
        for method in sweep.METHODS:
            times = [r["timing"]["timings"].get(method, {}).get("median_s") for r in rows]
            mems = [r["memory"].get(method, {}).get("peak_above_loaded_mb") for r in rows]
            entry[method] = {"time_exponent": sweep.exponent(xs, times), "median_s": times,  # None-safe
                             "peak_above_loaded_mb": mems, "memory_exponent": sweep.exponent(xs, mems)}
        cache = [sweep.cache_bytes(r["point"]) / 2**20 for r in rows]
        for method in ("dla_head", "dla_neuron", "save_all_block"):
            def minus(a, b):
                return None if a is None or b is None else a - b

            extra_t = [minus(r["timing"]["timings"].get(method, {}).get("median_s"),
                             r["timing"]["timings"].get("trace_logits", {}).get("median_s")) for r in rows]
            extra_m = [minus(r["memory"].get(method, {}).get("peak_above_loaded_mb"),
                             r["memory"].get("trace_logits", {}).get("peak_above_loaded_mb")) for r in rows]
            entry[method]["extra_time_over_trace_s"] = extra_t
            entry[method]["extra_memory_over_trace_mb"] = extra_m
            pairs = [(c, m) for c, m in zip(cache, extra_m) if m is not None]
            entry[method]["marginal_memory_per_cache_byte"] = sweep.slope([c for c, _ in pairs], [m for _, m in pairs])
        entry["cache_mb"] = cache
        analysis[axis] = entry
    return analysis


# ----------------------------------------------------------------------------------------------------------------
# derived numbers and targets
# ----------------------------------------------------------------------------------------------------------------

def _t(section, method, field="paired_ratio"):
    if not section or not section.get("timings") or method not in section["timings"]:
        return None
    return section["timings"][method].get(field)


def _m(slot, method, field="peak_above_loaded_mb"):
    if not slot:
        return None
    return slot.get("memory", {}).get(method, {}).get(field)


def derive(local: dict) -> dict:
    """Per model and batch: every method's ratio to (2), TransformerLens's through the plain forward."""
    out = {}
    for key, entry in local.items():
        timing, tl = entry.get("timing"), entry.get("tl_timing")
        plain_over_trace = _t(timing, "plain_forward")
        rows = {}
        if timing:
            for method, t in timing["timings"].items():
                rows[method] = {"median_ms": t["median_s"] * 1e3, "min_ms": t["min_s"] * 1e3,
                                "ratio": t.get("paired_ratio"), "ratio_source": "same process",
                                "max_error": timing["max_error"].get(method),
                                "peak_above_loaded_mb": _m(entry.get("memory"), method),
                                "peak_rss_mb": _m(entry.get("memory"), method, "peak_rss_mb")}
        if tl:
            for method, t in tl["timings"].items():
                name = "tl_plain_forward" if method == "plain_forward" else method
                ratio = None
                if plain_over_trace and t.get("paired_ratio"):
                    ratio = t["paired_ratio"] * plain_over_trace
                rows[name] = {"median_ms": t["median_s"] * 1e3, "min_ms": t["min_s"] * 1e3, "ratio": ratio,
                              "ratio_source": "TL process, via plain forward",
                              "max_error": tl["max_error"].get(method),
                              "peak_above_loaded_mb": _m(entry.get("tl_memory"), method),
                              "peak_rss_mb": _m(entry.get("tl_memory"), method, "peak_rss_mb")}
        out[key] = rows
    return out


def targets(derived: dict, remote: dict | None, scaling: dict | None) -> list[dict]:
    rows = []

    def add(name, where, value, bound, met, note=""):
        rows.append({"target": name, "where": where, "value": value, "bound": bound, "met": met, "note": note})

    for key, methods in derived.items():
        for by, bound in (("block", T_BLOCK_HEAD), ("head", T_BLOCK_HEAD), ("neuron", T_NEURON)):
            r = methods.get(f"dla_{by}", {}).get("ratio")
            if r is not None:
                add(f"dla per {by} <= {bound}x logits-only trace", key, r, bound, r <= bound)
        for by, tl_names in (("block", ("tl_block", "tl_tool_block")), ("head", ("tl_head", "tl_tool_head")),
                             ("neuron", ("tl_neuron",))):
            ours = methods.get(f"dla_{by}", {})
            for tl_name in tl_names:
                theirs = methods.get(tl_name)
                if not theirs or ours.get("ratio") is None or theirs.get("ratio") is None:
                    continue
                speed = ours["ratio"] / theirs["ratio"]
                add(f"dla per {by} faster than {tl_name}", key, speed, 1.0, speed < 1.0,
                    "time(dla) / time(TL), both normalised to the same plain forward")
                mo, mt = ours.get("peak_above_loaded_mb"), theirs.get("peak_above_loaded_mb")
                if mo is not None and mt:
                    add(f"dla per {by} peak memory <= 1/3 of {tl_name}'s (above the loaded model)", key, mo / mt,
                        T_TL_MEMORY, mo / mt <= T_TL_MEMORY, f"{mo:.1f} MB vs {mt:.1f} MB")
    if remote and remote.get("records"):
        by_key: dict = {}
        for rec in remote["records"]:
            if rec["method"].startswith("dla_"):
                add("remote result <= 1 KB + 8 B per component", f"{rec['model']}/{rec['prompt']}/{rec['method']}",
                    rec["result_bytes"], rec["result_bound_bytes"], rec["within_bound"],
                    f"{rec['n_components']} components, {rec['tokens']} tokens")
                by_key.setdefault((rec["model"], rec["method"]), {})[rec["prompt"]] = rec["result_bytes"]
        for (model, method), sizes in by_key.items():
            if "short" in sizes and "long" in sizes:
                diff = abs(sizes["long"] - sizes["short"])
                add("remote result independent of sequence length", f"{model}/{method}", diff, 64, diff <= 64,
                    f"short {sizes['short']} B, long {sizes['long']} B (zstd-compressed, so a few bytes move)")
    if scaling and scaling.get("analysis"):
        for axis, entry in scaling["analysis"].items():
            for method in ("dla_head", "dla_neuron"):
                e = entry.get(method, {}).get("time_exponent")
                if e is not None:
                    add(f"{method} time grows at most linearly in {axis}", f"sweep/{axis}", e, 1.15, e <= 1.15,
                        "log-log slope of the median time")
                marginal = entry.get(method, {}).get("marginal_memory_per_cache_byte")
                if marginal is not None:
                    contrast = entry.get("save_all_block", {}).get("marginal_memory_per_cache_byte")
                    add(f"{method} holds no [layers, pos, d_model] per prompt", f"sweep/{axis}", marginal, 0.25,
                        marginal <= 0.25, "slope of (peak above the logits-only trace) against the bytes of a "
                        "[layers, pos, d_model] float32 cache for the batch; save-everything: "
                        + (f"{contrast:.2f}" if contrast is not None else "n/a"))
    return rows


# ----------------------------------------------------------------------------------------------------------------
# markdown
# ----------------------------------------------------------------------------------------------------------------

LABELS = {
    "plain_forward": "(1) plain transformers forward",
    "trace_logits": "(2) nnsight trace, logits only",
    "dla_block": "(3) dla_recipes per block",
    "dla_head": "(3) dla_recipes per head",
    "dla_neuron": "(3) dla_recipes per neuron",
    "save_all_block": "(4) save-everything, per block",
    "save_all_head": "(4) save-everything, per head",
    "save_all_neuron": "(4) save-everything, per neuron",
    "tl_plain_forward": "(5) plain forward in the TL process",
    "tl_forward": "(5) TL bridge forward",
    "tl_block": "(5) TL run_with_cache + decompose_resid + logit_attrs",
    "tl_head": "(5) TL run_with_cache + stack_head_results + logit_attrs",
    "tl_neuron": "(5) TL run_with_cache + stack_neuron_results + logit_attrs",
    "tl_tool_block": "(5) TL direct_logit_attribution(unit=component)",
    "tl_tool_head": "(5) TL direct_logit_attribution(unit=head)",
    "recipe_block": "in-trace recipe alone (full logits), per block",
    "recipe_head": "in-trace recipe alone (full logits), per head",
    "recipe_neuron": "in-trace recipe alone (full logits), per neuron",
    "plain_forward_keep1": "(1) with logits_to_keep=1",
    "trace_logits_keep1": "(2) with logits_to_keep=1",
    "trace_logits_grad": "(2) without torch.no_grad (nnsight's default)",
}
ORDER = list(LABELS)
BREAKDOWN_LABELS = {
    "trace_logits": "(2) logits-only trace",
    "reads_block": "trace + the block recipe's reads only", "reads_head": "trace + the head recipe's reads only",
    "reads_neuron": "trace + the neuron recipe's reads only",
    "recipe_block": "in-trace recipe, block", "recipe_head": "in-trace recipe, head",
    "recipe_neuron": "in-trace recipe, neuron",
    "attribute_block": "attribute(), block", "attribute_head": "attribute(), head",
    "attribute_neuron": "attribute(), neuron",
    "labels_block": "plan.labels('block') alone", "labels_head": "plan.labels('head') alone",
    "labels_neuron": "plan.labels('neuron') alone",
    "pullbacks_head": "u @ W_O for every layer, alone", "pullbacks_neuron": "u @ W_down for every layer, alone",
    "build_plan": "build_plan() alone", "prepare": "transport.batches.prepare() alone",
}


def _f(x, fmt="{:.2f}"):
    return "—" if x is None else fmt.format(x)


def markdown(result: dict) -> str:
    meta = result["meta"]
    lines = [f"# dla_recipes benchmarks ({meta['mode']})", "",
             (f"{meta['started']}, {meta['platform']}, Python {meta['python']}, torch {meta.get('torch')}, "
              f"OMP_NUM_THREADS={meta['threads']} (torch.set_num_threads({meta['threads']})), "
              f"{meta['repeats']} timed runs per method after {meta['warmup']} warm-up, "
              f"load average {meta['load_before']} -> {meta['load_after']}, total {meta['total_s']:.0f} s."), "",
             "Ratios are to (2), the logits-only nnsight trace, median over runs of the per-round ratio in the same "
             "process; TransformerLens (another venv, another process) is put on the same scale through the "
             "plain forward both processes time. Memory: peak RSS of one call above the loaded model (after a "
             "warm-up call), in a fresh process per method" + (" (quick: shared process)" if meta["quick"] else "")
             + ". Error: max |sum of parts - model's logit|.", ""]
    for key, rows in result["derived"].items():
        model, batch = key.split("/")
        desc = result["spec"]["models"][model]["description"]
        lines += [f"## {model}, batch {batch[1:]} x {result['spec']['prompt_tokens']} tokens", "", f"{desc}", "",
                  "| method | median ms | ratio to (2) | peak above loaded MB | peak RSS MB | max error |",
                  "|---|---:|---:|---:|---:|---:|"]
        for method in sorted(rows, key=lambda m: ORDER.index(m) if m in ORDER else 99):
            r = rows[method]
            lines.append(f"| {LABELS.get(method, method)} | {_f(r['median_ms'], '{:.1f}')} | "
                         f"{_f(r['ratio'], '{:.3f}')} | {_f(r['peak_above_loaded_mb'], '{:.1f}')} | "
                         f"{_f(r['peak_rss_mb'], '{:.0f}')} | {_f(r['max_error'], '{:.1e}')} |")
        lines.append("")
    tl_probe = result.get("tl_probe")
    if tl_probe:
        lines += ["TransformerLens: " + "; ".join(
            f"{k}: {'loaded offline (' + v.get('adapter', '') + ')' if v.get('loaded') else 'NOT loaded: ' + str(v.get('error'))}"
            for k, v in tl_probe.items()), ""]
    breakdown = {k: v for k, v in (result.get("breakdown") or {}).items() if v}
    if breakdown:
        lines += ["## Where the time goes (breakdown.py; ms, and in parentheses the fraction of (2))", "",
                  "| piece | " + " | ".join(breakdown) + " |", "|---|" + "---:|" * len(breakdown)]
        names = []
        for v in breakdown.values():
            names += [n for n in v["timings"] if n not in names]
        for name in names:
            cells = []
            for v in breakdown.values():
                t = v["timings"].get(name)
                cells.append("—" if not t else f"{t['median_s'] * 1e3:.2f} ({t.get('paired_ratio', 0):.3f})")
            lines.append(f"| {BREAKDOWN_LABELS.get(name, name)} | " + " | ".join(cells) + " |")
        lines.append("")
    remote = result.get("remote")
    if remote and remote.get("records"):
        lines += ["## Remote (loopback NDIF server, single-threaded, batch 1)", "",
                  "| model | prompt | method | components | request B | result B | bound B | round trip s | error |",
                  "|---|---|---|---:|---:|---:|---:|---:|---:|"]
        for rec in remote["records"]:
            lines.append(f"| {rec['model']} (d {rec['d_model']}) | {rec['prompt']} ({rec['tokens']} tok) | "
                         f"{rec['method']} | {rec['n_components']} | {rec['request_bytes']} | {rec['result_bytes']} | "
                         f"{rec['result_bound_bytes'] if rec['method'].startswith('dla_') else '—'} | "
                         f"{rec['round_trip_s']:.3f} | {_f(rec['max_error'], '{:.1e}')} |")
        lines.append("")
    scaling = result.get("scaling")
    if scaling and scaling.get("points"):
        lines += ["## Scaling (random Llama d_model 256, 8 layers; base batch 4, 32 tokens, d_mlp 1024)", "",
                  "| axis | value | " + " | ".join(f"{m} ms" for m in scaling["methods"]) + " | "
                  + " | ".join(f"{m} MB" for m in scaling["methods"]) + " | [L,pos,d] cache MB |",
                  "|---|---:|" + "---:|" * (2 * len(scaling["methods"]) + 1)]
        import sweep

        for r in scaling["points"]:
            p = r["point"]
            times = [(r["timing"] or {}).get("timings", {}).get(m, {}).get("median_s") for m in scaling["methods"]]
            mems = [r["memory"].get(m, {}).get("peak_above_loaded_mb") for m in scaling["methods"]]
            lines.append(f"| {p['axis']} | {p[p['axis']]} | " + " | ".join(_f(t and t * 1e3, '{:.1f}') for t in times)
                         + " | " + " | ".join(_f(m, '{:.1f}') for m in mems)
                         + f" | {sweep.cache_bytes(p) / 2**20:.1f} |")
        lines += ["", "Growth exponents (log-log slope of median time / peak memory over each axis; 1 = linear):", ""]
        for axis, entry in scaling["analysis"].items():
            parts = [f"{m}: time {_f(entry[m]['time_exponent'])}, memory {_f(entry[m]['memory_exponent'])}"
                     for m in scaling["methods"]]
            lines.append(f"- {axis} {entry['values']}: " + "; ".join(parts))
        lines.append("")
    import positions

    lines += positions.markdown(result.get("positions"), result["spec"])
    import launches

    lines += launches.markdown(result.get("launches"))
    lines += gpu_markdown(result.get("gpu"))
    if result.get("targets"):
        lines += ["## Targets (reported, not asserted)", "", "| target | where | value | bound | met |",
                  "|---|---|---:|---:|:---:|"]
        for t in result["targets"]:
            value = t["value"]
            shown = f"{value:.3f}" if isinstance(value, float) else str(value)
            lines.append(f"| {t['target']} | {t['where']} | {shown} | {t['bound']:.3g} | "
                         f"{'yes' if t['met'] else '**NO**'} |")
        lines.append("")
    if result.get("failures"):
        lines += ["## Failures", ""] + [f"- {f['label']}: {f.get('error') or f.get('stderr', '')[-300:]!r}"
                                        for f in result["failures"]] + [""]
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------------------

def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="CI smoke run: wide tiny model only, one run each")
    parser.add_argument("--out", default=str(HERE / "results"))
    parser.add_argument("--threads", type=int, default=int(os.environ.get("BENCH_THREADS", "1")),
                        help="OMP_NUM_THREADS / torch.set_num_threads for every worker (default 1)")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs per method (default 9; quick 1)")
    parser.add_argument("--warmup", type=int, default=None, help="warm-up runs per method (default 2; quick 1)")
    parser.add_argument("--tl-python", default=str(DEFAULT_TL_PYTHON),
                        help="the TransformerLens venv's python ('' to skip TransformerLens)")
    parser.add_argument("--skip", default="",
                        help="comma list of sections to skip: local,tl,breakdown,remote,scaling,positions,launches,"
                             "gpu")
    parser.add_argument("--parallel-mem", type=int, default=2, help="memory worker processes at a time")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per worker process")
    opts = parser.parse_args(argv)
    opts.repeats = opts.repeats or (1 if opts.quick else 9)
    opts.warmup = opts.warmup if opts.warmup is not None else (1 if opts.quick else 2)
    skip = {s for s in opts.skip.split(",") if s}
    if "tl" in skip or not opts.tl_python or not Path(opts.tl_python).exists():
        opts.tl_python = None
    out_dir = Path(opts.out).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    started = dt.datetime.now()
    mode = "quick" if opts.quick else "full"
    os.environ.update({"OMP_NUM_THREADS": str(opts.threads), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    import spec as spec_module
    import torch

    import dla_recipes  # noqa: F401 - its nnterp shim must load before nnterp

    models = ["wide"] if opts.quick else ["smollm2", "wide"]
    batches = [1, 8] if opts.quick else [1, 16]
    log(f"{mode} run: models {models}, batches {batches}, threads {opts.threads}, repeats {opts.repeats}, "
        f"TransformerLens {'at ' + opts.tl_python if opts.tl_python else 'skipped'}")
    spec_path = spec_module.write_spec(out_dir, models, batches, opts.quick)
    spec = common.read_json(spec_path)
    runner = Runner(opts.threads, sys.executable, opts.timeout, forked=opts.quick)
    load_before = common.load_average()
    result: dict = {"spec": spec}
    tl_probe = {}
    if opts.tl_python:
        for model in models:
            probe = runner.run(["benchmarks/tl_worker.py", "probe", "--spec", str(spec_path), "--model", model],
                               python=opts.tl_python, label=f"tl probe {model}")
            tl_probe[model] = probe or {"loaded": False, "error": "the probe process failed (see failures)"}
            if probe and probe.get("versions"):
                result["tl_versions"] = probe["versions"]
        result["tl_probe"] = tl_probe
    sections = {}
    t0 = time.perf_counter()
    local = local_section(runner, spec_path, models, batches, opts) if "local" not in skip else {}
    sections["local_timing_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    result["breakdown"] = breakdown_section(runner, spec_path, models, batches, opts) if "breakdown" not in skip else {}
    sections["breakdown_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    result["remote"] = remote_section(runner, spec_path, opts) if "remote" not in skip else None
    sections["remote_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    result["scaling"] = scaling_section(runner, out_dir, opts) if "scaling" not in skip else None
    sections["scaling_timing_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    import positions

    result["positions"] = (positions.section(runner, spec_path, models, repeats=max(1, min(opts.repeats, 5)),
                                             warmup=opts.warmup, tokens=32 if opts.quick else positions.TOKENS,
                                             quick=opts.quick)
                           if "positions" not in skip else None)
    sections["positions_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    result["launches"] = launches_section(runner, out_dir, opts) if "launches" not in skip else None
    sections["launches_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    result["gpu"] = gpu_section(runner, out_dir, opts) if "gpu" not in skip else {"skipped": "skipped (--skip gpu)"}
    sections["gpu_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    runner.run_deferred(opts.parallel_mem)
    for zygote in runner.zygotes.values():
        zygote.close()
    sections["memory_s"] = time.perf_counter() - t0
    if result["scaling"]:
        result["scaling"]["analysis"] = scaling_analysis(result["scaling"])
    result["local"] = local
    result["derived"] = derive(local)
    result["targets"] = targets(result["derived"], result["remote"], result["scaling"]) + positions.targets(
        result["positions"])
    result["failures"] = runner.failures
    import nnsight
    import transformers

    result["meta"] = {
        "mode": mode, "quick": opts.quick, "started": started.isoformat(timespec="seconds"),
        "platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count(),
        "torch": torch.__version__, "transformers": transformers.__version__,
        "nnsight": getattr(nnsight, "__version__", None), "threads": opts.threads,
        "omp_num_threads": str(opts.threads), "repeats": opts.repeats, "warmup": opts.warmup,
        "load_before": load_before, "load_after": common.load_average(),
        "total_s": time.perf_counter() - t_start, "tl_python": opts.tl_python,
        "memory_env": MEMORY_ENV, "section_seconds": sections,
    }
    stamp = started.strftime("%Y%m%d-%H%M%S")
    json_path = out_dir / f"bench-{mode}-{stamp}.json"
    md_path = out_dir / f"bench-{mode}-{stamp}.md"
    json_path.write_text(json.dumps(result, indent=1, default=str))
    md_path.write_text(markdown(result))
    shutil.copyfile(json_path, out_dir / f"latest-{mode}.json")
    shutil.copyfile(md_path, out_dir / f"latest-{mode}.md")
    log(f"wrote {json_path} and {md_path} in {result['meta']['total_s']:.0f} s")
    missed = [t for t in result["targets"] if not t["met"]]
    log(f"targets: {len(result['targets']) - len(missed)} met, {len(missed)} missed; {len(runner.failures)} failures")
    return 1 if runner.failures and opts.quick else 0


if __name__ == "__main__":
    sys.exit(main())
