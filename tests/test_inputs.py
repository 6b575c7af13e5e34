"""Bad input gets a clear error that names the problem, before any forward pass."""

import time

import numpy as np
import pytest
import torch
from conftest import PROMPTS, TARGET, tiny_model

import dla_recipes
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


def test_granularity_error_is_an_input_error_with_a_suggestion(model):
    with pytest.raises(InputError, match=r"by='heads' is not a granularity: .*\(did you mean 'head'\?\)"):
        dla_recipes.attribute(model, PROMPTS, TARGET, by="heads")
    with pytest.raises(InputError, match=r"by='neurons'.*did you mean 'neuron'"):
        dla_recipes.attribute_direction(model, PROMPTS, torch.ones(64), layer=1, by="neurons")


def test_expert_granularity_needs_experts(model):
    with pytest.raises(InputError, match=r"by='expert': this llama model has no routed experts"):
        dla_recipes.attribute(model, PROMPTS, TARGET, by="expert")


def test_direction_arguments_are_checked(model):
    with pytest.raises(InputError, match=r"layer is a float"):
        dla_recipes.attribute_direction(model, PROMPTS, torch.ones(64), layer=1.0)
    with pytest.raises(InputError, match=r"batch_size=0"):
        dla_recipes.attribute_direction(model, PROMPTS, torch.ones(64), layer=1, batch_size=0)
    with pytest.raises(InputError, match=r"prompts is None"):
        dla_recipes.attribute_direction(model, None, torch.ones(64), layer=1)
    attr = dla_recipes.attribute_direction(model, tuple(PROMPTS), torch.ones(64), layer=np.int64(1), batch_size=np.int64(2))
    assert attr.values.shape[0] == len(PROMPTS)


def test_load_refuses_meta_and_unknown_dtypes(model):
    hf = model._module
    with pytest.raises(InputError, match=r"device_map='meta' builds the model without weights.*device_map='cpu'"):
        dla_recipes.load(hf, tokenizer=model.tokenizer, device_map="meta")
    with pytest.raises(InputError, match=r"dtype 'bf17' is not a dtype: use float32 \(fp32\), bfloat16 \(bf16\)"):
        dla_recipes.load(hf, tokenizer=model.tokenizer, dtype="bf17")
    assert dla_recipes.inputs.check_dtype("bf16") is torch.bfloat16
    assert dla_recipes.inputs.check_dtype("fp16") is torch.float16 and dla_recipes.inputs.check_dtype("float32") is torch.float32


def test_load_fails_fast_on_a_missing_folder_or_an_offline_hub(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    start = time.monotonic()
    with pytest.raises(InputError, match=r"model '/no/such/folder' is not a local folder: give an existing model folder or a short name \(.*smollm2"):
        dla_recipes.load("/no/such/folder")
    with pytest.raises(InputError, match=r"model 'someorg/not-cached' is not a local folder and the Hugging Face hub is offline"):
        dla_recipes.load("someorg/not-cached")
    (tmp_path / "weights.bin").write_bytes(b"0")
    with pytest.raises(InputError, match=r"is a file: give the folder"):
        dla_recipes.load(tmp_path / "weights.bin")
    assert time.monotonic() - start < 10  # no hub retries


def test_a_plain_transformers_model_without_a_tokenizer_says_to_call_load(model):
    with pytest.raises(InputError, match=r"dla_recipes.load\(hf_model, tokenizer=...\)"):
        dla_recipes.attribute(model._module, PROMPTS, TARGET)
    with pytest.raises(InputError, match=r"has no tokenizer name or folder: load\(model, tokenizer=...\)"):
        dla_recipes.load(model._module)


def test_a_folder_or_a_transformers_model_from_it_is_loaded_for_the_user(model, tmp_path):
    from transformers import AutoModelForCausalLM

    folder = tmp_path / "tiny-llama"
    model._module.save_pretrained(folder)
    model.tokenizer.save_pretrained(folder)
    reference = dla_recipes.attribute(model, PROMPTS, TARGET)
    by_folder = dla_recipes.attribute(str(folder), PROMPTS, TARGET)
    by_path = dla_recipes.attribute(folder, PROMPTS, TARGET)  # a pathlib.Path: the cached load is reused
    hf = AutoModelForCausalLM.from_pretrained(folder)
    by_hf = dla_recipes.attribute(hf, PROMPTS, TARGET)
    for attr in (by_folder, by_path, by_hf):
        torch.testing.assert_close(attr.values, reference.values, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(attr.logit, reference.logit, atol=1e-5, rtol=1e-5)
    assert dla_recipes.inputs.check_model(hf) is dla_recipes.inputs.check_model(hf)  # wrapped once
    with pytest.raises(InputError, match=r"attribute\(\) loads only local folders: load the model once with model = dla_recipes.load\('HuggingFaceTB/x'\)"):
        dla_recipes.attribute("HuggingFaceTB/x", PROMPTS, TARGET)


def test_an_nnsight_language_model_is_loaded_for_the_user(model):
    import nnsight

    from dla_recipes.testing import tiny

    lm = nnsight.LanguageModel(tiny.build("llama"), tokenizer=tiny.tokenizer())  # same seed: the same weights
    attr = dla_recipes.attribute(lm, PROMPTS, TARGET)
    reference = dla_recipes.attribute(model, PROMPTS, TARGET)
    torch.testing.assert_close(attr.values, reference.values, atol=1e-5, rtol=1e-5)
