"""Bad input gets a clear error that names the problem, before any forward pass."""

import pytest

import dla_recipes
from conftest import PROMPTS, TARGET, tiny_model
from dla_recipes import InputError, UnknownFamilyError


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


def test_multi_token_target(model):
    with pytest.raises(InputError, match=r"'w20 w21' is 2 tokens \['w20', 'w21'\], not one"):
        dla_recipes.attribute(model, PROMPTS, "w20 w21")


def test_target_not_in_vocabulary(model):
    with pytest.raises(InputError, match=r"target 'Paris' is not in the vocabulary"):
        dla_recipes.attribute(model, PROMPTS, "Paris")


def test_target_id_out_of_range(model):
    with pytest.raises(InputError, match=r"target token id 100000 is not in the vocabulary \(ids 0\.\.127\)"):
        dla_recipes.attribute(model, PROMPTS, 100000)


def test_contrast_is_checked_too(model):
    with pytest.raises(InputError, match=r"contrast 'w1 w2' is 2 tokens"):
        dla_recipes.attribute(model, PROMPTS, TARGET, contrast="w1 w2")


def test_position_outside_a_prompt(model):
    with pytest.raises(InputError, match=r"position -3 is outside prompt 1 \('w11 w12'\), which has 2 tokens: use -2\.\.1"):
        dla_recipes.attribute(model, PROMPTS, TARGET, position=-3)
    with pytest.raises(InputError, match=r"position 4 is outside prompt 1"):
        dla_recipes.attribute(model, PROMPTS, TARGET, position=4)


def test_empty_prompt(model):
    with pytest.raises(InputError, match=r"prompt 1 is empty"):
        dla_recipes.attribute(model, ["w1 w2", ""], TARGET)
    with pytest.raises(InputError, match=r"no prompts given"):
        dla_recipes.attribute(model, [], TARGET)


def test_wrong_number_of_targets(model):
    with pytest.raises(InputError, match=r"2 target tokens for 3 prompts"):
        dla_recipes.attribute(model, PROMPTS, ["w1", "w2"])


def test_bad_granularity(model):
    with pytest.raises(ValueError, match=r"by='layer' is not a granularity: use one of 'block', 'head', 'neuron'"):
        dla_recipes.attribute(model, PROMPTS, TARGET, by="layer")


def test_non_integer_position(model):
    with pytest.raises(InputError, match=r"position is a float \(1.5\): pass an integer"):
        dla_recipes.attribute(model, PROMPTS, TARGET, position=1.5)


def test_unknown_family_says_how_to_add_it():
    from transformers import BertConfig

    with pytest.raises(UnknownFamilyError, match=r"no family entry for model_type 'bert'.*dla_recipes/families.py"):
        dla_recipes.family_of(BertConfig())
