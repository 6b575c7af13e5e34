"""The cost of one question (issue 35): ``python benchmarks/cost.py [--quick] [--profile] [--out DIR]``.

What ``dla_recipes.attribute`` costs next to the cheapest forward pass that answers the same question, in one
process, interleaved rounds (``common.time_methods``: each round runs every method once in a shuffled order; the
number reported is the median over rounds of the per-round ratio to the floor, with a 95% bootstrap interval of
that median: ``median_interval``), ``OMP_NUM_THREADS`` fixed (default 2, ``--threads``):

- ``floor``: ``with torch.no_grad(), model.trace(ids, logits_to_keep=1): model.logits.save()``, the logits-only
  trace with the head on the last position only (what ``attribute`` itself asks of the model);
- ``logits``: the same trace with every position's logits (the logits-only trace of ``benchmarks/local.py``);
- ``reads``: the floor plus one read of every attention and MLP output at the last position (nnsight's own cost
  of the reads the recipe makes by block);
- ``least``: a by-block attribution hand-written for these Llama-shaped models (``least_by_block``: the reads,
  the final norm's scale, one dot product each; no plan, check or client), checked once against ``attribute``'s
  parts: the least an exact by-block answer costs in an nnsight trace;
- ``block`` / ``head`` / ``neuron``: ``attribute(model, prompts, target, by=...)``, the public call end to end
  (tokenizing, plan, trace, self-check, result), the same call each round: a notebook asking again about the same
  token, which takes the record of what depends only on the weights and the target (``transport.reuse``) and the
  batches prepared for the same arguments (``transport.memo``);
- ``block_new`` / ``head_new`` / ``neuron_new``: the same call taking no kept record and no kept preparation
  (``cost.no_records``), as a call about a token not asked before (the prompts tokenized, the targets resolved,
  the pull-backs through ``W_O`` / ``W_down`` made in the call).

Models: ``smollm2`` (SmolLM2-135M-Instruct, float32, 30 layers) and ``wide`` (the random Llama of
``benchmarks/spec.py``: d_model 512, d_mlp 2048, 8 layers); batch 1 and 16 prompts of 12 tokens, no padding,
target ``" Paris"`` / ``"w20"``.

``--profile``: where one call's time goes at batch 1, by function, exclusive of the functions it calls and of the
time the recipe waits for the model (nnsight's ``Mediator.value``): the recipe's own work inside the trace, the
client's around it. Functions are wrapped by name where they exist, so the same file profiles an older checkout
(copy it into that checkout's ``benchmarks/``). ``--quick``: the wide model only, 5 rounds. Writes
``cost.json`` and ``cost.md`` to ``--out`` (default ``build/cost``).
"""

from __future__ import annotations

import argparse
import collections
import functools
import importlib
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import common

GRANULARITIES = ("block", "head", "neuron")
# what --profile wraps (module: function names); a name an older checkout lacks is skipped
PROFILED = {
    "dla_recipes.api": ("attribute", "_complete"),
    "dla_recipes.transport.batches": ("prepare", "prepare_encoding", "resolve_all", "token_ids"),
    "dla_recipes.transport.run": ("run_trace",),
    "dla_recipes.transport.reuse": ("stamp",),
    "dla_recipes.transport.memo": ("key_of", "prepared"),
    "dla_recipes.result": ("assemble",),
    "dla_recipes.selfcheck": ("self_check",),
    "dla_recipes.trace.calls": ("direct_logit_attribution",),
    "dla_recipes.trace.recipe": ("decompose", "final_direction", "term_directions", "layer_scores",
                                 "rounding_scales", "joined", "largest", "worst_pattern", "activations_dtype"),
    "dla_recipes.trace.terms": ("read_term", "score_term", "write_direction", "finished", "projected", "at",
                                "read_site", "kind_module"),
    "dla_recipes.trace.kinds.linear": ("read", "score", "static", "pull_back", "at", "read_site"),
    "dla_recipes.trace.targets": ("pick", "vocab_mean", "read_logits", "head_error", "logit_size"),
    "dla_recipes.trace.sparse": ("wired", "dense"),
}


class no_records:
    """Within it, ``attribute`` takes no record an earlier call left and keeps none, and prepares its batches anew,
    as a call about a token not asked before; what is kept for the other calls stays. A checkout with
    ``dla_recipes.question`` asks for it per call (``options()``: ``fast=Fast(reuse=False, memo=False)``); an older
    one has the module switches ``transport.reuse.REUSE`` and ``transport.memo.MEMO``, set here."""

    SWITCHES = (("dla_recipes.transport.reuse", "REUSE"), ("dla_recipes.transport.memo", "MEMO"))

    @staticmethod
    def options() -> dict:
        """The keyword options of a call that takes no record (empty on a checkout of the module switches)."""
        try:
            from dla_recipes.question import Fast
        except ImportError:
            return {}
        return {"fast": Fast(reuse=False, memo=False)}

    def __enter__(self):
        self.before = []
        for name, flag in self.SWITCHES:
            try:
                module = importlib.import_module(name)
            except ImportError:
                continue
            if hasattr(module, flag):
                self.before.append((module, flag, getattr(module, flag)))
                setattr(module, flag, False)
        return self

    def __exit__(self, *exc):
        for module, flag, value in self.before:
            setattr(module, flag, value)


