"""Shared fixtures: tiny models per family (cached per session), prompts, and the plain-forward reference."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

import dla_recipes  # noqa: E402,F401  (the nnterp shim, before nnterp)
from dla_recipes.testing import tiny  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

# Three prompts of different lengths: the batch is padded, so positions must not shift with padding.
PROMPTS = ["w5 w6 w7 w8 w9 w10", "w11 w12", "w13 w14 w15 w16"]
TARGET, CONTRAST = "w20", "w21"

_CACHE: dict[str, object] = {}


def tiny_model(family: str):
    """A tiny perturbed ``family`` model loaded with ``dla_recipes.load`` (cached for the session)."""
    if family not in _CACHE:
        _CACHE[family] = tiny.standardized(family)
    return _CACHE[family]


def plain_logits(model, prompt: str) -> torch.Tensor:
    """``[pos, vocab]``: a plain transformers forward of one unpadded prompt, no nnsight involved."""
    hf = model._module
    ids = model.tokenizer(prompt, return_tensors="pt")
    with torch.no_grad():
        return hf(input_ids=ids["input_ids"], attention_mask=ids["attention_mask"]).logits[0].float()


@contextlib.contextmanager
def single_threaded():
    """Run torch single-threaded, as the loopback NDIF server computes: float reductions depend on the thread count,
    so a bit-exact remote == local comparison needs the local forward single-threaded too."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def tolerance(logit: torch.Tensor) -> torch.Tensor:
    """The promised bound in float32: 1e-4 * max(1, |logit|)."""
    return 1e-4 * torch.clamp(logit.abs(), min=1.0)


def notebook_runner():
    """notebooks/execute.py as the module ``dla_docs_notebooks`` (one in-process record shared by the tests)."""
    module = sys.modules.get("dla_docs_notebooks")
    if module is None:
        path = Path(__file__).resolve().parents[1] / "notebooks" / "execute.py"
        spec = importlib.util.spec_from_file_location("dla_docs_notebooks", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules["dla_docs_notebooks"] = module
        spec.loader.exec_module(module)
    return module
