"""TransformerLens methods and their worker; runs in ``.venv-tl`` (``transformer-lens==4.3.0``), not the project venv.

    .venv-tl/bin/python benchmarks/tl_worker.py time|mem --spec SPEC --model smollm2 --batch 16

TransformerLens 4.x removed ``HookedTransformer``; its replacement is ``TransformerBridge.boot_transformers(name)``
(here the local model folder, offline) followed by ``enable_compatibility_mode()`` for HookedTransformer numerics
(``fold_ln``, ``center_writing_weights``). ``center_unembed`` is turned off: on it, TransformerLens's logits are the
logits minus their vocabulary mean, not the model's own logits, and the attributions would not sum to them.

Methods (same prompts and token ids as the project venv's methods, read from the spec file):

- ``plain_forward``: the plain transformers model in this process (the same floor as the project's (1)), so a
  TransformerLens time can be put next to the nnsight ones: ``ratio = (t / plain_forward here) * (plain_forward /
  trace_logits in the project run)``.
- ``tl_forward``: the bridge's forward, no cache.
- ``tl_block``: ``run_with_cache`` + ``cache.decompose_resid(pos_slice=-1)`` + ``cache.logit_attrs``.
- ``tl_head``: ``run_with_cache`` + ``cache.stack_head_results(incl_remainder=True, pos_slice=-1)`` + ``logit_attrs``.
- ``tl_neuron``: ``run_with_cache`` + ``cache.stack_neuron_results(incl_remainder=True, pos_slice=-1)`` + ``logit_attrs``.
- ``tl_tool_block`` / ``tl_tool_head``: ``transformer_lens.tools.analysis.direct_logit_attribution`` (unit
  ``"component"`` / ``"head"``; it has no neuron unit).

The error is ``max |sum(attributions) + b_U[target] - logit|`` against the bridge's own logit at the last position;
``tl_vs_hf_logit`` is ``max |bridge logit - plain transformers logit|`` (eager vs sdpa attention, folded weights).
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common

METHODS = ["plain_forward", "tl_forward", "tl_block", "tl_head", "tl_neuron", "tl_tool_block", "tl_tool_head"]


def load_bridge(folder: str):
    import torch
    from transformer_lens.model_bridge import TransformerBridge

    bridge = TransformerBridge.boot_transformers(folder, dtype=torch.float32, device="cpu")
    bridge.enable_compatibility_mode(disable_warnings=True, center_unembed=False)
    bridge.eval()
    return bridge


class Context:
    def __init__(self, entry: dict, batch: int):
        import torch

        self.entry = entry
        self.tokens = torch.tensor(entry["input_ids"][:batch])
        self.targets = torch.full((batch,), entry["target_id"], dtype=torch.long)
        self._bridge = self._plain = None

    @property
    def bridge(self):
        if self._bridge is None:
            self._bridge = load_bridge(self.entry["folder"])
        return self._bridge

    @property
    def plain(self):
        if self._plain is None:
            self._plain = common.load_plain(self.entry["folder"])
        return self._plain


def _error(attrs, bridge, logits, targets) -> float:
    """``attrs [components, batch]`` summed (plus the unembedding bias) against the bridge's last-position logit."""
    import torch

    logit = logits[:, -1].gather(-1, targets[:, None])[:, 0].float()
    b_u = getattr(bridge, "b_U", None)
    bias = b_u[targets].float() if isinstance(b_u, torch.Tensor) else 0.0
    return float((attrs.float().sum(0) + bias - logit).abs().max())


