"""A dataset streamed (issue 20): ``python benchmarks/dataset_stream.py [--tiny 1000,10000] [--smollm2 100,1000] ...``.

``attribute_dataset(model, rows, out=DIR)`` over a generator of rows (nothing holds the whole dataset): a tiny
random Llama by block (default 1,000 and 10,000 prompts) and SmolLM2-135M by head on IOI-style prompts (default
100 and 1,000), each streamed to a Parquet directory (``reduce=None``) and reduced to statistics
(``reduce="stats"``). Each (model, size, mode) runs in its own process (``one``): the model loaded and one small
warm-up run done, the heap trimmed, the peak-RSS mark reset (``common.reset_peak``), then the whole run timed.
Reported: prompts per second, the peak RSS above the loaded model (flat in the number of prompts is the target:
only one chunk is held at a time) and the bytes written. Numbers are reported, never asserted.

    OMP_NUM_THREADS=1 python benchmarks/dataset_stream.py --tiny 200,2000 --smollm2 32,64 --batch 32
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # this checkout's dla_recipes

import common

NAMES = (" Mary", " John", " Alice", " Bob", " Sarah", " Tom", " Emma", " James")
PLACES = ("store", "park", "school", "office", "beach", "library")


def rows(model_key: str, n: int, offset: int = 0):
    """``n`` rows as a generator: IOI-style prompts (target the indirect object, contrast the subject) for SmolLM2,
    word-id prompts of 6 to 13 tokens with a target column for the tiny model."""
    for i in range(offset, offset + n):
        if model_key == "smollm2":
            a, b = NAMES[i % len(NAMES)], NAMES[(i // len(NAMES) + 1 + i) % len(NAMES)]
            if a == b:
                b = NAMES[(NAMES.index(a) + 1) % len(NAMES)]
            place = PLACES[i % len(PLACES)]
            yield {"prompt": f"When{a} and{b} went to the {place},{b} gave a drink to", "target": a, "contrast": b}
        else:
            length = 6 + i % 8
            yield {"prompt": " ".join(f"w{5 + (7 * i + 3 * j) % 100}" for j in range(length)),
                   "target": f"w{20 + i % 9}", "contrast": "w40"}


def load(model_key: str):
    import dla_recipes

    if model_key == "smollm2":
        from dla_recipes import models

        return dla_recipes.load(models.default_model_path()), "head"
    from dla_recipes.testing import tiny

    return tiny.standardized("llama"), "block"


def one(model_key: str, n: int, mode: str, batch: int) -> dict:
    """One run in this process (see the module docstring)."""
    common.set_threads()
    common.offline()
    import dla_recipes

    model, by = load(model_key)
    reduce = "stats" if mode == "stats" else None
    work = Path(tempfile.mkdtemp(prefix="dla-datasets-"))

    def go(count: int, out: Path):
        return dla_recipes.attribute_dataset(model, rows(model_key, count), contrast="contrast", by=by,
                                             reduce=reduce, out=out, batch_size=batch, progress=False)

    go(2 * batch, work / "warmup")  # the plan built, the first traces compiled
    common.trim()
    loaded = common.rss_bytes()
    exact = common.reset_peak()
    t0 = time.perf_counter()
    go(n, work / "run")
    seconds = time.perf_counter() - t0
    peak = common.peak_rss_bytes() if exact else common.ru_maxrss_bytes()
    written = sum(f.stat().st_size for f in (work / "run").iterdir())
    return {"model": model_key, "by": by, "n": n, "mode": mode, "batch": batch, "seconds": seconds,
            "prompts_per_s": n / seconds, "rss_loaded_mb": loaded / 2**20,
            "peak_above_loaded_mb": max(0, peak - loaded) / 2**20, "bytes_written": written,
            "peak_source": "VmHWM after clear_refs" if exact else "ru_maxrss"}


def spawn(model_key: str, n: int, mode: str, batch: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           "MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}
    command = [sys.executable, __file__, "one", model_key, str(n), mode, str(batch)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    for line in done.stdout.splitlines():
        if line.startswith(common.RESULT_MARK):
            return json.loads(line[len(common.RESULT_MARK):])
    raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")


def markdown(results: list[dict]) -> str:
    lines = ["| model | by | mode | prompts | batch | seconds | prompts/s | peak RSS above loaded (MB) | written (KB) |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        lines.append(f"| {r['model']} | {r['by']} | {r['mode']} | {r['n']} | {r['batch']} | {r['seconds']:.1f} | "
                     f"{r['prompts_per_s']:.0f} | {r['peak_above_loaded_mb']:.1f} | {r['bytes_written'] / 1024:.0f} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", default="1000,10000", help="prompt counts on the tiny model ('' for none)")
    parser.add_argument("--smollm2", default="100,1000", help="prompt counts on SmolLM2 by head ('' for none)")
    parser.add_argument("--modes", default="parquet,stats")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--out", help="write the results as JSON and markdown here")
    args = parser.parse_args(argv)
    results = []
    for key, sizes in (("tiny", args.tiny), ("smollm2", args.smollm2)):
        for n in [int(s) for s in sizes.split(",") if s]:
            for mode in args.modes.split(","):
                results.append(spawn(key, n, mode, args.batch))
                print(json.dumps(results[-1]), flush=True)
    table = markdown(results)
    print(table)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "datasets.json").write_text(json.dumps(results, indent=1))
        (Path(args.out) / "datasets.md").write_text(table + "\n")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "one":
        common.emit(one(sys.argv[2], int(sys.argv[3]), sys.argv[4], int(sys.argv[5])))
    else:
        main()
