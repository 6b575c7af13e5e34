"""Where one batch-1 call's time goes, step by step (issue 35): ``python benchmarks/stages.py [--model wide]
[--by block] [--rounds 100] [--out DIR]``.

``cost.py --profile`` sums each function's own time over a call; this reads one call as a timeline. Each function
named in ``STEPS`` (where the checkout has it) records the wall clock when it is entered and when it returns; the
rows are the intervals between consecutive marks, so a row is either one function's own work (``fit``) or what ran
between two of them (``decompose -> at``: nnsight's reads and the rest of the model's forward pass in between). A
function called once per block (``Lane.read``) is one span, from its first call to its last return: the blocks'
forward pass with the reads in it. Each row's minimum over ``--rounds`` runs, its 25th percentile and its median,
in microseconds; the minimum is the steadiest estimate of a fixed cost on a shared machine.

Two timelines, ``OMP_NUM_THREADS=1``:

- **in the trace**: the batch and the in-trace call of one ``attribute`` call (``transport.run.run_trace``'s
  arguments), run again alone in a trace (no client), the record of the first call taken as ``attribute`` takes it;
- **the client**: whole ``attribute`` calls, the trace one row (``run_trace``), the weights' stamp and the
  self-check rows of their own.

Writes ``stages.json`` and ``stages.md`` to ``--out`` (default ``build/stages``).
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import json
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import common

# (module, owner or None, name, kind): the functions whose entry and return are marked, looked up where the caller
# finds them (a name imported into trace.recipe is wrapped there)
STEPS = [
    ("dla_recipes.trace.calls", "LogitCall", "run", "method"),
    ("dla_recipes.trace.recipe", None, "low_precision", "function"),
    ("dla_recipes.trace.recipe", None, "decompose", "function"),
    ("dla_recipes.trace.recipe", None, "layer_input", "function"),
    ("dla_recipes.trace.recipe", None, "at", "function"),
    ("dla_recipes.trace.readers", "Sites", "on", "classmethod"),
    ("dla_recipes.trace.plain", None, "lane", "function"),
    ("dla_recipes.trace.plain", "Lane", "read", "method"),
    ("dla_recipes.trace.plain", "Lane", "score", "method"),
    ("dla_recipes.trace.recipe", None, "joined", "function"),
    ("dla_recipes.math.frozen_norm", "NormProbe", "fit", "method"),
    ("dla_recipes.trace.targets", None, "pick", "function"),
    ("dla_recipes.trace.targets", None, "logit_size", "function"),
    ("dla_recipes.trace.recipe", None, "activations_dtype", "function"),
    ("dla_recipes.trace.recipe", None, "rounding_scales", "function"),
    ("dla_recipes.trace.recipe", None, "largest", "function"),
    ("dla_recipes.trace.readout", "Readout", "gathered", "classmethod"),
]
CLIENT = [
    ("dla_recipes.transport.reuse", None, "stamp", "function"),
    ("dla_recipes.transport.run", None, "run_trace", "function"),
    ("dla_recipes.result", None, "self_check", "function"),
]


class Marks:
    """The wall-clock marks of the wrapped functions (``(label, ">" or "<", time)``), and how to undo the wraps."""

    def __init__(self):
        self.marks: list = []
        self.undo: list = []

    def wrap(self, module_name: str, owner_name: str | None, name: str, kind: str) -> None:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            return
        owner = getattr(module, owner_name, None) if owner_name else module
        if owner is None or name not in (owner.__dict__ if isinstance(owner, type) else vars(owner)):
            return
        original = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
        function = original.__func__ if kind == "classmethod" else original
        label, marks, clock = f"{owner_name + '.' if owner_name else ''}{name}", self.marks, time.perf_counter

        def marked(*args, **kwargs):
            marks.append((label, ">", clock()))
            try:
                return function(*args, **kwargs)
            finally:
                marks.append((label, "<", clock()))
        setattr(owner, name, classmethod(marked) if kind == "classmethod" else marked)
        self.undo.append((owner, name, original))

    def remove(self) -> None:
        for owner, name, original in reversed(self.undo):
            setattr(owner, name, original)
        self.undo.clear()

    def steps(self) -> list[tuple[str, float]]:
        """The intervals between consecutive marks of one run, a repeated function's calls merged into one span."""
        merged: list = []
        for label, side, at in self.marks:
            if side == ">" and merged and merged[-1][:2] == (label, "<"):  # entered again straight after returning
                merged.pop()  # one span: its first entry to its last return
                continue
            merged.append((label, side, at))
        return [(f"{a[0]}{a[1]} -> {b[0]}{b[1]}", b[2] - a[2]) for a, b in itertools.pairwise(merged)]


