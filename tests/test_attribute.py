"""Foundation: per-block DLA sums exactly to the model's own logit on GPT-2, Llama, Gemma and Cohere tiny models.

Each model has every constant-initialised parameter perturbed. The logit the parts sum to is checked against a
plain transformers forward of each prompt on its own (no nnsight, no dla_recipes arithmetic).
"""

import pytest
import torch
from conftest import CONTRAST, PROMPTS, TARGET, plain_logits, tiny_model, tolerance
from test_positions import assert_rows_within, attribution_bound, batch_ratio, targets_of

import dla_recipes

FOUNDATION = ["gpt2", "llama", "gemma", "cohere"]


@pytest.mark.parametrize("family", FOUNDATION)
@pytest.mark.parametrize("position", [-1, -2, 0, 1])
@pytest.mark.parametrize("contrast", [None, CONTRAST])
def test_block_attribution_is_exact(family, position, contrast):
    model = tiny_model(family)
    attr = dla_recipes.attribute(model, PROMPTS, TARGET, contrast=contrast, position=position)
    assert attr.values.shape == (len(PROMPTS), 1 + 2 * model.num_layers)
    assert attr.labels[:3] == ["embed", "L0.attn", "L0.mlp"]
    gaps = (attr.values.sum(-1) + attr.constant - attr.logit).abs()
    assert bool((gaps <= tolerance(attr.logit)).all()), gaps
    assert attr.error == pytest.approx(float(gaps.max()))
    # the logit the parts sum to is the model's own: a plain forward of each prompt, unpadded
    target = model.tokenizer.convert_tokens_to_ids(TARGET)
    other = model.tokenizer.convert_tokens_to_ids(CONTRAST)
    for i, prompt in enumerate(PROMPTS):
        logits = plain_logits(model, prompt)
        length = logits.shape[0]
        own = position % length
        expected = logits[own, target] - (logits[own, other] if contrast else 0.0)
        assert float(attr.logit[i]) == pytest.approx(float(expected), abs=1e-4 * max(1.0, abs(float(expected))))


@pytest.mark.parametrize("family", FOUNDATION)
def test_batch_rows_equal_single_prompt_runs(family):
    """Padding never shifts a prompt: each row of a padded batch equals the prompt attributed alone."""
    model = tiny_model(family)
    batch = dla_recipes.attribute(model, PROMPTS, TARGET, contrast=CONTRAST)
    for i, prompt in enumerate(PROMPTS):
        alone = dla_recipes.attribute(model, prompt, TARGET, contrast=CONTRAST)
        # both forwards' rounding of the row's logit (test_positions.attribution_bound, bounds.py's model)
        assert_rows_within(model, batch[i], alone, targets_of(model, alone), (family, i))


def test_one_target_per_prompt():
    model = tiny_model("llama")
    targets = ["w20", "w30", "w40"]
    attr = dla_recipes.attribute(model, PROMPTS, targets)
    for i, target in enumerate(targets):
        single = dla_recipes.attribute(model, PROMPTS[i], target)
        assert_rows_within(model, attr[i], single, targets_of(model, single), i)  # both forwards' rounding
    assert attr.target_tokens == tuple(targets)


def test_token_ids_and_strings_agree():
    model = tiny_model("gpt2")
    by_string = dla_recipes.attribute(model, PROMPTS, TARGET)
    by_id = dla_recipes.attribute(model, PROMPTS, model.tokenizer.convert_tokens_to_ids(TARGET))
    torch.testing.assert_close(by_string.values, by_id.values)


def test_contrast_is_the_difference_of_two_attributions():
    model = tiny_model("cohere")
    diff = dla_recipes.attribute(model, PROMPTS, TARGET, contrast=CONTRAST)
    a = dla_recipes.attribute(model, PROMPTS, TARGET)
    b = dla_recipes.attribute(model, PROMPTS, CONTRAST)
    # one forward, read along three directions: each read within its own rounding of its logit (attribution_bound
    # is two forwards' of a row: half of each), the difference of two reads within both of theirs
    limit = (attribution_bound(model, diff, targets_of(model, diff)) + attribution_bound(model, a, targets_of(model, a))
             + attribution_bound(model, b, targets_of(model, b))) / 2
    assert batch_ratio(diff.values, a.values - b.values, limit) <= 1
    assert batch_ratio(diff.logit, a.logit - b.logit, limit) <= 1


def test_attribution_views():
    model = tiny_model("llama")
    attr = dla_recipes.attribute(model, PROMPTS, TARGET, by="head")
    top = attr.top(3, prompt=1)
    assert list(top.columns) == ["component", "value", "share"]
    assert len(top) == 3 and top["value"].abs().is_monotonic_decreasing
    frame = attr.to_frame()
    assert list(frame.index[:2]) == ["embed", "L0.H0"] and frame.shape == (len(attr.labels) + 2, len(PROMPTS))
    grid = attr.grid("H")
    assert grid.shape == (len(PROMPTS), model.num_layers, model.num_heads)
    assert float(grid[0, 0, 0]) == float(attr.values[0, attr.labels.index("L0.H0")])
    assert "error" in repr(attr)