def build_method(ctx: Context, name: str):
    import torch

    tokens, targets = ctx.tokens, ctx.targets
    if name == "plain_forward":
        plain = ctx.plain

        def run():
            with torch.no_grad():
                plain(input_ids=tokens, attention_mask=torch.ones_like(tokens))
        return run
    bridge = ctx.bridge
    if name == "tl_forward":
        def run():
            with torch.no_grad():
                bridge(tokens)
        return run
    if name in ("tl_block", "tl_head", "tl_neuron"):
        def run():
            with torch.no_grad():
                logits, cache = bridge.run_with_cache(tokens)
                if name == "tl_block":
                    stack = cache.decompose_resid(pos_slice=-1)
                elif name == "tl_head":
                    stack = cache.stack_head_results(layer=-1, incl_remainder=True, pos_slice=-1)
                else:
                    stack = cache.stack_neuron_results(layer=bridge.cfg.n_layers, incl_remainder=True, pos_slice=-1)
                attrs = cache.logit_attrs(stack, tokens=targets, pos_slice=-1)  # [components, batch]
                return _error(attrs, bridge, logits, targets)
        return run
    if name in ("tl_tool_block", "tl_tool_head"):
        from transformer_lens.tools.analysis import direct_logit_attribution

        unit = "component" if name == "tl_tool_block" else "head"

        def run():
            with torch.no_grad():
                result = direct_logit_attribution(bridge, tokens, answer_tokens=targets, unit=unit, pos=-1)
                logits = bridge(tokens)  # the tool does not return the logits: a second forward, outside the timing
                return result, logits

        def timed():
            with torch.no_grad():
                direct_logit_attribution(bridge, tokens, answer_tokens=targets, unit=unit, pos=-1)

        def first():
            result, logits = run()
            return _error(result.attribution, bridge, logits, targets)
        timed.first = first
        return timed
    raise ValueError(f"unknown method {name!r}")


def _first(fn):
    first = getattr(fn, "first", fn)
    value = first()
    return None if value is None else float(value)


def cmd_time(args, entry) -> dict:
    import torch

    ctx = Context(entry, args.batch)
    methods, failures, max_errors = {}, {}, {}
    for name in args.methods:
        try:
            fn = build_method(ctx, name)
            max_errors[name] = _first(fn)
            methods[name] = fn
        except Exception as error:  # noqa: BLE001 - recorded in the results; the rest still runs
            failures[name] = f"{type(error).__name__}: {error}\n{traceback.format_exc(limit=8)}"
    extra = {}
    try:  # the bridge's logit against the plain model's
        with torch.no_grad():
            tl = ctx.bridge(ctx.tokens)[:, -1].gather(-1, ctx.targets[:, None])[:, 0]
            hf = ctx.plain(input_ids=ctx.tokens).logits[:, -1].gather(-1, ctx.targets[:, None])[:, 0]
        extra["tl_vs_hf_logit"] = float((tl - hf).abs().max())
    except Exception as error:  # noqa: BLE001 - recorded in the results; the rest still runs
        failures["tl_vs_hf_logit"] = f"{type(error).__name__}: {error}"
    timings = common.time_methods(methods, repeats=args.repeats, warmup=args.warmup, baseline="plain_forward")
    return {"timings": timings, "max_error": max_errors, "failures": failures, **extra}


def cmd_mem(args, entry) -> dict:
    out, failures = {}, {}
    for name in args.methods:
        ctx = Context(entry, args.batch)
        try:
            out[name] = common.measure_peak(build_method(ctx, name), warmup=1)
        except Exception as error:  # noqa: BLE001 - recorded in the results; the rest still runs
            failures[name] = f"{type(error).__name__}: {error}\n{traceback.format_exc(limit=8)}"
        del ctx
        common.trim()
    return {"memory": out, "failures": failures, "shared_process": len(args.methods) > 1}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["time", "mem", "probe"])
    parser.add_argument("--spec", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args(argv)
    args.methods = [m for m in args.methods.split(",") if m]
    common.offline()
    threads = common.set_threads()
    entry = common.read_json(args.spec)["models"][args.model]
    import torch
    import transformer_lens
    import transformers

    versions = {"transformer_lens": getattr(transformer_lens, "__version__", None) or _dist_version("transformer-lens"),
                "torch": torch.__version__, "transformers": transformers.__version__}
    if args.command == "probe":  # can TransformerLens load this folder offline? (error text if not)
        try:
            bridge = load_bridge(entry["folder"])
            result = {"loaded": True, "adapter": type(bridge.adapter).__name__}
        except Exception as error:  # noqa: BLE001 - recorded in the results; the rest still runs
            result = {"loaded": False, "error": f"{type(error).__name__}: {error}",
                      "traceback": traceback.format_exc(limit=12)}
    elif args.command == "time":
        result = cmd_time(args, entry)
    else:
        result = cmd_mem(args, entry)
    result.update({"model": args.model, "batch": args.batch, "threads": threads, "pid": os.getpid(),
                   "versions": versions})
    common.emit(result)


def _dist_version(name: str):
    from importlib.metadata import version

    try:
        return version(name)
    except Exception:  # noqa: BLE001 - a version is only informative
        return None


if __name__ == "__main__":
    main()
