"""Local methods (project venv) and their worker: ``python benchmarks/local.py time|mem ...``.

Methods (each a no-argument callable that returns ``(max_error or None)``):

====================  ==================================================================================================
``plain_forward``     (1) the plain transformers model (``AutoModelForCausalLM``, no nnsight), ``torch.no_grad``: the floor
``trace_logits``      (2) ``with torch.no_grad(), model.trace(encoding): model.logits.save()``: the reference every
                      ratio divides by (``trace_logits_grad``: the same without ``no_grad``, nnsight's default, which
                      keeps the autograd graph's activations: more time and memory)
``dla_block`` ...     (3) ``dla_recipes.attribute(model, prompts, target, by=...)``: the public API, end to end (it
                      runs the head on the attributed positions only: ``logits_to_keep``)
``recipe_block`` ...  the in-trace recipe alone: ``direct_logit_attribution`` in one plain trace (every position
                      through ``lm_head``), plan and batch built once (no tokenizing, plan building or self-check)
``save_all_block``..  (4) the save-everything recipe: save every layer's attention and MLP output (head: every
                      ``o_proj`` input; neuron: every ``down_proj`` input) ``[batch, pos, width]`` in the trace and
                      compute the attribution after it (under ``torch.no_grad``, as (1) and (2))
``plain_forward_keep1`` / ``trace_logits_keep1``: (1) and (2) with ``logits_to_keep=1``
====================  ==================================================================================================
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common

GRANULARITIES = ("block", "head", "neuron")
CORE = ["plain_forward", "trace_logits", "dla_block", "dla_head", "dla_neuron",
        "save_all_block", "save_all_head", "save_all_neuron"]
EXTRA = ["recipe_block", "recipe_head", "recipe_neuron", "plain_forward_keep1", "trace_logits_keep1",
         "trace_logits_grad"]
ALL_METHODS = CORE + EXTRA


# ----------------------------------------------------------------------------------------------------------------
# loading
# ----------------------------------------------------------------------------------------------------------------

def load_standardized(folder: str):
    import torch

    import dla_recipes

    model = dla_recipes.load(folder, dtype=torch.float32, device_map="cpu")
    model.dispatch()
    return model


class Context:
    """What a set of methods needs, loaded lazily: the nnterp model, the plain model, the encoding."""

    def __init__(self, entry: dict, batch: int):
        self.entry, self.batch = entry, batch
        self.prompts = entry["prompts"][:batch]
        self.target = entry["target"]
        self._model = self._plain = None

    @property
    def model(self):
        if self._model is None:
            self._model = load_standardized(self.entry["folder"])
        return self._model

    @property
    def plain(self):
        if self._plain is None:
            self._plain = common.load_plain(self.entry["folder"])
        return self._plain

    def encoding(self) -> dict:
        import torch

        ids = torch.tensor(self.entry["input_ids"][: self.batch])
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


# ----------------------------------------------------------------------------------------------------------------
# the save-everything recipe (Llama family: RMSNorm final norm, no biases), as a user of a naive recipe writes it
# ----------------------------------------------------------------------------------------------------------------

def save_everything(model, encoding: dict, target_id: int, by: str = "block", remote=False, weights=None):
    """Save every sublayer output at every position in the trace, then compute the DLA from them after it.

    ``weights``: a plain transformers Llama with the same weights, for the few weights the math after the trace
    needs (final norm gain, ``lm_head`` row, ``o_proj`` / ``down_proj``); default: the traced model's own module
    (a remote model has none, so remotely pass the local copy). Returns ``(values [batch, n_components],
    logit [batch], saved_bytes)``: the parts at the last position, through the final RMSNorm frozen at the real
    stream, dotted with ``lm_head.weight[target]``; ``values.sum(-1)`` should equal ``logit``.
    """
    import nnsight
    import torch

    n_layers = model.config.num_hidden_layers
    kwargs = {"remote": remote} if remote else {}
    # Only names saved in the trace body come back out of it (locally and from a server): one list of activations.
    with model.trace(dict(encoding), **kwargs):
        saved = [model.layers_input[0]]
        for i in range(n_layers):
            layer = model.layers[i]
            saved.append(layer.self_attn.o_proj.input if by == "head" else model.attentions_output[i])
            saved.append(layer.mlp.down_proj.input if by == "neuron" else model.mlps_output[i])
        saved.append(model.ln_final.input)
        saved.append(model.logits[:, -1])
        saved = nnsight.save(saved)
    embed, final_in, logits, saved = saved[0], saved[-2], saved[-1], saved[1:-2]
    saved_bytes = sum(t.numel() * t.element_size() for t in [embed, final_in, logits, *saved])
    hf = weights if weights is not None else model._module
    with torch.no_grad():
        gain, unembed = hf.model.norm.weight.float(), hf.lm_head.weight[target_id].float()
        eps = float(model.config.rms_norm_eps)
        x = final_in[:, -1].float()
        scale = torch.rsqrt(x.pow(2).mean(-1) + eps)  # [batch]
        direction = gain * unembed  # [d_model]
        parts = [(embed[:, -1].float() @ direction)[:, None]]
        n_heads = model.config.num_attention_heads
        for i in range(n_layers):
            attn, mlp = saved[2 * i][:, -1].float(), saved[2 * i + 1][:, -1].float()
            block = hf.model.layers[i]
            if by == "head":
                pulled = (direction @ block.self_attn.o_proj.weight.float()).view(n_heads, -1)  # [heads, head_dim]
                parts.append((attn.view(attn.shape[0], n_heads, -1) * pulled).sum(-1))
            else:
                parts.append((attn @ direction)[:, None])
            if by == "neuron":
                parts.append(mlp * (direction @ block.mlp.down_proj.weight.float()))
            else:
                parts.append((mlp @ direction)[:, None])
        values = torch.cat(parts, -1) * scale[:, None]
        logit = logits[:, target_id].float()
    return values, logit, saved_bytes


# ----------------------------------------------------------------------------------------------------------------
# the in-trace recipe on a prepared batch
# ----------------------------------------------------------------------------------------------------------------

def recipe_trace(model, plan, batch, by: str, remote=False):
    """One trace running the public in-trace recipe on a prepared batch (every position through ``lm_head``: no
    ``logits_to_keep``, to show what that lever saves in ``dla_*``); returns the unpacked ``Readout``."""
    import nnsight

    import dla_recipes

    kwargs = {"remote": remote} if remote else {}
    positions, targets, contrasts = batch.positions, batch.targets, batch.contrasts
    with model.trace(dict(batch.encoding), **kwargs):
        packed = nnsight.save(
            dla_recipes.trace.direct_logit_attribution(model, plan, positions, targets, contrasts, by).pack()
        )
    return dla_recipes.trace.Readout.unpack(packed)


# ----------------------------------------------------------------------------------------------------------------
# method table
# ----------------------------------------------------------------------------------------------------------------

def build_method(ctx: Context, name: str):
    """A no-argument callable running ``name`` once; it returns the attribution's max error (or None)."""
    import torch

    import dla_recipes
    from dla_recipes.transport.batches import prepare

    target_id = ctx.entry["target_id"]
    if name in ("plain_forward", "plain_forward_keep1"):
        plain, enc = ctx.plain, ctx.encoding()
        kw = {"logits_to_keep": 1} if name.endswith("keep1") else {}

        def run():
            with torch.no_grad():
                plain(**enc, **kw)
        return run
    model = ctx.model
    if name in ("trace_logits", "trace_logits_keep1", "trace_logits_grad"):
        enc = ctx.encoding()
        kw = {"logits_to_keep": 1} if name.endswith("keep1") else {}
        grad = torch.enable_grad if name.endswith("grad") else torch.no_grad

        def run():
            # nnsight traces with autograd on unless told: (2) is the no_grad floor, as (1)
            with grad():  # noqa: SIM117 - nnsight finds a trace by its own `with` line
                with model.trace(dict(enc), **kw):
                    model.logits.save()
        return run
    if name.startswith("dla_"):
        by = name[4:]

        def run():
            return dla_recipes.attribute(model, ctx.prompts, ctx.target, by=by).error
        return run
    if name.startswith("recipe_"):
        by = name.rsplit("_", 1)[1]
        plan = dla_recipes.plan.build_plan(model)
        batch = prepare(model, ctx.prompts, ctx.target)

        def run():
            readout = recipe_trace(model, plan, batch, by)
            return float((readout.values.sum(-1) + readout.constant - readout.logit).abs().max())
        return run
    if name.startswith("save_all_"):
        by, enc = name.rsplit("_", 1)[1], ctx.encoding()

        def run():
            with torch.no_grad():
                values, logit, _ = save_everything(model, enc, target_id, by)
            return float((values.sum(-1) - logit).abs().max())
        return run
    raise ValueError(f"unknown method {name!r}")


