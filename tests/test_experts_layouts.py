"""Experts layouts and optional terms (issue 12): the families whose experts module has its own layout, and a
Gemma-4 with both a MoE block and per-layer inputs.

Each is checked at every granularity on a padded batch against a plain transformers forward of each prompt alone,
its split terms against the block term read from the model's own module output, and a table that forgets a part of
the layout (a bias, a scale, the per-layer-input term) is refused by the self-check.
"""

from dataclasses import replace

import bounds
import pytest
import torch
from conftest import BOUND_CEILING, CONTRAST, PROMPTS, TARGET, own_ratio, plain_logits, tiny_model, tolerance
from test_positions import assert_rows_within, targets_of

import dla_recipes
from dla_recipes import ExactnessError, FamilyTableError
from dla_recipes.families import Experts, Family, LayerKind

LAYOUTS = ["gpt_oss", "aria_text", "llama4_text", "minimax_m3_vl_text", "cohere2_moe", "falcon_h1", "dbrx",
           "gemma4_moe_ple"]


def _softcap(z, cap):
    return z if cap is None else cap * torch.tanh(z / cap)


@pytest.mark.parametrize("by", ["block", "head", "neuron", "expert"])
@pytest.mark.parametrize("family", LAYOUTS)
def test_padded_batch_is_exact_against_each_prompt_alone(family, by):
    model = tiny_model(family)
    plan = dla_recipes.plan.build_plan(model)
    if by == "expert" and not any(p.term.splits_experts for terms in plan.layers for p in terms):
        with pytest.raises(dla_recipes.InputError, match="no routed experts"):  # a dense family (Falcon-H1)
            dla_recipes.attribute(model, PROMPTS, TARGET, contrast=CONTRAST, by=by)
        return
    attr = dla_recipes.attribute(model, PROMPTS, TARGET, contrast=CONTRAST, by=by)
    target, contrast = (model.tokenizer.convert_tokens_to_ids(t) for t in (TARGET, CONTRAST))
    for k, prompt in enumerate(PROMPTS):
        logits = plain_logits(model, prompt)[-1]
        own = float(logits[target] - logits[contrast])
        assert float(attr.output_logit[k]) == pytest.approx(own, abs=1e-4 * max(1.0, abs(own))), (family, k)
        total = attr.values[k].sum() + attr.constant[k]
        if plan.softcap is None:
            assert float(total) == pytest.approx(own, abs=1e-4 * max(1.0, abs(own))), (family, by, k)
    gaps = (attr.values.sum(-1) + attr.constant - attr.logit).abs()
    assert bool((gaps <= tolerance(attr.logit)).all()), gaps


@pytest.mark.parametrize("family", [f for f in LAYOUTS if f != "falcon_h1"])
def test_every_expert_that_fired_is_a_part(family):
    """By expert, the routed experts that fired carry non-zero parts (the split is not an empty rest)."""
    model = tiny_model(family)
    attr = dla_recipes.attribute(model, PROMPTS, TARGET, by="expert")
    experts = [k for k, label in enumerate(attr.labels) if ".E" in label]
    assert experts and bool((attr.values[:, experts].abs() > 0).sum(-1).min() > 0)


def _without(family_name: str, **layout_changes) -> Family:
    real = dla_recipes.families.family_of(tiny_model(family_name))
    kinds = tuple(LayerKind(tuple(replace(t, split=replace(t.split, layout=replace(t.split.layout, **layout_changes)))
                                  if isinstance(t.split, Experts) else t for t in kind.terms), kind.when)
                  for kind in real.kinds)
    return replace(real, kinds=kinds)


@pytest.mark.parametrize("family,changes", [
    ("gpt_oss", {"down_bias": None}),                      # the experts' down biases
    ("gpt_oss", {"gating": None}),                         # interleaved, clamped gate/up: act_fn(gate) * up is wrong
    ("cohere2_moe", {"routed_scale": None, "shared_scale": None}),  # routed and shared experts averaged
    ("minimax_m3_vl_text", {"routed_scale": None}),        # routed experts times routed_scaling_factor
    ("llama4_text", {"scaled_inputs": False}),             # experts on router-scaled inputs
])
def test_a_layout_that_forgets_a_part_is_refused(family, changes):
    model = tiny_model(family)
    double = _without(family, **changes)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(dla_recipes.families.table, "FAMILIES", (double,))
        dla_recipes.plan.build_plan.cache_clear()
        try:
            with pytest.raises((ExactnessError, FamilyTableError)):
                dla_recipes.attribute(model, PROMPTS, TARGET, by="expert")
        finally:
            dla_recipes.plan.build_plan.cache_clear()


