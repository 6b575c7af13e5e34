"""The fast paths change no number: every tiny family's parts are bit-identical with and without them.

A fast path is work skipped or shared because it cannot change the answer: the prompts tokenized once and padded into each batch (``token_ids`` /
``prepare(ids=)``), a tokenizer's answers kept (``transport.sites.remembered``), the ``logits_to_keep`` signature
check kept per model class (``transport.session.keeps_logits``), the plan kept per model (``build_plan``), each
norm's probe kept on its module until a parameter changes (``Fast.probes``), what depends only on
the weights and the targets kept from an earlier call (``Fast.reuse``: the head, every term's direction,
the pull-backs through ``W_O`` / ``W_down``), a small call's arithmetic deferred to after the forward pass
(``trace.recipe.DEFER_SITES``), the common case's terms scored in a few products after it (``Fast.lane``), a
call's batches and layout kept for the same question asked again (``Fast.memo``). Each is
switched off here (``fast=False`` for the per-call ones, ``slow_paths`` for the rest) and the same call made again; ``torch.equal`` on the parts, the constant, the
model's own logit (the head runs on the same positions either way) and the self-check's bound and split rounding.
The fast side calls twice, so that its second call takes the record the first one left whole; in float32 on every
family, in bfloat16 (where a split term also reads its write whole, for the self-check) on one family of each
group.
"""

from __future__ import annotations

import inspect

import pytest
import torch
from conftest import FAST_FAMILIES, fast_sweep, tiny_model

import dla_recipes
from dla_recipes import api
from dla_recipes.plan import build_plan
from dla_recipes.testing import tiny
from dla_recipes.trace import plain, recipe
from dla_recipes.transport import batches, session

# Four prompts of 12 tokens: 48 sites at position="all", in one batch on every family (the
# padding-unsafe ones group prompts of one length: the same single batch), one target at every site.
PROMPTS = [" ".join(f"w{5 + (k * 7 + j) % 90}" for j in range(12)) for k in range(4)]
SPLITS = ("head", "neuron")


def slow_paths(monkeypatch) -> None:
    """Switch every fast path off (see the module docstring) until ``monkeypatch`` undoes it."""
    monkeypatch.setattr(api, "token_ids", lambda model, plan, prompts: None)  # group and prepare tokenize anew
    monkeypatch.setattr(batches, "remembered", lambda tokenizer, key, compute: compute())
    monkeypatch.setattr(session, "keeps_logits",
                        lambda model: "logits_to_keep" in inspect.signature(model._module.forward).parameters)
    monkeypatch.setattr(recipe, "DEFER_SITES", 0)  # every block scored right after its reads
    build_plan.cache_clear()


def call(model, by: str, fast=True):
    """``fast=False``: the per-call fast paths off too (``question.Fast``: no record reused, no batches kept, no
    lane, no kept probe: every call makes what depends on the weights and targets anew, prepares its prompts anew,
    scores each term on its own and probes every norm anew)."""
    return dla_recipes.attribute(model, PROMPTS, "w20", position="all", by=by, fast=fast)


def same_with_and_without(model, family: str, monkeypatch, granularities=SPLITS) -> None:
    """Each granularity's second call (the record of the first taken whole) against the slow paths' call."""
    fast = {}
    for by in granularities:
        call(model, by)
        fast[by] = call(model, by).sites
    slow_paths(monkeypatch)
    for by in granularities:
        slow = call(model, by, fast=False).sites
        for field in ("values", "constant", "logit", "output_logit"):
            a, b = getattr(fast[by], field), getattr(slow, field)
            assert torch.equal(a, b), (family, by, field, float((a - b).abs().max()))
        for field in ("bound", "split_rounding"):  # the self-check's: the model's own rounding, as measured
            a, b = torch.as_tensor(fast[by].diagnostics[field]), torch.as_tensor(slow.diagnostics[field])
            assert torch.equal(a, b), (family, by, field, float((a - b).abs().max()))
        assert fast[by].labels == slow.labels


@pytest.mark.parametrize("family", fast_sweep(tiny.FAMILIES))
def test_fast_paths_change_no_number(family, monkeypatch):
    same_with_and_without(tiny_model(family), family, monkeypatch, ("block", *SPLITS))


@pytest.mark.parametrize("family", FAST_FAMILIES)
def test_fast_paths_change_no_number_in_bfloat16(family, monkeypatch):
    hf = tiny.build(family).to(torch.bfloat16)
    same_with_and_without(dla_recipes.load(hf, tokenizer=tiny.tokenizer(), device_map="cpu"), family, monkeypatch)