def methods_for(model, prompts: list[str], ids, target: str, target_id: int) -> dict:
    import nnsight
    import torch

    import dla_recipes

    encoding = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    layers = len(model.layers)

    def trace(keep: bool):
        kw = {"logits_to_keep": 1} if keep else {}

        def run():
            with torch.no_grad():  # noqa: SIM117 - nnsight reads the trace body from its own `with` line
                with model.trace(dict(encoding), **kw):
                    model.logits.save()
        return run

    def reads():
        with torch.no_grad():  # noqa: SIM117
            with model.trace(dict(encoding), logits_to_keep=1):
                for i in range(layers):
                    nnsight.save(model.layers[i].self_attn.output[0][:, -1].sum())
                    nnsight.save(model.layers[i].mlp.output[:, -1].sum())
                model.logits.save()

    def call(by: str, new: bool):
        def run():
            if not new:
                return dla_recipes.attribute(model, prompts, target, by=by)
            with no_records():
                return dla_recipes.attribute(model, prompts, target, by=by, **no_records.options())
        return run

    out = {"floor": trace(True), "logits": trace(False), "reads": reads,
           "least": least_by_block(model, encoding, target_id)}
    for by in GRANULARITIES:
        out[by] = call(by, False)
        out[f"{by}_new"] = call(by, True)
    return out


def least_by_block(model, encoding: dict, target_id: int):
    """The least an exact by-block attribution of ``target_id``'s logit at the last position does in an nnsight 0.8
    trace, hand-written for the benchmark's Llama-shaped models (RMSNorm final norm, no logit scale): read the
    embedding and every attention and MLP output there (each copied, as a later in-place edit could reach it), read
    the final norm's input, freeze its scale, and take each write's dot product with the head direction ``gain *
    W_U[target] * scale``: ``[batch, 1 + 2 * layers]`` parts summing to the logit. No plan, no check, no client:
    the gap between this and ``block`` is what the library's generality and its self-check cost."""
    import nnsight
    import torch

    layers, eps = len(model.layers), model.config.rms_norm_eps
    head = model.lm_head._module.weight[target_id].detach().float() * model.ln_final._module.weight.detach().float()

    def run():
        with torch.no_grad():  # noqa: SIM117 - nnsight reads the trace body from its own `with` line
            with model.trace(dict(encoding), logits_to_keep=1):
                writes = [model.embed_tokens.output[:, -1].clone()]
                for i in range(layers):
                    writes.append(model.layers[i].self_attn.output[0][:, -1].clone())
                    writes.append(model.layers[i].mlp.output[:, -1].clone())
                stream = model.ln_final.input[:, -1].float()
                direction = head * torch.rsqrt(stream.pow(2).mean(-1, keepdim=True) + eps)
                parts = nnsight.save((torch.stack(writes, 1).float() * direction[:, None]).sum(-1))
                logits = model.logits.save()
        return parts, logits[:, -1, target_id]
    return run


def check_least(model, prompts: list[str], target: str, least) -> None:
    """``least_by_block``'s parts against ``attribute``'s by block (embedding, then each block's attention and MLP)
    and their sum against the model's own logit, once before timing. A wrong read is off by a whole part; float32
    reorderings of one ``d_model``-wide dot product, or of the 17-25 parts' sum, by ~1e-6 of the largest part
    (``u = 2^-24`` times the terms' count and size): 1e-3 of it separates the two."""
    import dla_recipes

    parts, logit = least()
    attribution = dla_recipes.attribute(model, prompts, target, by="block")
    values = attribution.values.float()
    scale = max(1.0, float(values.abs().max()))
    gap = float((parts - values).abs().max()) if parts.shape == values.shape else float("inf")
    gap = max(gap, float((parts.sum(-1) - logit).abs().max()))  # and their sum against the model's own logit
    if gap > 1e-3 * scale:
        raise AssertionError(f"least_by_block reads other parts than attribute: {tuple(parts.shape)} vs "
                             f"{tuple(values.shape)} ({attribution.labels[:3]}...), largest gap {gap:.3g}")


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def time_methods(methods: dict, rounds: int, clock) -> dict:
    """``common.time_methods`` with a choice of clock: ``cpu`` (the process's CPU time: on a shared virtual machine
    the time its processor was taken away is not counted, so ratios are steadier) or ``wall``; baseline ``floor``."""
    import random
    import statistics

    for fn in methods.values():
        for _ in range(2):
            fn()
    samples: dict = {name: [] for name in methods}
    rng, names = random.Random(0), list(methods)
    for _ in range(rounds):
        rng.shuffle(names)
        for name in names:
            start = clock()
            methods[name]()
            samples[name].append(clock() - start)
    out = {}
    for name, values in samples.items():
        ratios = [v / b for v, b in zip(values, samples["floor"])]
        out[name] = {"median_s": statistics.median(values), "min_s": min(values), "runs": len(values),
                     "samples_s": values, "paired_ratio": statistics.median(ratios),
                     "ratio_ci95": median_interval(ratios),
                     "ratio_of_medians": statistics.median(values) / statistics.median(samples["floor"])}
    return out


