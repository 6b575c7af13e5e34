"""Bad input gets a clear error that names the problem, before any forward pass."""

import time

import numpy as np
import pytest
import torch
from conftest import PROMPTS, TARGET, tiny_model
from test_positions import assert_rows_within, targets_of

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

    with pytest.raises(UnknownFamilyError, match=r"no family entry for model_type 'bert'.*dla_recipes/families/"):
        dla_recipes.families.family_of(BertConfig())


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
    assert dla_recipes.args.check_dtype("bf16") is torch.bfloat16
    assert dla_recipes.args.check_dtype("fp16") is torch.float16 and dla_recipes.args.check_dtype("float32") is torch.float32


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
        # the same weights loaded again (its attention implementation may differ): both forwards' rounding
        assert_rows_within(model, attr, reference, targets_of(model, reference))
    assert dla_recipes.loading.load.as_standardized(hf) is dla_recipes.loading.load.as_standardized(hf)  # wrapped once
    with pytest.raises(InputError, match=r"attribute\(\) loads only local folders: load the model once with model = dla_recipes.load\('HuggingFaceTB/x'\)"):
        dla_recipes.attribute("HuggingFaceTB/x", PROMPTS, TARGET)


def test_an_nnsight_language_model_is_loaded_for_the_user(model):
    import nnsight

    from dla_recipes.testing import tiny

    lm = nnsight.LanguageModel(tiny.build("llama"), tokenizer=tiny.tokenizer())  # same seed: the same weights
    attr = dla_recipes.attribute(lm, PROMPTS, TARGET)
    reference = dla_recipes.attribute(model, PROMPTS, TARGET)
    assert_rows_within(model, attr, reference, targets_of(model, reference))  # both forwards' rounding of the logit


# -- a dataset's targets: every bad one in one error, by its prompt's index; an unspaced word warned about ---------


def test_every_bad_target_and_contrast_is_named_with_its_prompt_in_one_error(model):
    prompts = PROMPTS + ["w1 w2", "w3"]
    with pytest.raises(InputError) as caught:
        dla_recipes.attribute(model, prompts, ["w20", "Paris", "w3 w4", "Paris", "w20"],
                              contrast=["w21", "w21", "w21", 999, "w5 w6"])
    message = str(caught.value)
    assert message.startswith("4 bad tokens, each after the prompts it was given for; fix them all:\n"), message
    lines = message.splitlines()[1:]
    assert lines == [
        "  prompts 1, 3: target 'Paris' is not in the vocabulary (the tokenizer maps it to '[UNK]')",
        ("  prompt 2: target 'w3 w4' is 2 tokens ['w3', 'w4'], not one: attribute one token (e.g. 'w3') or pass a "
        "token id"),
        "  prompt 3: contrast token id 999 is not in the vocabulary (ids 0..127)",
        ("  prompt 4: contrast 'w5 w6' is 2 tokens ['w5', 'w6'], not one: attribute one token (e.g. 'w5') or pass a "
        "token id"),
    ], message


def test_one_bad_target_for_all_prompts_says_so_once(model):
    with pytest.raises(InputError, match=r"^all 3 prompts: target 'Paris' is not in the vocabulary"):
        dla_recipes.attribute(model, PROMPTS, "Paris")
    with pytest.raises(InputError, match=r"^prompt 0: target 'Paris' is not in the vocabulary"):
        dla_recipes.attribute(model, PROMPTS[:1], "Paris")


# mamba is padding-unsafe: its prompts (6, 2 and 4 tokens) run one batch each without batch_size
@pytest.mark.parametrize("family, batch_size", [("llama", 1), ("mamba", None)])
def test_errors_name_the_users_prompt_index_whatever_the_batches(family, batch_size):
    model = tiny_model(family)
    with pytest.raises(InputError, match=r"^prompt 2: target 'w3 w4' is 2 tokens"):
        dla_recipes.attribute(model, PROMPTS, ["w20", "w21", "w3 w4"], batch_size=batch_size)
    with pytest.raises(InputError, match=r"position -3 is outside prompt 1 \('w11 w12'\), which has 2 tokens"):
        dla_recipes.attribute(model, PROMPTS, TARGET, position=-3, batch_size=batch_size)


def test_trace_attribution_names_every_bad_target_too(model):
    bad = r"^2 bad tokens.*\n  prompt 0: target 'Paris'.*\n  prompt 2: target 'w3 w4'"
    with pytest.raises(InputError, match=bad), model.trace(PROMPTS) as tracer:
        dla_recipes.trace_attribution(tracer, ["Paris", "w20", "w3 w4"])


class _Stub:
    """Just what ``prepare`` reads of a model: its tokenizer, vocabulary size and config (GPT-2's)."""

    def __init__(self):
        from transformers import GPT2Config

        from dla_recipes import models

        self.tokenizer = models.gpt2_tokenizer()
        self.tokenizer.pad_token = self.tokenizer.eos_token
        self.config = GPT2Config()
        self.vocab_size = self.config.vocab_size


def test_an_unspaced_word_is_attributed_as_given_with_a_warning():
    """GPT-2's byte-level BPE: "Paris" (40313) and " Paris" (6342) are both single tokens."""
    import warnings

    from dla_recipes.transport.batches import prepare

    stub = _Stub()
    prompts = ["The Eiffel Tower is in the city of", "I live in", "Visit\n"]
    with pytest.warns(UserWarning) as caught:
        batch = prepare(stub, prompts, "Paris", contrast="London")
    assert batch.targets.ids[:, 0].tolist() == [40313] * 3 and batch.target_tokens == ("Paris",) * 3  # as given
    assert [str(w.message) for w in caught] == [
        ("target 'Paris' has no leading space, but ' Paris' is one token too (id 6342), the one a model usually "
        "predicts after a word, and prompts 0, 1 do not end in a space. Attributing 'Paris' (id 40313) as given: "
        "pass ' Paris' for the spaced word, or the id 40313 to keep 'Paris' without this warning"),
        ("contrast 'London' has no leading space, but ' London' is one token too (id 3576), the one a model usually "
        "predicts after a word, and prompts 0, 1 do not end in a space. Attributing 'London' (id 23421) as given: "
        "pass ' London' for the spaced word, or the id 23421 to keep 'London' without this warning"),
    ]
    assert caught[0].filename == __file__  # the warning points at the caller's line, not into the package
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        prepare(stub, prompts, " Paris")  # spaced: the usual case
        prepare(stub, prompts, 40313)  # an id: on purpose
        prepare(stub, ["The city of "], "Paris")  # after a space the unspaced token is the natural one
        prepare(stub, prompts, ",")  # not a word: ' ,' is a token too, but ',' after a word is usual


def test_a_word_of_several_tokens_suggests_its_spaced_single_token():
    from dla_recipes.transport.batches import prepare

    with pytest.raises(InputError, match=r"^all 2 prompts: target 'Rome' is 2 tokens \['R', 'ome'\], not one: attribute "
                                         r"one token \(' Rome', with its leading space, is one token\) or pass a token id$"):
        prepare(_Stub(), ["The Colosseum is in", "Go to"], "Rome")


def test_the_tiny_word_level_tokenizer_never_warns(model):
    """Its pre-tokenizer drops spaces: " w20" is "w20", the same token, so there is nothing to warn about."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dla_recipes.attribute(model, PROMPTS, TARGET, contrast="w21")
