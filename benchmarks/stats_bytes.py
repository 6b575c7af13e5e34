"""Remote bytes of a dataset's statistics (issue 20): ``python benchmarks/stats_bytes.py [--sizes 1000,10000]``.

A tiny random Llama served by the loopback NDIF server (``dla_recipes.testing.loopback``: nnsight's real remote
protocol, the ``ndif`` package's execution code, a single-threaded server process); ``attribute(..., by="head",
remote=True, batch_size=B)`` on ``n`` word-id prompts with ``reduce="stats"`` (the statistics reduced in the trace,
merged across a session's batches server side) and with ``reduce=None`` (every prompt's row comes back). Reported:
the requests sent, the bytes the client downloaded (the server's ``result_bytes``, summed over the requests) and
per prompt. The target: the statistics' bytes flat in the number of prompts. Numbers are reported, never asserted.
"""

from __future__ import annotations

import argparse
import os
import secrets
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # this checkout's dla_recipes

import dataset_stream  # benchmarks/dataset_stream.py: the same prompts as the dataset benchmark


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1000,10000")
    parser.add_argument("--batch", type=int, default=500)
    args = parser.parse_args()
    import dla_recipes
    from dla_recipes.testing import tiny
    from dla_recipes.testing.loopback import LoopbackServer

    sizes = [int(s) for s in args.sizes.split(",")]
    with tempfile.TemporaryDirectory() as root:
        folder = Path(root) / "llama"
        tiny.build("llama").save_pretrained(folder)
        tiny.tokenizer().save_pretrained(folder)
        with LoopbackServer({"llama": str(folder)}, api_key=secrets.token_hex(16)) as server:
            model = server.remote_model("llama")
            with server.client():  # the first request ships the package: not recorded
                dla_recipes.attribute(model, "w5 w6 w7", "w20", remote=True)
            print("| prompts | reduce | requests | bytes back | bytes per prompt | seconds |")
            print("|---:|---|---:|---:|---:|---:|")
            for n in sizes:
                data = list(dataset_stream.rows("tiny", n))
                prompts, targets = [r["prompt"] for r in data], [r["target"] for r in data]
                for reduce in ("stats", None):
                    server.clear_stats()
                    start = time.perf_counter()
                    with server.client():
                        dla_recipes.attribute(model, prompts, targets, by="head", remote=True,
                                              batch_size=args.batch, reduce=reduce, progress=False)
                    seconds = time.perf_counter() - start
                    done = [s for s in server.stats() if s.get("status") == "COMPLETED"]
                    back = sum(int(s["result_bytes"]) for s in done)
                    print(f"| {n:,} | {reduce} | {len(done)} | {back:,} | {back / n:,.1f} | {seconds:.1f} |",
                          flush=True)


if __name__ == "__main__":
    main()