def test_the_lane_is_taken_where_every_term_is_plain(monkeypatch):
    """The common case's lane (``trace.plain``) scores Llama's terms at every granularity, in float32 and in
    bfloat16 (where it also collects the model's own rounding for the self-check), and GPT-2's by block (its split
    terms have biases); Gemma-2's post-norms send every call the general way. The lane's numbers are the general
    way's (``test_fast_paths_change_no_number``), so this checks only that the fast path is the one taken."""
    taken = []
    score = plain.Lane.score
    monkeypatch.setattr(plain.Lane, "score", lambda self, *args: taken.append(1) or score(self, *args))
    expected = {"llama": ("block", "head", "neuron"), "gpt2": ("block",), "gemma2": ()}
    for family, lanes in expected.items():
        for dtype in (torch.float32, torch.bfloat16):
            model = tiny_model(family) if dtype == torch.float32 else dla_recipes.load(
                tiny.build(family).to(dtype), tokenizer=tiny.tokenizer(), device_map="cpu")
            for by in ("block", "head", "neuron"):
                taken.clear()
                dla_recipes.attribute(model, PROMPTS[:2], "w20", by=by)
                assert bool(taken) == (by in lanes), (family, dtype, by, taken)


def test_the_readout_is_gathered_field_by_field():
    """``Readout.gathered`` writes every field into its own column in a few ops (one upload of the host's numbers
    and the tensor fields' columns, one ``index_copy_``): each field given as ``[n]``, ``[n, 1]``, ``[]``, float64,
    bool or a Python number reads back from its own column, a field not given reads its default, and the values
    stay in the first columns."""
    from dla_recipes.trace.readout import DEFAULTS, Readout

    n, width = 3, 5
    values = torch.arange(n * width, dtype=torch.float32).reshape(n, width) - 7.5
    buffer = torch.full((n, width + len(Readout.FIELDS)), float("nan"))
    buffer[:, :width] = values
    given = {"constant": torch.tensor([1.5, -2.0, 3.25]), "logit": torch.tensor([[4.0], [5.0], [6.0]]),
             "output_logit": torch.tensor([7.0, 8.0, 9.0], dtype=torch.float64), "head_error": torch.tensor(0.125),
             "norm_fit_error": 2e-7, "scale": torch.tensor([0.5, 0.25, 2.0]), "finite_head": torch.tensor([True, False, True]),
             "pattern_layer": 3.0, "first_nonfinite": torch.tensor([-1.0, 2.0, -1.0]), "unit_roundoff": 2.0 ** -9}
    readout = Readout.gathered(buffer, **given)
    assert torch.equal(readout.values, values)
    for name in Readout.FIELDS:
        got = getattr(readout, name).reshape(-1)
        want = given.get(name, DEFAULTS.get(name))
        want = torch.as_tensor(want).float().reshape(-1)
        if name in ("head_error", "norm_fit_error"):  # the batch's largest (unpack)
            want = want.max().reshape(-1)
        elif name in ("pattern_error", "pattern_layer"):  # the first row's
            want = want[:1]
        assert torch.equal(got, want.expand_as(got)), (name, got, want)


def test_the_short_finite_test_and_the_infinity_norm_are_what_they_replace():
    """Two ops the recipe issues fewer of: ``math.rounding.finite`` (``x - x == 0``, two ops) is ``torch.isfinite``
    (four), and ``math.linalg.largest_abs`` (one infinity norm) is ``x.float().abs().max()`` (two), NaN included, on
    every float dtype: zeros of both signs, subnormals, the largest finite values, infinities, NaN and random
    values over many binades; ``first_nonfinite`` on rows of them is the first column ``isfinite`` finds bad."""
    from dla_recipes.math.linalg import largest_abs
    from dla_recipes.math.rounding import finite, first_nonfinite

    generator = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        info = torch.finfo(dtype)
        special = torch.tensor([0.0, -0.0, info.tiny, -info.tiny, info.tiny / 4, info.max, -info.max, 1.0,
                                float("inf"), float("-inf"), float("nan")], dtype=torch.float64).to(dtype)
        spread = torch.randn(4000, generator=generator, dtype=torch.float64)
        spread = spread * 2.0 ** torch.randint(-40, 40, (4000,), generator=generator).double()
        x = torch.cat([special, spread.to(dtype)])
        assert torch.equal(finite(x), torch.isfinite(x)), dtype
        rows = x[torch.randperm(x.numel(), generator=generator)[:2000]].reshape(200, 10)
        ok = torch.isfinite(rows)
        want = torch.where(ok.all(-1), -1.0, torch.argmin(ok.to(torch.uint8), -1).float())
        assert torch.equal(first_nonfinite(rows), want), dtype
        assert bool((want >= 0).any()) and bool((want < 0).any()), dtype  # both kinds of row were tried
        for sample in (x, x[torch.isfinite(x)], rows[:, :3], special[:4], special[-2:]):
            got, old = largest_abs(sample), sample.float().abs().max()
            assert got.dtype == old.dtype == torch.float32
            assert torch.equal(got, old) or (bool(got.isnan()) and bool(old.isnan())), (dtype, got, old)
