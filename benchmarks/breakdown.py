"""Where dla_recipes' time goes beyond the logits-only trace: ``python benchmarks/breakdown.py --spec SPEC --model M
--batch B``.

Times, interleaved in one process (ratios to the logits-only trace, as in ``local.py``):

- ``trace_logits``: (2), the reference;
- ``reads_<by>``: a trace that only reads, at the attributed position, the sites the recipe reads at that
  granularity (Llama: the embedding, each layer's attention output or ``o_proj`` input, MLP output or ``down_proj``
  input, the final norm's input and output, ``lm_head``'s output and the logits): nnsight's per-read cost;
- ``recipe_<by>``: the in-trace recipe (reads + arithmetic), plan and batch built once;
- ``attribute_<by>``: the public API (adds tokenizing, ``build_plan``, the self-check, labels);
- ``pullbacks_<by>``: outside any trace, the recipe's weight pullbacks for this batch (``u @ W_O`` per layer for
  heads, ``u @ W_down`` for neurons): re-reading those weights is the part of the arithmetic that scales with the
  model, not the batch;
- ``labels_<by>``, ``build_plan``, ``prepare``: the client-side pieces ``attribute`` runs every call.

And a cProfile of ``attribute`` (neuron) sorted by own time.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common

GRANULARITIES = ("block", "head", "neuron")


def reads(model, enc, rows, positions, by: str):
    import nnsight
    import torch

    n_layers = model.config.num_hidden_layers

    def run():
        with torch.no_grad():  # noqa: SIM117 - nnsight finds a trace by its own `with` line
            with model.trace(dict(enc)):
                parts = [model.layers_input[0][rows, positions].float().sum()]
                for i in range(n_layers):
                    layer = model.layers[i]
                    attn = layer.self_attn.o_proj.input if by == "head" else model.attentions_output[i]
                    mlp = layer.mlp.down_proj.input if by == "neuron" else model.mlps_output[i]
                    parts.append(attn[rows, positions].float().sum())
                    parts.append(mlp[rows, positions].float().sum())
                parts.append(model.ln_final.input[rows, positions].float().sum())
                parts.append(model.ln_final.output[rows, positions].float().sum())
                parts.append(model.lm_head.output[rows, positions].float().sum())
                parts.append(model.output.logits[rows, positions].float().sum())
                nnsight.save(torch.stack(parts).sum())
    return run


def pullbacks(model, batch: int, by: str):
    import torch

    d = torch.randn(batch, model.config.hidden_size)
    weights = [model.layers[i].self_attn.o_proj.weight if by == "head" else model.layers[i].mlp.down_proj.weight
               for i in range(model.config.num_hidden_layers)]

    def run():
        with torch.no_grad():
            for w in weights:
                d @ w.float()
    return run


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--batch", type=int, required=True)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--profile-runs", type=int, default=5)
    args = parser.parse_args(argv)
    common.offline()
    threads = common.set_threads()
    import local
    import torch

    import dla_recipes
    from dla_recipes.transport.batches import prepare

    entry = common.read_json(args.spec)["models"][args.model]
    ctx = local.Context(entry, args.batch)
    model = ctx.model
    enc = ctx.encoding()
    plan = dla_recipes.plan.build_plan(model)
    batch = prepare(model, ctx.prompts, ctx.target)
    rows = torch.arange(args.batch)
    methods = {"trace_logits": local.build_method(ctx, "trace_logits")}
    for by in GRANULARITIES:
        methods[f"reads_{by}"] = reads(model, enc, rows, batch.positions, by)
        methods[f"recipe_{by}"] = local.build_method(ctx, f"recipe_{by}")
        methods[f"attribute_{by}"] = local.build_method(ctx, f"dla_{by}")
        methods[f"labels_{by}"] = (lambda by=by: plan.labels(by))
    for by in ("head", "neuron"):
        methods[f"pullbacks_{by}"] = pullbacks(model, args.batch, by)
    methods["build_plan"] = lambda: dla_recipes.plan.build_plan(model)
    methods["prepare"] = lambda: prepare(model, ctx.prompts, ctx.target)
    timings = common.time_methods(methods, repeats=args.repeats, warmup=2, baseline="trace_logits")
    profile = cProfile.Profile()
    fn = methods["attribute_neuron"]
    profile.enable()
    for _ in range(args.profile_runs):
        fn()
    profile.disable()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(20)
    lines = [ln for ln in text.getvalue().splitlines() if ln.strip()]
    common.emit({"model": args.model, "batch": args.batch, "threads": threads, "timings": timings,
                 "profile_attribute_neuron_top": lines[:40], "n_labels": {by: len(plan.labels(by)) for by in
                                                                          GRANULARITIES}})


if __name__ == "__main__":
    main()
