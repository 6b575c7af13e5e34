"""The recipe never makes the host wait for the device while the forward pass runs, and never copies a whole
activation to float32: counted on the CPU as a GPU would see them (``dla_recipes.testing.launches``).

On CUDA every read of a device tensor on the host (``.item()``, ``.cpu()``, ``float(t)``, ``nonzero``) and every copy
of host data to the device (``.to(device)`` of a host index) waits for every kernel queued before it: one in each
block's reads drains the GPU's queue once per block, and the GPU idles while the host catches up. The counter
tracks which tensors live "on the device" (the model's parameters and everything computed from them) through every
op, so a CPU run counts the waits a GPU run would have. Checked on every tiny family, in bfloat16 (the precision
NDIF serves, where the self-check reads the most), by block, head, neuron and source on a cover of the families x
granularities (``conftest.cover``: every granularity on one family per group, one on each other family; by source
with ``upstream=`` on a few families), on a padded batch, on the second call (the first probes the norms, once per
model); ``attribute_scores`` the same way by block and head, its one copy to the host after the model's last op;
and on the counter itself: a planted ``.item()`` and a planted ``.to(device)`` of a host index inside a block's
reads are caught and named.

The one allowed wait inside the forward pass is data-dependent work that the model's own forward does too: a fused
mixture of experts recomputes only the experts that fired, so it reads which ones did (``trace.kinds.experts``,
``trace.kinds.routed``), as transformers' own expert loop does.
"""

from __future__ import annotations

import functools

import pytest
import torch
from conftest import cover, is_source_refusal
from test_scores import MUST_SPLIT as SCORES_MUST_SPLIT

import dla_recipes
from dla_recipes.errors import DLAError, ExactnessError, FamilyTableError, InputError
from dla_recipes.plan import build_plan
from dla_recipes.testing import tiny
from dla_recipes.testing.launches import Launches
from dla_recipes.transport import run as run_module

PROMPTS = ["w5 w6 w7 w8 w9 w10 w11 w12 w13 w14", "w11 w12 w13", "w13 w14 w15 w16 w17 w18"]  # padded
# which experts fired (see the module docstring): fused experts, and grouped ones behind a router (JetMoE)
ALLOWED = ("dla_recipes/trace/kinds/experts.py", "dla_recipes/trace/kinds/routed.py")
_MODELS: dict = {}


def bf16_model(family: str):
    """The tiny ``family`` model in bfloat16; skips the test when a plain transformers forward of the prompts fails
    in it (a family whose own code cannot run in bfloat16 on the CPU: nothing to count)."""
    if family not in _MODELS:
        hf = tiny.build(family).to(torch.bfloat16)
        tokenizer = tiny.tokenizer()
        try:
            with torch.no_grad():
                hf(**tokenizer(PROMPTS, return_tensors="pt", padding=True))
        except (RuntimeError, TypeError, ValueError, NotImplementedError) as error:  # xLSTM: a float32 matmul
            pytest.skip(f"a plain {family} forward fails in bfloat16 on the CPU: {type(error).__name__}: {error}"[:300])
        _MODELS[family] = dla_recipes.load(hf, tokenizer=tokenizer, device_map="cpu")
    return _MODELS[family]


def counting(model, entry):
    """``(entry(), counts)``: what ``entry`` returns and the counts of each trace it ran, counting inside its traces
    only (``run_trace``)."""
    traces = []
    original = run_module.run_trace

    def counted_trace(*args, **kw):
        with Launches(model) as launches:
            out = original(*args, **kw)
        traces.append(launches.counts)
        return out

    run_module.run_trace = counted_trace
    try:
        result = entry()
    finally:
        run_module.run_trace = original
    return result, traces


def counted(model, **kwargs):
    """``(attribution, counts)`` of one ``attribute`` call, counting inside its traces only (``run_trace``)."""
    return counting(model, lambda: dla_recipes.attribute(model, PROMPTS, "w20", contrast="w21", **kwargs))


def waits(counts) -> list:
    """The recipe's syncs and uploads while the forward ran, outside the allowed places."""
    events = counts.mid_forward(counts.syncs) + counts.mid_forward(counts.uploads)
    return [e[:3] for e in events if not e[1].startswith(ALLOWED)]


@pytest.mark.parametrize(("family", "by"), cover(tiny.FAMILIES, ("block", "head", "neuron", "source"), per_family=1))
def test_no_wait_for_the_device_inside_the_forward(family, by):
    """By ``by``, on a cover of the families x granularities (``conftest.cover``): no wait and no upload while the
    forward runs, no float32 copy of a whole activation."""
    model = bf16_model(family)
    try:  # the first call probes the norms (kept on each norm module, marked on the device by the counter)
        counted(model, by=by)
    except (InputError, FamilyTableError):
        return  # a granularity the family refuses: refused the same way, tested elsewhere (an inexact or
        # non-finite result is not a refusal: it fails here)
    except DLAError as error:  # by source: the split's own refusal (conftest.is_source_refusal, test_sources.py)
        if by == "source" and is_source_refusal(error):
            return
        raise
    _, traces = counted(model, by=by)
    assert traces, (family, by)
    for counts in traces:
        assert waits(counts) == [], (family, by, waits(counts))
        assert counts.model_ops() > 0
        # no float32 copy of a whole activation: each cast covers the attributed sites, not [batch, pos, ...]
        # (by source reads the values at every position, each key being a source, in float32: the one
        # activation it copies whole, [batch, pos, kv_heads * head_dim])
        full = len(PROMPTS) * 10 * model.lm_head.weight.shape[-1]
        if by != "source":
            assert counts.largest_widening("recipe") < full, (family, by, counts.largest_widening("recipe"), full)


