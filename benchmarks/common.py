"""Helpers shared by every benchmark process: threads, timing, peak memory, JSON hand-off.

Standard library only at import time: the TransformerLens worker runs in its own venv (``.venv-tl``) without
dla_recipes or nnsight, and imports this file too.
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import random
import re
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

RESULT_MARK = "@@BENCH_RESULT@@"  # a worker prints one line "<mark><json>" on stdout; the orchestrator parses it


def set_threads(n: int | None = None) -> int:
    """Fix torch's intra-op threads to ``OMP_NUM_THREADS`` (the orchestrator sets it for every worker)."""
    n = int(n or os.environ.get("OMP_NUM_THREADS") or 1)
    os.environ["OMP_NUM_THREADS"] = str(n)
    os.environ.setdefault("MKL_NUM_THREADS", str(n))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch

    torch.set_num_threads(n)
    return n


def offline() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


# ----------------------------------------------------------------------------------------------------------------
# memory
# ----------------------------------------------------------------------------------------------------------------

def _status() -> dict[str, int]:
    text = Path("/proc/self/status").read_text()
    out = {}
    for key in ("VmRSS", "VmHWM"):
        match = re.search(rf"^{key}:\s+(\d+) kB", text, re.MULTILINE)
        out[key] = int(match.group(1)) * 1024 if match else 0
    return out


def rss_bytes() -> int:
    return _status()["VmRSS"]


def peak_rss_bytes() -> int:
    """Peak RSS since the last ``reset_peak`` (``VmHWM``), or since the process started."""
    return _status()["VmHWM"]


def ru_maxrss_bytes() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def trim() -> None:
    """Collect garbage and hand freed heap pages back to the OS, so RSS tracks live memory."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


def reset_peak() -> bool:
    """Reset the kernel's peak-RSS mark (``VmHWM``) to the current RSS (Linux >= 4.0); False if not possible."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def measure_peak(fn: Callable[[], object], warmup: int = 1) -> dict:
    """Peak RSS of one call of ``fn`` above the steady state (model loaded, ``warmup`` calls done, heap trimmed).

    Run in a process that has loaded only what ``fn`` needs. The orchestrator sets ``MALLOC_MMAP_THRESHOLD_`` and
    ``MALLOC_TRIM_THRESHOLD_`` low for these processes so that freed tensors leave the RSS and a later allocation
    cannot hide in pages an earlier call left resident.
    """
    for _ in range(warmup):
        fn()
    trim()
    loaded = rss_bytes()
    exact = reset_peak()
    t0 = time.perf_counter()
    fn()
    seconds = time.perf_counter() - t0
    peak = peak_rss_bytes() if exact else ru_maxrss_bytes()
    return {
        "rss_loaded_mb": loaded / 2**20,
        "peak_rss_mb": peak / 2**20,
        "peak_above_loaded_mb": max(0, peak - loaded) / 2**20,
        "peak_source": "VmHWM after clear_refs" if exact else "ru_maxrss (whole process)",
        "seconds_single_call": seconds,
    }


# ----------------------------------------------------------------------------------------------------------------
# timing
# ----------------------------------------------------------------------------------------------------------------

def time_methods(methods: dict[str, Callable[[], object]], repeats: int, warmup: int = 2,
                 baseline: str | None = None, seed: int = 0) -> dict[str, dict]:
    """Time every method ``repeats`` times, interleaved (one round = each method once, in a shuffled order).

    Interleaving spreads machine noise over all methods alike; ``paired_ratio`` is the median over rounds of
    ``time(method) / time(baseline)`` in the same round, the number the report uses.
    """
    for fn in methods.values():
        for _ in range(warmup):
            fn()
    samples: dict[str, list[float]] = {name: [] for name in methods}
    rng = random.Random(seed)
    names = list(methods)
    for _ in range(repeats):
        order = names[:]
        rng.shuffle(order)
        for name in order:
            t0 = time.perf_counter()
            methods[name]()
            samples[name].append(time.perf_counter() - t0)
    out = {}
    for name, values in samples.items():
        entry = {
            "median_s": statistics.median(values),
            "min_s": min(values),
            "max_s": max(values),
            "runs": len(values),
            "samples_s": values,
        }
        if baseline is not None and baseline in samples:
            ratios = [v / b for v, b in zip(values, samples[baseline])]
            entry["paired_ratio"] = statistics.median(ratios)
            entry["ratio_of_medians"] = statistics.median(values) / statistics.median(samples[baseline])
        out[name] = entry
    return out


def load_plain(folder: str | os.PathLike):
    """The plain transformers model of ``folder`` in float32, eval mode: method (1), in either venv."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def load_average() -> list[float]:
    try:
        return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]
    except OSError:
        return []


# ----------------------------------------------------------------------------------------------------------------
# hand-off
# ----------------------------------------------------------------------------------------------------------------

def emit(result: dict) -> None:
    """Print the worker's result as one marked JSON line (everything else on stdout is ignored)."""
    sys.stdout.write(RESULT_MARK + json.dumps(result) + "\n")
    sys.stdout.flush()


def read_json(path: str | os.PathLike) -> dict:
    return json.loads(Path(path).read_text())