def timeline(run, marks: Marks, rounds: int) -> list[dict]:
    """Each step's min, 25th percentile and median over ``rounds`` runs of ``run`` (microseconds), in order."""
    rows: dict = {}
    for _ in range(rounds):
        marks.marks.clear()
        marks.marks.append(("start", "", time.perf_counter()))
        run()
        marks.marks.append(("end", "", time.perf_counter()))
        for name, spent in marks.steps():
            rows.setdefault(name, []).append(spent)
    out = []
    for name, values in rows.items():
        if len(values) < rounds:  # a step not in every run (a different path): not comparable
            continue
        values.sort()
        out.append({"step": name, "min_us": values[0] * 1e6, "p25_us": values[len(values) // 4] * 1e6,
                    "median_us": statistics.median(values) * 1e6})
    return out


def capture(model, prompts, target: str, by: str):
    """``run_trace``'s arguments in one ``attribute`` call (the second: the record of the first is taken)."""
    import dla_recipes
    from dla_recipes.transport import run as run_module

    seen: list = []
    original = run_module.run_trace

    def spy(*args, **kwargs):
        seen.append(args)
        return original(*args, **kwargs)
    run_module.run_trace = spy
    try:
        dla_recipes.attribute(model, prompts, target, by=by)
        dla_recipes.attribute(model, prompts, target, by=by)
    finally:
        run_module.run_trace = original
    return original, seen[-1]


def run(args) -> dict:
    common.offline()
    common.set_threads(1)
    import spec as spec_module
    import torch

    import dla_recipes

    out_dir = Path(args.out)
    spec = common.read_json(spec_module.write_spec(out_dir, [args.model], [1], quick=False))
    entry = spec["models"][args.model]
    model = dla_recipes.load(entry["folder"], dtype=torch.float32, device_map="cpu")
    model.dispatch()
    prompts = entry["prompts"][:1]
    run_trace, arguments = capture(model, prompts, entry["target"], args.by)
    result = {"model": args.model, "by": args.by, "rounds": args.rounds, "threads": 1}
    for name, steps, call in (
            ("trace", STEPS, lambda: run_trace(*arguments[:4])),
            ("client", CLIENT, lambda: dla_recipes.attribute(model, prompts, entry["target"], by=args.by))):
        for _ in range(3):
            call()
        marks = Marks()
        for step in steps:
            marks.wrap(*step)
        try:
            result[name] = timeline(call, marks, args.rounds)
        finally:
            marks.remove()
    return result


def markdown(result: dict) -> str:
    lines = [(f"# One batch-1 call, step by step ({result['model']}, by={result['by']!r}, {result['rounds']} runs, "
              "OMP_NUM_THREADS=1; microseconds)")]
    for name, title in (("trace", "In the trace (the batch's in-trace call alone, no client)"),
                        ("client", "The whole call")):
        lines += ["", f"## {title}", "", "| step | min | p25 | median |", "|---|---:|---:|---:|"]
        lines += [f"| `{row['step']}` | {row['min_us']:.1f} | {row['p25_us']:.1f} | {row['median_us']:.1f} |"
                  for row in result[name]]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="wide", help="wide or smollm2")
    parser.add_argument("--by", default="block", choices=("block", "head", "neuron"))
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--out", default="build/stages")
    args = parser.parse_args(argv)
    result = run(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "stages.json").write_text(json.dumps(result, indent=1))
    text = markdown(result)
    (out / "stages.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
