"""The device-side profile ``gpu_llama8b.py --profile / --sync-check`` records (issue 23): where one call's GPU time
goes and where it makes the host wait.

- ``profile(calls, cuda)``: each call once (after a warm-up call) under ``torch.profiler`` with CPU and, when
  ``cuda``, CUDA activities; the top ``TOP`` ops by self CUDA time and by self CPU time, and the counts of the CUDA
  runtime calls that launch kernels, copy and synchronise (``cudaLaunchKernel``, ``cudaMemcpyAsync``,
  ``cudaStreamSynchronize``, ...).
- ``sync_check(calls)``: each call once under ``torch.cuda.set_sync_debug_mode("warn")``, every warning captured:
  how many synchronising operations it made and where (the warning's ``file:line`` and text).

``calls`` maps a name (``dla_block``) to a function running one call.
"""

from __future__ import annotations

import collections
import warnings

TOP = 15
RUNTIME_CALLS = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cudaMemcpyAsync", "cudaMemsetAsync",
                 "cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")


def _row(event) -> dict:
    device = getattr(event, "self_device_time_total", None)
    if device is None:
        device = getattr(event, "self_cuda_time_total", 0.0)
    return {"op": event.key, "count": event.count, "self_cuda_us": float(device or 0.0),
            "self_cpu_us": float(event.self_cpu_time_total)}


def profile(calls: dict, cuda: bool, sync=lambda: None) -> dict:
    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    out = {"activities": [a.name for a in activities],
           "skipped": None if cuda else "CUDA activity (no CUDA device): CPU ops only"}
    for name, fn in calls.items():
        fn()  # warm-up: the plan, the frozen norms' probes and the allocator's first blocks are not the call's cost
        sync()
        with torch.no_grad(), torch_profile(activities=activities) as prof:
            fn()
            sync()
        rows = [_row(e) for e in prof.key_averages()]
        runtime = {r["op"]: r["count"] for r in rows if r["op"] in RUNTIME_CALLS}
        aten = [r for r in rows if r["op"].startswith("aten::")]
        out[name] = {
            "top_self_cuda": sorted(rows, key=lambda r: -r["self_cuda_us"])[:TOP] if cuda else [],
            "top_self_cpu": sorted(rows, key=lambda r: -r["self_cpu_us"])[:TOP],
            "runtime_calls": runtime,
            "total_self_cuda_ms": sum(r["self_cuda_us"] for r in rows) / 1e3,
            "total_self_cpu_ms": sum(r["self_cpu_us"] for r in rows) / 1e3,
            "aten_events": sum(r["count"] for r in aten),  # nested ones too (linear -> mm)
        }
    return out


def sync_check(calls: dict, cuda: bool) -> dict:
    if not cuda:
        return {"skipped": "torch.cuda.set_sync_debug_mode needs a CUDA device"}
    import torch

    out = {}
    for name, fn in calls.items():
        fn()  # warm-up (first-call work is not what a call costs)
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                fn()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        synced = [w for w in caught if "synchroniz" in str(w.message).lower()]
        where = collections.Counter(f"{w.filename}:{w.lineno}" for w in synced)
        out[name] = {"syncs": len(synced), "by_site": dict(where.most_common()),
                     "messages": sorted({str(w.message).splitlines()[0] for w in synced})[:10],
                     "other_warnings": len(caught) - len(synced)}
    return out


def summary(record: dict) -> list[str]:
    """Lines to print: per call, the sync count and the top 5 ops by self CUDA (else CPU) time."""
    lines = []
    for name, entry in (record.get("profile") or {}).items():
        if not isinstance(entry, dict):
            continue
        top = entry["top_self_cuda"] or entry["top_self_cpu"]
        key = "self_cuda_us" if entry["top_self_cuda"] else "self_cpu_us"
        lines.append(f"profile {name}: {entry['aten_events']} aten events (nested ones too), runtime "
                     f"{entry['runtime_calls']}; top: "
                     + ", ".join(f"{r['op']} {r[key] / 1e3:.2f} ms" for r in top[:5]))
    for name, entry in (record.get("sync_check") or {}).items():
        if isinstance(entry, dict):
            lines.append(f"sync-check {name}: {entry['syncs']} syncs at {entry['by_site']}")
        else:
            lines.append(f"sync-check: {entry}")
    return lines