def error_of(fn):
    value = fn()
    return None if value is None else float(value)


# ----------------------------------------------------------------------------------------------------------------
# worker
# ----------------------------------------------------------------------------------------------------------------

def _guarded(name, make):
    try:
        return make(), None
    except Exception as error:  # noqa: BLE001 - recorded in the results; the other methods still run
        return None, f"{type(error).__name__}: {error}\n{traceback.format_exc(limit=4)}"


def cmd_time(args, entry) -> dict:
    ctx = Context(entry, args.batch)
    methods, errors, max_errors = {}, {}, {}
    for name in args.methods:
        fn, problem = _guarded(name, lambda name=name: build_method(ctx, name))
        if fn is not None:
            try:
                max_errors[name] = error_of(fn)  # first call: also a warm-up
                methods[name] = fn
            except Exception as error:  # noqa: BLE001 - recorded in the results; the rest still runs
                problem = f"{type(error).__name__}: {error}\n{traceback.format_exc(limit=6)}"
        if problem:
            errors[name] = problem
    timings = common.time_methods(methods, repeats=args.repeats, warmup=args.warmup, baseline="trace_logits")
    return {"timings": timings, "max_error": max_errors, "failures": errors}


def cmd_mem(args, entry) -> dict:
    out, failures = {}, {}
    for name in args.methods:  # one method per process in a full run; several in --quick (shared process)
        ctx = Context(entry, args.batch)
        try:
            fn = build_method(ctx, name)
            out[name] = common.measure_peak(fn, warmup=1)
        except Exception as error:  # noqa: BLE001 - recorded in the results; the rest still runs
            failures[name] = f"{type(error).__name__}: {error}\n{traceback.format_exc(limit=6)}"
        del ctx
        common.trim()
    return {"memory": out, "failures": failures, "shared_process": len(args.methods) > 1}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["time", "mem"])
    parser.add_argument("--spec", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--batch", type=int, required=True)
    parser.add_argument("--methods", default=",".join(ALL_METHODS))
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args(argv)
    args.methods = [m for m in args.methods.split(",") if m]
    common.offline()
    threads = common.set_threads()
    import dla_recipes  # noqa: F401 - its nnterp shim must load before nnterp

    entry = common.read_json(args.spec)["models"][args.model]
    result = cmd_time(args, entry) if args.command == "time" else cmd_mem(args, entry)
    result.update({"model": args.model, "batch": args.batch, "threads": threads, "pid": os.getpid()})
    common.emit(result)


if __name__ == "__main__":
    main()
