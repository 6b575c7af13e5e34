"""The term kinds of issue 12 are load-bearing: a family entry without one of them no longer sums to the model's logit.

Each case drops one field (a computed scalar, a norm on the stream, a post-norm, an output gate, a position
convolution, a learned projection scale) from the terms of the family that needs it, and checks that
``attribute`` refuses with an ``ExactnessError`` rather than return parts that do not sum to the model's own logit.
The same families with the field in place are checked exact in test_families.py.
"""

import dataclasses

import pytest
from conftest import CONTRAST, PROMPTS, TARGET, tiny_model

import dla_recipes
from dla_recipes import families

# The field each case drops, as it was named before Term's records: which record holds it, and its name there.
WHERE = {"multiplier": ("write", "multiplier"), "stream_multiplier": ("stream", "multiplier"),
         "stream_norm": ("stream", "norm"), "stream_norm_after": ("stream", "norm_after"),
         "projection_multiplier": ("split", "projection_multiplier"), "output_gate": ("split", "output_gate"),
         "position_conv": ("split", "position_conv"), "projection_scale": ("split", "projection_scale")}


def drop(term, field):
    """``term`` without ``field`` (None in the record that holds it; unchanged where that record has no such field)."""
    record, name = WHERE[field]
    held = getattr(term, record)
    if held is None or name not in {f.name for f in dataclasses.fields(held)}:
        return term
    return dataclasses.replace(term, **{record: dataclasses.replace(held, **{name: None})})


CASES = [
    ("minicpm3", "minicpm3", "multiplier", "block"),
    ("beam", "beam", "stream_multiplier", "block"),
    ("beam", "beam", "projection_multiplier", "neuron"),
    ("minimax", "minimax", "stream_norm", "block"),
    ("minimax", "minimax", "stream_multiplier", "block"),
    ("rwkv", "rwkv", "stream_norm", "block"),
    ("rwkv", "rwkv", "output_gate", "neuron"),
    ("openai-gpt", "openai_gpt", "stream_norm_after", "block"),
    ("inkling", "inkling", "position_conv", "head"),
    ("inkling", "inkling", "projection_scale", "neuron"),
]


@pytest.mark.parametrize("entry,tiny_name,field,by", CASES)
def test_dropping_a_term_kind_breaks_exactness(entry, tiny_name, field, by, monkeypatch):
    model = tiny_model(tiny_name)
    family = next(f for f in families.FAMILIES if f.name == entry)
    kinds = tuple(
        dataclasses.replace(kind, terms=tuple(drop(t, field) for t in kind.terms))
        for kind in family.kinds
    )
    crippled = dataclasses.replace(family, kinds=kinds)
    monkeypatch.setattr(families.table, "FAMILIES", tuple(crippled if f is family else f for f in families.FAMILIES))
    dla_recipes.plan.build_plan.cache_clear()
    try:
        with pytest.raises(dla_recipes.ExactnessError, match="parts sum to"):
            dla_recipes.attribute(model, PROMPTS, TARGET, contrast=CONTRAST, by=by)
    finally:
        dla_recipes.plan.build_plan.cache_clear()


@pytest.mark.parametrize("model_type", ["dory", "gemma3n_text", "qwen4_exp_text", "inkling2_text", "inkling2_loop_text",
                                        "reformer", "cpmant"])
def test_types_no_term_kind_describes_are_refused_with_the_reason(model_type):
    from types import SimpleNamespace

    reason = families.REFUSED[model_type]
    with pytest.raises(dla_recipes.UnknownFamilyError, match="refuses model_type") as refusal:
        dla_recipes.families.family_of(SimpleNamespace(model_type=model_type))
    assert reason in str(refusal.value)