def median_interval(values: list, resamples: int = 1000, seed: int = 0) -> tuple[float, float]:
    """A 95% bootstrap interval of the median of ``values`` (the per-round ratios): how far the number reported
    could move in another run of the same rounds on the same machine (percentiles of ``resamples`` medians of
    resampled rounds, seeded)."""
    import random
    import statistics

    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(resamples))
    return medians[int(0.025 * resamples)], medians[int(0.975 * resamples) - 1]


class Profile:
    """Exclusive wall time per wrapped function, less the time the recipe waits for the model (``Mediator.value``)."""

    def __init__(self):
        self.stack: list = []
        self.time: collections.Counter = collections.Counter()
        self.calls: collections.Counter = collections.Counter()
        self.undo: list = []

    def enter(self, name: str) -> None:
        self.stack.append([name, time.perf_counter(), 0.0])

    def leave(self) -> None:
        name, start, inner = self.stack.pop()
        spent = time.perf_counter() - start
        self.time[name] += spent - inner
        self.calls[name] += 1
        if self.stack:
            self.stack[-1][2] += spent

    def wrap(self, owner, name: str, label: str, kind: str = "function") -> None:
        original = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
        function = original.__func__ if kind == "classmethod" else original

        @functools.wraps(function)
        def timed(*args, **kwargs):
            self.enter(label)
            try:
                return function(*args, **kwargs)
            finally:
                self.leave()
        setattr(owner, name, classmethod(timed) if kind == "classmethod" else timed)
        self.undo.append((owner, name, original))

    def install(self) -> None:
        from nnsight.intervention import interleaver

        self.wrap(interleaver.Mediator, "value", "(waiting for the model)", "classmethod")
        for module_name, names in PROFILED.items():
            try:
                module = importlib.import_module(module_name)
            except ImportError:
                continue
            for name in names:
                if callable(getattr(module, name, None)):
                    self.wrap(module, name, f"{module_name.removeprefix('dla_recipes.')}.{name}")
        # every module that imported a wrapped function by name calls it through its own global: rebind those
        wrapped = {(m, n): getattr(importlib.import_module(m), n) for m, names in PROFILED.items()
                   for n in names if _exists(m, n)}
        for module in list(sys.modules.values()):
            if getattr(module, "__name__", "").startswith("dla_recipes"):
                for (m, n), fn in wrapped.items():
                    if module.__name__ != m and getattr(module, n, None) is getattr(fn, "__wrapped__", None):
                        setattr(module, n, fn)
                        self.undo.append((module, n, fn.__wrapped__))

    def remove(self) -> None:
        for owner, name, original in reversed(self.undo):
            setattr(owner, name, original)
        self.undo.clear()


def _exists(module_name: str, name: str) -> bool:
    try:
        return callable(getattr(importlib.import_module(module_name), name, None))
    except ImportError:
        return False


