"""Models in bfloat16 / float16: the attribution is accumulated in float32, a slice of a weight at a time.

A bfloat16 model on NDIF must not make the recipe hold a float32 copy of a whole ``[d_mlp, d_model]`` matrix.
``matmul_f32`` converts a bounded slice of rows at a time; these tests check it against the plain float32
product, and check a whole bfloat16 attribution against the model's own logit (a plain bfloat16 forward of each
prompt alone), within what measurement found.
"""

import pytest
import torch
from conftest import BOUND_CEILING, CONTRAST, PROMPTS, TARGET, own_ratio
from test_positions import assert_rows_within, targets_of

import dla_recipes
from dla_recipes.math import linalg
from dla_recipes.testing import tiny


@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_matmul_f32_matches_the_float32_product(dtype, transpose, monkeypatch):
    torch.manual_seed(0)
    weight = torch.randn(37, 23).to(dtype)
    x = torch.randn(3, 23 if transpose else 37)
    monkeypatch.setattr(linalg, "CHUNK_ELEMENTS", 50)  # slices of 2 rows: many of them
    expected = x @ weight.float().T if transpose else x @ weight.float()
    torch.testing.assert_close(linalg.matmul_f32(x, weight, transpose), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", ["llama", "mixtral", "gpt2"])
def test_bfloat16_model_is_attributed_in_float32(family, monkeypatch):
    model = dla_recipes.load(tiny.build(family).to(torch.bfloat16), tokenizer=tiny.tokenizer(), device_map="cpu")
    whole = dla_recipes.attribute(model, PROMPTS, TARGET, contrast=CONTRAST, by="neuron")
    monkeypatch.setattr(linalg, "CHUNK_ELEMENTS", 64)  # the same, a few rows of each weight at a time
    sliced = dla_recipes.attribute(model, PROMPTS, TARGET, contrast=CONTRAST, by="neuron")
    assert whole.values.dtype == torch.float32
    # the same float32 products in chunks of rows (another blocking): within a forward's rounding of each row's
    # logit, both sides (test_positions.attribution_bound, of the bfloat16 forward: the looser of the two)
    assert_rows_within(model, sliced, whole, targets_of(model, whole), family)
    # the parts sum to the model's own bfloat16 logit, a plain forward of each prompt alone: within two forwards'
    # rounding (conftest.own_ratio; measured before: 2.2e-3 of max(1, |logit|) at most, seeds 0-2)
    assert own_ratio(model, whole) <= 1
    # the bound the self-check allowed stays a bound, not a blank cheque (measured at most 0.0177 here)
    assert bool((whole.diagnostics["bound"] <= BOUND_CEILING[torch.bfloat16] * torch.clamp(whole.logit.abs(), min=1.0)).all())


def test_the_error_is_shown_with_its_bound_and_dtype():
    """A bfloat16 attribution's visible gap comes with the bound it was checked against and the dtype, in the repr
    (the bound of the prompt the error is measured on), from attribute and from trace_attribution alike."""
    model = dla_recipes.load(tiny.build("llama").to(torch.bfloat16), tokenizer=tiny.tokenizer(), device_map="cpu")
    attr = dla_recipes.attribute(model, PROMPTS, TARGET, contrast=CONTRAST)
    with torch.no_grad(), model.trace() as tracer:
        with tracer.invoke(PROMPTS):
            pass
        dla = dla_recipes.trace_attribution(tracer, TARGET, contrast=CONTRAST)
    for result in (attr, dla.result()):
        assert result.dtype == "bfloat16"
        worst = int((result.total - result.logit).abs().argmax())
        bound = float(result.diagnostics["bound"][worst])
        assert f"error {result.error:.2e} (bound {bound:.2e}, bfloat16))" in repr(result), repr(result)
    float32 = dla_recipes.attribute(tiny.standardized("llama"), PROMPTS, TARGET)
    assert repr(float32).endswith(", float32))") and float32.dtype == "float32"