# families whose plan accepts each upstream split (Gemma-3's heads through their frozen post-norms)
@pytest.mark.parametrize("family, upstream", [("llama", "block"), ("llama", "head"), ("gemma3", "block"), ("gemma3", "head"),
                                              ("gpt2", "head"), ("qwen2", "block"), ("qwen2", "head")])
def test_no_wait_for_the_device_splitting_sources_by_upstream(family, upstream):
    """``by="source"`` with ``upstream=``: every component's writes at the sources, each prompt's sites grouped on
    the host before the forward pass (``Sites.grouped``), no read of the rows in it."""
    model = bf16_model(family)
    counted(model, by="source", sources={"upstream": upstream})
    _, traces = counted(model, by="source", sources={"upstream": upstream})
    for counts in traces:
        assert waits(counts) == [], (family, upstream, waits(counts))


def attended_head(model) -> str | None:
    """The head ``attribute_scores`` splits here: head 0 of the first attention block after block 0 (the later
    blocks still run while the split is computed), else of block 0; None when no block has attention heads."""
    layers = [i for i, terms in enumerate(build_plan(model).layers) if any(p.term.splits_heads for p in terms)]
    layer = next((i for i in layers if i > 0), layers[0] if layers else None)
    return None if layer is None else f"L{layer}.H0"


@pytest.mark.parametrize(("family", "by"), cover(tiny.FAMILIES, ("block", "head"), per_family=1))
def test_scores_never_wait_for_the_device_inside_the_forward(family, by):
    """``attribute_scores`` (a head's score split into query x key pairs) too, by block and head: its indices go to
    the device before the forward pass, its checks stay on the device, and its one copy to the host comes after the
    model's last op (the blocks after the attended one and the head still run when the split is done). On a cover
    of the families x the two granularities (``conftest.cover``)."""
    model = bf16_model(family)
    head = attended_head(model)
    if head is None:  # no attention heads: refused by name (test_scores.py)
        assert family not in SCORES_MUST_SPLIT, family
        return
    split = functools.partial(dla_recipes.attribute_scores, model, PROMPTS, head, keys=[-2, -1], by=by)
    try:
        counting(model, split)  # the first call probes the norms (kept on each norm module, marked on the device)
    except ExactnessError:
        raise  # an inexact split is no refusal: it fails here
    except DLAError:  # a family whose score it cannot split (refused by name, tested in test_scores.py)
        assert family not in SCORES_MUST_SPLIT, family
        return
    _, traces = counting(model, split)
    assert traces, (family, by)
    for counts in traces:
        assert waits(counts) == [], (family, by, waits(counts))
        assert counts.model_ops() > 0
        assert [call for _, _, call, _ in counts.recipe_syncs()] == ["cpu"], (family, by, counts.recipe_syncs())


def test_the_counter_catches_a_planted_wait(monkeypatch):
    """A ``float()`` of a device value and a ``.to(device)`` of a host index right after a block's reads (before the
    next block runs) are counted, with the line that made them (so the test above can fail)."""
    from dla_recipes.question import Fast
    from dla_recipes.trace import recipe

    general = Fast(lane=False)  # the general way, whose block reads the wait is planted after
    model = bf16_model("llama")
    counted(model, by="head", fast=general)
    original = recipe.layer_reads  # every block's reads, in forward order (decompose calls it by this name)

    def planted(*args, **kwargs):
        block = original(*args, **kwargs)
        for reads in block.reads:
            value = reads.value if reads.value is not None else reads.parts.inputs  # what the term just read
            float(value.sum())  # a read on the host, mid-forward
            torch.arange(3).to(value.device)  # a host tensor copied to the device
        return block

    monkeypatch.setattr(recipe, "layer_reads", planted)
    _, traces = counted(model, by="head", fast=general)
    found = waits(traces[0])
    terms_read = 2 * len(model.layers)  # attention and MLP of every block, each read once
    assert sum(call == "__float__" and where.startswith("dla_recipes/trace/recipe.py") for _, where, call in found) \
        == terms_read, found
    assert sum(call == "to of host data" for _, _, call in found) == terms_read, found


def test_full_width_casts_are_seen():
    """The widening count sees a float32 copy of a whole bfloat16 activation (so the bound above can fail)."""
    x = torch.randn(3, 10, 16).to(torch.bfloat16)
    with Launches() as launches:
        x.float()
        x[:, -1].float()
    assert sorted(n for _, _, n, _ in launches.counts.widenings) == [48, 480]