def profile(model, prompts, target, rounds: int, top: int) -> dict:
    import dla_recipes

    out = {}
    for by in GRANULARITIES:
        for new in (False, True):
            name = f"{by}_new" if new else by
            for _ in range(2):
                dla_recipes.attribute(model, prompts, target, by=by)
            prof = Profile()
            prof.install()
            try:
                start = time.perf_counter()
                for _ in range(rounds):
                    if new:
                        with no_records():
                            dla_recipes.attribute(model, prompts, target, by=by, **no_records.options())
                    else:
                        dla_recipes.attribute(model, prompts, target, by=by)
                total = (time.perf_counter() - start) / rounds
            finally:
                prof.remove()
            waited = prof.time.pop("(waiting for the model)", 0.0) / rounds
            rows = [(k, v / rounds * 1e3, prof.calls[k] // rounds) for k, v in prof.time.most_common(top)]
            out[name] = {"total_ms": total * 1e3, "waiting_ms": waited * 1e3,
                         "own_ms": sum(v for v in prof.time.values()) / rounds * 1e3, "top": rows}
    return out


def machine() -> dict:
    """The processor, Python and torch this ran on (ratios are compared on one machine only)."""
    import platform

    import torch

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else ""
    return {"cpu": cpu, "python": platform.python_version(), "torch": torch.__version__,
            "load_average": common.load_average()}


def run(args) -> dict:
    common.offline()
    threads = common.set_threads(args.threads)
    import spec as spec_module
    import torch

    import dla_recipes

    out_dir = Path(args.out)
    models = ["wide"] if args.quick else ["smollm2", "wide"]
    models = args.models or models
    spec = common.read_json(spec_module.write_spec(out_dir, models, [1, 16], quick=args.quick))
    result = {"threads": threads, "rounds": args.rounds, "clock": args.clock, "models": {}, "machine": machine()}
    for key in models:
        entry = spec["models"][key]
        model = dla_recipes.load(entry["folder"], dtype=torch.float32, device_map="cpu")
        model.dispatch()
        result["models"][key] = {"description": entry["description"], "batches": {}}
        for batch in args.batches:
            prompts = entry["prompts"][:batch]
            ids = torch.tensor(entry["input_ids"][:batch])
            methods = methods_for(model, prompts, ids, entry["target"], entry["target_id"])
            check_least(model, prompts, entry["target"], methods["least"])
            timings = time_methods(methods, args.rounds, CLOCKS[args.clock])
            logits = timings["logits"]["samples_s"]
            for entry_t in timings.values():
                ratios = [v / b for v, b in zip(entry_t["samples_s"], logits)]
                entry_t["ratio_to_logits"] = sorted(ratios)[len(ratios) // 2]
            result["models"][key]["batches"][batch] = {
                name: {k: v for k, v in t.items() if k != "samples_s"} for name, t in timings.items()}
            print(f"{key} b{batch}: " + ", ".join(f"{n} {t['paired_ratio']:.3f} [{t['ratio_ci95'][0]:.3f}, "
                                                   f"{t['ratio_ci95'][1]:.3f}]" for n, t in timings.items()),
                  flush=True)
        if args.profile:
            prompts = entry["prompts"][:1]
            result["models"][key]["profile"] = profile(model, prompts, entry["target"], args.profile_rounds, args.top)
        del model
        common.trim()
    return result


def markdown(result: dict) -> str:
    lines = [(f"# The cost of one question (benchmarks/cost.py, OMP_NUM_THREADS={result['threads']}, "
             f"{result['rounds']} interleaved rounds, {result['machine']['cpu']})"), "",
             ("Median per-round ratio to the floor (the logits-only trace with `logits_to_keep=1`), in square brackets "
             "its 95% bootstrap interval over the rounds; in parentheses the ratio to the logits-only trace with "
             "every position's logits."), ""]
    names = ("reads", "least", "block", "head", "neuron", "block_new", "head_new", "neuron_new", "logits")
    lines.append("| model | batch | floor ms | " + " | ".join(names) + " |")
    lines.append("|---|---|---|" + "---|" * len(names))
    for key, model in result["models"].items():
        for batch, timings in model["batches"].items():
            cells = [f"{timings[n]['paired_ratio']:.3f} [{timings[n]['ratio_ci95'][0]:.3f}, "
                     f"{timings[n]['ratio_ci95'][1]:.3f}] ({timings[n]['ratio_to_logits']:.2f})" for n in names]
            lines.append(f"| {key} | {batch} | {timings['floor']['median_s'] * 1e3:.1f} | " + " | ".join(cells) + " |")
    for key, model in result["models"].items():
        for name, prof in model.get("profile", {}).items():
            lines += ["", (f"## {key}, batch 1, `{name}`: {prof['total_ms']:.2f} ms a call, "
                      f"{prof['waiting_ms']:.2f} ms waiting for the model, {prof['own_ms']:.2f} ms in the functions "
                      "below (exclusive)"), "", "| function | ms a call | calls |", "|---|---|---|"]
            lines += [f"| `{f}` | {ms:.3f} | {n} |" for f, ms, n in prof["top"]]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--out", default="build/cost")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds (default 31; quick 5)")
    parser.add_argument("--profile-rounds", type=int, default=20)
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall")
    parser.add_argument("--batches", type=lambda text: [int(b) for b in text.split(",")], default=[1, 16])
    parser.add_argument("--models", type=lambda text: text.split(","), default=None, help="smollm2,wide")
    args = parser.parse_args(argv)
    args.rounds = args.rounds or (5 if args.quick else 31)
    result = run(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "cost.json").write_text(json.dumps(result, indent=1))
    text = markdown(result)
    (out / "cost.md").write_text(text)
    print(text)
    common.emit(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