def test_gemma4_moe_with_per_layer_inputs_composes_optional_terms():
    """One list of optional terms: every block of the MoE + per-layer-input Gemma-4 writes attn, mlp, experts, ple;
    the plain MoE and plain per-layer-input Gemma-4 models pick their own subsets from the same entry."""
    names = {f: [[p.term.name for p in terms] for terms in dla_recipes.plan.build_plan(tiny_model(f)).layers]
             for f in ("gemma4_moe_ple", "gemma4_moe", "gemma4")}
    assert all(layer == ["attn", "mlp", "experts", "ple"] for layer in names["gemma4_moe_ple"])
    assert all(layer == ["attn", "mlp", "experts"] for layer in names["gemma4_moe"])
    assert all(layer == ["attn", "mlp", "ple"] for layer in names["gemma4"])
    real = dla_recipes.families.family_of(tiny_model("gemma4_moe_ple"))
    no_ple = replace(real, kinds=(LayerKind(tuple(t for t in real.terms if t.name != "ple")),))
    with pytest.MonkeyPatch.context() as patch:  # the per-layer-input term is needed: without it, a refusal
        patch.setattr(dla_recipes.families.table, "FAMILIES", (no_ple,))
        dla_recipes.plan.build_plan.cache_clear()
        try:
            with pytest.raises(ExactnessError):
                dla_recipes.attribute(tiny_model("gemma4_moe_ple"), PROMPTS, TARGET)
        finally:
            dla_recipes.plan.build_plan.cache_clear()


@pytest.mark.parametrize("family", ["gpt_oss", "dbrx", "llama4_text"])
def test_bfloat16_experts_are_recomputed_in_float32(family, monkeypatch):
    """Biases, [in, out] and flattened expert weights in bfloat16: sliced float32 products; the parts sum to the model's
    own bfloat16 logit (a plain forward of each prompt alone)."""
    from dla_recipes.math import linalg
    from dla_recipes.testing import tiny

    model = dla_recipes.load(tiny.build(family).to(torch.bfloat16), tokenizer=tiny.tokenizer(), device_map="cpu")
    whole = dla_recipes.attribute(model, PROMPTS, TARGET, contrast=CONTRAST, by="neuron")
    monkeypatch.setattr(linalg, "CHUNK_ELEMENTS", 64)  # a few rows of each expert's weight at a time
    sliced = dla_recipes.attribute(model, PROMPTS, TARGET, contrast=CONTRAST, by="neuron")
    # the same float32 products in chunks of rows (another blocking): within a forward's rounding of each row's
    # logit, both sides (test_positions.attribution_bound, of the bfloat16 forward: the looser of the two)
    assert_rows_within(model, sliced, whole, targets_of(model, whole), family)
    # |parts' sum - own logit|: within two forwards' rounding (conftest.own_ratio; measured before: 3.0e-3 of max(1,
    # |own logit|) at most, seeds 0-2)
    assert own_ratio(model, whole) <= 1
    bound = whole.diagnostics["bound"]  # derived from bfloat16's rounding (selfcheck.py): measured at most 0.0157 here
    assert bool((bound <= BOUND_CEILING[torch.bfloat16] * torch.clamp(whole.logit.abs(), min=1.0)).all())


REMOTE = ["gpt_oss", "cohere2_moe"]  # own gating and biases; a scale given by a function of the config


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    import secrets

    from dla_recipes.testing import tiny
    from dla_recipes.testing.loopback import LoopbackServer

    root = tmp_path_factory.mktemp("served_layouts")
    folders = {}
    for family in REMOTE:
        tiny.build(family).save_pretrained(root / family)
        tiny.tokenizer().save_pretrained(root / family)
        folders[family] = str(root / family)
    with LoopbackServer(folders, api_key=secrets.token_hex(16), forked=True) as running:
        yield running


@pytest.mark.parametrize("by", ["expert", "neuron"])
@pytest.mark.parametrize("family", REMOTE)
@pytest.mark.server
def test_remote_layouts_equal_local(server, family, by):
    """The layout (its gating method name, its scale function) travels by value; the server has no dla_recipes.

    nnterp checks a remote model's renaming with a fake-tensor scan only (no dispatch), which the float32 CPU
    grouped_mm experts kernel fails (a LoadError says so); the check is skipped here."""
    remote_model = server.remote_model(family, check_renaming=False)
    local_model = server.local_model(family)
    with server.client():
        remote = dla_recipes.attribute(remote_model, PROMPTS, TARGET, contrast=CONTRAST, by=by, remote=True)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        local = dla_recipes.attribute(local_model, PROMPTS, TARGET, contrast=CONTRAST, by=by)
    finally:
        torch.set_num_threads(before)
    assert remote.labels == local.labels
    # the same code in two processes: within both forwards' rounding of each row's logit (attribution_bound)
    assert_rows_within(local_model, remote, local, targets_of(local_model, local), (family, by))
    assert remote.error <= 1e-4 * max(1.0, float(remote.logit.abs().max()))


def test_falcon_h1_readers_sum_to_the_block_output():
    """The mixer, the attention (config multipliers) and the MLP (a config list item) add up to the block's output."""
    model = tiny_model("falcon_h1")
    with torch.no_grad(), model.trace(PROMPTS):
        x = dla_recipes.trace.layer_input(model, 1).save()
        mixer = dla_recipes.trace.term_output(model, 1, "mixer").save()
        attention = dla_recipes.trace.attention_output(model, 1).save()
        mlp = dla_recipes.trace.mlp_output(model, 1).save()
        out = dla_recipes.trace.layer_output(model, 1).save()
    # the model's adds and ours, each a float32 sum of the four in some order: bounds.sum_bound (gamma_4 of their |terms|) each side
    terms = torch.stack([x, mixer, attention, mlp])
    assert bool(((x + mixer + attention + mlp - out).abs() <= 2 * bounds.sum_bound(terms, dim=0)).all())
