"""One result for one call, whichever entry point made it: ``attribute``, ``attribute_direction`` and
``trace_attribution`` all build their ``Attribution`` in ``dla_recipes.result.assemble``, so the same call returns
the same diagnostics (the self-check's ``bound``, the split projections' rounding, the fit errors) and the same
components. The components are records (layer, term, part, index, source) the views read; the labels derive from
them and read back to them.
"""

from __future__ import annotations

import pytest
import torch
from conftest import CONTRAST, PROMPTS, TARGET, tiny_model
from test_positions import attribution_bound, batch_ratio, targets_of

import dla_recipes
from dla_recipes.components import Component, parse_label
from dla_recipes.testing import tiny


def _same_diagnostics(a, b):
    assert set(a.diagnostics) == set(b.diagnostics), (sorted(a.diagnostics), sorted(b.diagnostics))
    for key in a.diagnostics:
        x, y = a.diagnostics[key], b.diagnostics[key]
        torch.testing.assert_close(torch.as_tensor(x).float(), torch.as_tensor(y).float(), atol=1e-6, rtol=1e-4,
                                   msg=key)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("by", ["block", "head", "neuron"])
def test_trace_attribution_returns_what_attribute_returns(by, dtype):
    """The same prompts, targets and granularity through ``attribute`` (with an ``intervene=`` that edits nothing:
    both calls may carry an edit, so both have the split terms' ``.edit`` columns) and through ``trace_attribution``
    in a plain trace: the same labels, components, values and diagnostics (keys and numbers), in float32 and
    bfloat16."""
    model = dla_recipes.load(tiny.build("llama").to(dtype), tokenizer=tiny.tokenizer())
    called = dla_recipes.attribute(model, PROMPTS, TARGET, contrast=CONTRAST, by=by, intervene=lambda model: None)
    with torch.no_grad(), model.trace() as tracer:
        with tracer.invoke(PROMPTS):
            pass
        dla = dla_recipes.trace_attribution(tracer, TARGET, contrast=CONTRAST, by=by)
    traced = dla.result()
    assert traced.labels == called.labels and traced.components == called.components
    assert {"bound", "split_rounding", "norm_fit_error", "head_error", "scale"} <= set(traced.diagnostics)
    _same_diagnostics(traced, called)
    # the same forward through two entry points: each row within both forwards' rounding of its logit
    # (test_positions.attribution_bound), the largest gap moved by at most the rows' parts' and logit's
    limit = attribution_bound(model, called, targets_of(model, called))
    assert batch_ratio(traced.values, called.values, limit) <= 1 and batch_ratio(traced.logit, called.logit, limit) <= 1
    assert abs(traced.error - called.error) <= float(limit.max()) * (len(called.labels) + 2)


def test_attribute_direction_has_the_same_diagnostics_keys():
    model = tiny_model("llama")
    direction = torch.randn(model.lm_head.weight.shape[-1], generator=torch.Generator().manual_seed(0))
    logit = dla_recipes.attribute(model, PROMPTS, TARGET, by="head")
    read = dla_recipes.attribute_direction(model, PROMPTS, direction, layer=1, sublayer="mlp", by="head")
    assert set(read.diagnostics) == set(logit.diagnostics)
    assert read.read_by and read.target_tokens == ()


@pytest.mark.parametrize(("family", "by"), [("llama", "head"), ("llama", "neuron"), ("qwen2_moe", "expert"),
                                            ("qwen2_moe", "neuron"), ("jetmoe", "head"), ("llama", "source")])
def test_components_derive_the_labels_and_read_back(family, by):
    """Each column's ``Component`` gives its label; ``parse_label`` reads the label back to the same layer, part,
    index, source and expert; an ``Attribution`` built from labels alone has views equal to the real one's."""
    model = tiny_model(family) if by != "source" else dla_recipes.load(
        tiny.build(family), tokenizer=tiny.tokenizer(), attn_implementation="eager")
    attr = dla_recipes.attribute(model, PROMPTS, TARGET, contrast=CONTRAST, by=by)
    assert [c.label for c in attr.components] == attr.labels
    assert all(isinstance(c, Component) for c in attr.components)
    for component in attr.components:
        back = parse_label(component.label)
        assert back.label == component.label
        assert (back.layer, back.part, back.index, back.source, back.expert) == (
            component.layer, component.part, component.index, component.source, component.expert)
    by_hand = dla_recipes.Attribution(values=attr.values, labels=list(attr.labels), constant=attr.constant,
                                      logit=attr.logit, output_logit=attr.output_logit, error=attr.error, by=by)
    blocks, hand_blocks = attr.blocks(), by_hand.blocks()
    assert blocks.labels == hand_blocks.labels
    torch.testing.assert_close(blocks.values, hand_blocks.values)
    parts = [c for c in attr.components if c.part is not None]
    assert parts, "the granularity split no term"
    if by in ("head", "neuron") and family == "llama":
        torch.testing.assert_close(attr.grid("H" if by == "head" else "N"), by_hand.grid("H" if by == "head" else "N"),
                                   equal_nan=True)
    if by == "source":
        torch.testing.assert_close(attr.sources(), by_hand.sources(), equal_nan=True)
        assert attr.heads().labels == by_hand.heads().labels


def test_a_label_of_no_layer_is_a_whole_term():
    assert parse_label("embed") == Component(None, "embed")
    assert parse_label("L12.mixer") == Component(12, "mixer")
    assert Component(3, "experts", "neuron", 7, expert="shared").label == "L3.shared.N7"


@pytest.mark.parametrize(("family", "by"), [("qwen2_moe", "neuron"), ("qwen2_moe", "expert"), ("llama", "source")])
def test_components_index_iterate_and_label_alike(family, by):
    """A plan's ``Components`` (runs, made when read): indexing, iterating, slicing and the labels agree."""
    from dla_recipes.plan import Components, Sources

    plan = dla_recipes.plan.build_plan(tiny_model(family))
    sources = Sources(3, frozenset({(0, 1), (1, 0)})) if by == "source" else None
    components = plan.components(by, None, sources)
    assert isinstance(components, Components)
    listed = list(components)
    assert len(listed) == len(components) == len(plan.labels(by, None, sources))
    assert [components[j] for j in range(len(components))] == listed == list(components[:])
    assert components[-1] == listed[-1] and components == tuple(listed)
    assert [c.label for c in listed] == components.labels() == plan.labels(by, None, sources)
    with pytest.raises(IndexError):
        components[len(components)]
