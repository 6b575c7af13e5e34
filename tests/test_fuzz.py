"""Fuzzing ``attribute`` with bad and odd input: every call is a correct answer or an ``InputError``, nothing else.

A correct answer is checked against the model's own output: a plain transformers forward of each prompt alone
(``conftest.plain_logits``), at the position and token ids the test computes itself from the tokenizer (so a float
id truncated to an int, or a position that moved, is caught as a wrong answer). Never another exception type, never
a NaN, never a silent wrong answer.

Two parts: ``CASES``, an explicit table (name, arguments, expected outcome), and a seeded random fuzzer drawing
combinations of prompts / targets / contrasts / positions / granularities / batch sizes from valid and invalid pools
on tiny models of four families, whose expected outcome is known from the pools each argument came from.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from conftest import PROMPTS, plain_logits, tiny_model

import dla_recipes
from dla_recipes import InputError

ERROR = "InputError"


@dataclass(frozen=True)
class Ok:
    """A correct answer is expected: these prompts, token ids and position (computed by the test, not the package)."""

    prompts: tuple[str, ...] = tuple(PROMPTS)
    targets: tuple[int, ...] = (20,)  # one id for all prompts, or one per prompt
    contrasts: tuple[int, ...] | None = None
    position: int = -1


@dataclass(frozen=True)
class Case:
    name: str
    kwargs: object  # a dict of attribute() arguments, or a zero-argument callable returning one (generators)
    expect: object  # Ok(...) or ERROR
    family: str = "llama"
    match: str | None = None  # a regex the InputError's message must contain (names the argument and the fix)


def _plain_hf():
    return tiny_model("llama")._module  # a transformers model built from a config: no tokenizer name or folder


LONG = " ".join(["w3"] * 300)  # 300 tokens: past the tiny models' 256 positions

CASES = [
    # --- prompts -----------------------------------------------------------------------------------------------------
    Case("prompts_tuple", {"prompts": tuple(PROMPTS)}, Ok()),
    Case("prompts_generator", lambda: {"prompts": (p for p in PROMPTS)}, Ok()),
    Case("prompts_numpy_strings", {"prompts": np.array(PROMPTS)}, Ok()),
    Case("prompt_with_surrounding_whitespace", {"prompts": ["  w5 w6 w7\n", "\tw11 w12 "]},
         Ok(prompts=("w5 w6 w7", "w11 w12"))),
    Case("prompt_of_special_tokens_only", {"prompts": "[PAD] [UNK]"}, Ok(prompts=("[PAD] [UNK]",))),
    Case("prompt_unicode_and_emoji", {"prompts": ["w5 Zürich 🗼 w6", "日本 w7"]},
         Ok(prompts=("w5 Zürich 🗼 w6", "日本 w7"))),
    Case("batch_mixing_lengths", {"prompts": ["w1", " ".join(f"w{i}" for i in range(2, 40))]},
         Ok(prompts=("w1", " ".join(f"w{i}" for i in range(2, 40))))),
    Case("prompts_none", {"prompts": None}, ERROR, match="prompts is None"),
    Case("prompts_empty_list", {"prompts": []}, ERROR, match="no prompts given"),
    Case("prompt_empty_string", {"prompts": ["w1", ""]}, ERROR, match="prompt 1 is empty"),
    Case("prompt_whitespace_only", {"prompts": "   "}, ERROR, match="no tokens"),
    Case("prompt_bytes", {"prompts": b"w1 w2"}, ERROR, match=r"prompt 0 is bytes.*decode"),
    Case("prompt_bytes_in_list", {"prompts": ["w1", b"w2"]}, ERROR, match=r"prompt 1 is bytes"),
    Case("prompt_none_in_list", {"prompts": ["w1", None]}, ERROR, match=r"prompt 1 is a NoneType"),
    Case("prompt_lone_surrogate", {"prompts": "w1 \ud800 w2"}, ERROR, match=r"lone surrogate"),
    Case("prompts_set", {"prompts": {"w1", "w2"}}, ERROR, match=r"no fixed order"),
    Case("prompts_int", {"prompts": 5}, ERROR, match=r"prompts is a int"),
    Case("prompt_too_long", {"prompts": LONG}, ERROR, match=r"300 tokens, more than this model's 256"),
    Case("prompt_too_long_gpt2", {"prompts": LONG}, ERROR, family="gpt2", match=r"more than this model's 256"),
    # --- target and contrast -----------------------------------------------------------------------------------------
    Case("target_numpy_int64", {"target": np.int64(20)}, Ok()),
    Case("target_numpy_int32", {"target": np.int32(20)}, Ok()),
    Case("target_numpy_0d_array", {"target": np.array(20)}, Ok()),
    Case("target_numpy_array_per_prompt", {"target": np.array([20, 30, 40])}, Ok(targets=(20, 30, 40))),
    Case("target_torch_0d", {"target": torch.tensor(20)}, Ok()),
    Case("target_torch_one_element", {"target": torch.tensor([20])}, Ok()),
    Case("target_torch_per_prompt", {"target": torch.tensor([20, 30, 40])}, Ok(targets=(20, 30, 40))),
    Case("target_list_of_one_id", {"target": [20]}, Ok()),
    Case("target_list_of_one_string", {"target": ["w20"]}, Ok()),
    Case("contrast_equal_to_target", {"target": "w20", "contrast": 20}, Ok(contrasts=(20,))),
    Case("contrast_numpy_per_prompt", {"contrast": np.array([21, 22, 23])}, Ok(contrasts=(21, 22, 23))),
    Case("target_float_tensor", {"target": torch.tensor(20.9)}, ERROR,
         match=r"target is a torch.float32.*never truncated"),
    Case("target_float", {"target": 20.0}, ERROR, match=r"target is a float"),
    Case("target_numpy_float", {"target": np.float64(20)}, ERROR, match=r"target is a float64"),
    Case("target_bool", {"target": True}, ERROR, match=r"target is a bool"),
    Case("target_bytes", {"target": b"w20"}, ERROR, match=r"target is bytes"),
    Case("target_lone_surrogate", {"target": "\udc80"}, ERROR, match=r"lone surrogate"),
    Case("target_dict_weight_not_a_number", {"target": {20: "one"}}, ERROR, match=r"a weight must be a finite number"),
    Case("target_negative_id", {"target": -1}, ERROR, match=r"not in the vocabulary"),
    Case("target_empty_string", {"target": ""}, ERROR, match=r"empty string"),
    Case("target_two_for_three_prompts", {"target": [20, 30]}, ERROR, match=r"2 target tokens for 3 prompts"),
    Case("target_tensor_two_for_three", {"target": torch.tensor([20, 30])}, ERROR, match=r"2 target tokens"),
    Case("contrast_two_tokens", {"contrast": "w1 w2"}, ERROR, match=r"contrast 'w1 w2' is 2 tokens"),
    # --- position ----------------------------------------------------------------------------------------------------
    Case("position_numpy_int", {"position": np.int64(-2)}, Ok(position=-2)),
    Case("position_torch_0d", {"position": torch.tensor(1)}, Ok(position=1)),
    Case("position_first_token_from_the_end", {"prompts": "w11 w12", "position": -2},
         Ok(prompts=("w11 w12",), position=-2)),
    Case("position_beyond_the_start", {"position": -100}, ERROR, match=r"position -100 is outside prompt 0"),
    Case("position_float", {"position": 1.5}, ERROR, match=r"position is a float"),
    Case("position_none", {"position": None}, ERROR, match=r"position=None: give an int, a list of ints"),
    Case("position_empty_list", {"position": []}, ERROR, match=r"position=\[\] is empty"),
    Case("position_word", {"position": "last"}, ERROR, match=r"position='last': give an int"),
    # --- granularity -------------------------------------------------------------------------------------------------
    Case("by_head", {"by": "head"}, Ok()),
    Case("by_neuron", {"by": "neuron"}, Ok()),
    Case("by_expert_on_moe", {"by": "expert"}, Ok(), family="mixtral"),
    Case("by_heads_plural", {"by": "heads"}, ERROR, match=r"did you mean 'head'"),
    Case("by_capitalised", {"by": "Block"}, ERROR, match=r"did you mean 'block'"),
    Case("by_none", {"by": None}, ERROR, match=r"by=None is not a granularity"),
    Case("by_expert_on_dense", {"by": "expert"}, ERROR, match=r"no routed experts"),
    # --- batch_size and tolerance ------------------------------------------------------------------------------------
    Case("batch_size_one", {"batch_size": 1}, Ok()),
    Case("batch_size_numpy", {"batch_size": np.int64(2)}, Ok()),
    Case("batch_size_zero", {"batch_size": 0}, ERROR, match=r"batch_size=0: give a positive int"),
    Case("batch_size_negative", {"batch_size": -3}, ERROR, match=r"batch_size=-3"),
    Case("batch_size_float", {"batch_size": 2.5}, ERROR, match=r"batch_size=2.5"),
    Case("batch_size_string", {"batch_size": "2"}, ERROR, match=r"batch_size='2'"),
    Case("tolerance_loose", {"tolerance": 1e-2}, Ok()),
    Case("tolerance_negative", {"tolerance": -1}, ERROR, match=r"tolerance=-1: give a positive"),
    Case("tolerance_nan", {"tolerance": float("nan")}, ERROR, match=r"tolerance=nan"),
    Case("tolerance_string", {"tolerance": "1e-4"}, ERROR, match=r"tolerance='1e-4'"),
    Case("remote_without_scheme", {"remote": "127.0.0.1:8000"}, ERROR, match=r"remote='127.0.0.1:8000': give True"),
    Case("remote_yes_string", {"remote": "yes"}, ERROR, match=r"server URL starting with http://"),
    # --- model -------------------------------------------------------------------------------------------------------
    Case("model_missing_folder", {"model": "/no/such/model"}, ERROR, match=r"dla_recipes.load\('/no/such/model'\)"),
    Case("model_hub_id", {"model": "someorg/some-model"}, ERROR, match=r"attribute\(\) loads only local folders"),
    Case("model_none", {"model": None}, ERROR, match=r"model is a NoneType.*dla_recipes.load"),
    Case("model_plain_transformers_without_tokenizer", lambda: {"model": _plain_hf()}, ERROR,
         match=r"dla_recipes.load\(hf_model, tokenizer=...\)"),
    Case("model_tokenizer_by_mistake", lambda: {"model": tiny_model("llama").tokenizer}, ERROR,
         match=r"model is a \w+: pass a model loaded with dla_recipes.load"),
]


def _run(model, kwargs: dict):
    kwargs = dict(kwargs)
    prompts = kwargs.pop("prompts", PROMPTS)
    target = kwargs.pop("target", "w20")
    model = kwargs.pop("model", model)
    return dla_recipes.attribute(model, prompts, target, **kwargs)


def check_answer(attr, model, expect: Ok) -> None:
    """The parts sum to the logit, and the logit is a plain forward's at the test's own ids and position."""
    n = len(expect.prompts)
    targets = expect.targets * n if len(expect.targets) == 1 else expect.targets
    contrasts = None if expect.contrasts is None else (
        expect.contrasts * n if len(expect.contrasts) == 1 else expect.contrasts
    )
    assert attr.values.shape[0] == n and len(attr.labels) == attr.values.shape[1]
    assert bool(torch.isfinite(attr.values).all()) and bool(torch.isfinite(attr.logit).all())
    assert bool(torch.isfinite(attr.output_logit).all())
    if dla_recipes.plan.build_plan(model).softcap is None:
        torch.testing.assert_close(attr.logit, attr.output_logit, atol=1e-5, rtol=1e-5)
    gaps = (attr.values.sum(-1) + attr.constant - attr.logit).abs()
    assert bool((gaps <= 1e-4 * attr.logit.abs().clamp(min=1)).all()), gaps
    for i, prompt in enumerate(expect.prompts):
        logits = plain_logits(model, prompt)
        own = expect.position % logits.shape[0]
        expected = logits[own, targets[i]] - (0.0 if contrasts is None else logits[own, contrasts[i]])
        # the model's output logit (after any soft-cap) is the plain forward's; the parts sum to the logit before it
        assert float(attr.output_logit[i]) == pytest.approx(float(expected), abs=1e-4 * max(1.0, abs(float(expected))))
        if contrasts is not None and contrasts[i] == targets[i]:  # a token against itself: exactly 0, every part
            assert float(attr.logit[i]) == 0.0 and bool((attr.values[i] == 0).all())


def test_the_table_has_at_least_40_cases():
    assert len(CASES) >= 40 and len({case.name for case in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_case(case: Case):
    model = tiny_model(case.family)
    kwargs = case.kwargs() if callable(case.kwargs) else case.kwargs
    if case.expect == ERROR:
        with pytest.raises(InputError, match=case.match):
            _run(model, kwargs)
    else:
        check_answer(_run(model, kwargs), model, case.expect)


# ----------------------------------------------------------------------------------------------------------------------
# Seeded random fuzzer: each draw knows whether it is valid, so the outcome is predicted exactly.
# ----------------------------------------------------------------------------------------------------------------------

VALID_PROMPTS = [
    ["w5 w6 w7 w8 w9 w10", "w11 w12", "w13 w14 w15 w16"],
    ["w1 w2 w3"],
    ["  w7 w8  ", "w9"],
    ["w40 🙂 w41", "w42 w43 w44 w45 w46"],
    ["[UNK] w3 w4", "w5", "w6 w7", "w8 w9 w10 w11"],
]
BAD_PROMPTS = [None, [], [""], [b"w1"], ["w1", 3], ["w1 \udfff"], "   "]
BAD_TARGETS = [20.5, torch.tensor(3.0), "w20 w21", 1000, b"w20", "zzz", np.float32(4), [1, 2, 3, 4, 5], True]
BAD_POSITIONS = [1.5, None, 99, -99]
BAD_BY = ["heads", "layer", None]
BAD_BATCH = [0, -1, 2.5, "2"]


def _token(rng: random.Random, n: int):
    """A valid target / contrast in a random form, and the ids it means (one per prompt)."""
    form = rng.choice(["str", "int", "np64", "np32", "t0", "list1", "per_prompt_np", "per_prompt_tensor"])
    ids = [rng.randrange(0, 126) for _ in range(n)]
    one = ids[0]
    value = {
        "str": f"w{one}",
        "int": one,
        "np64": np.int64(one),
        "np32": np.int32(one),
        "t0": torch.tensor(one),
        "list1": [one],
        "per_prompt_np": np.array(ids),
        "per_prompt_tensor": torch.tensor(ids),
    }[form]
    return value, (ids if form.startswith("per_prompt") else [one] * n)


def _draw(rng: random.Random, family: str):
    """Random arguments for ``attribute`` and the expected outcome (``Ok`` or ``ERROR``): all drawn valid, then
    half the draws have one or two arguments spoiled from the invalid pools."""
    prompts = list(rng.choice(VALID_PROMPTS))
    n = len(prompts)
    target, targets = _token(rng, n)
    contrast, contrasts = None, None
    roll = rng.random()
    if roll < 0.35:
        contrast, contrasts = _token(rng, n)
    elif roll < 0.5:
        contrast, contrasts = target, targets  # a contrast equal to the target: 0
    position = rng.choice([-1, -1, 0, -2, 1, np.int64(-1), torch.tensor(0)])
    by = rng.choice(["block", "block", "head", "neuron"] + (["expert", "expert"] if family == "mixtral" else []))
    batch_size = rng.choice([None, None, 1, 2, np.int32(2)])
    spoiled = rng.sample(["prompts", "target", "contrast", "position", "by", "batch_size"], k=rng.choice([1, 1, 2]))
    bad = rng.random() < 0.5
    if bad:
        for name in spoiled:
            if name == "prompts":
                prompts = rng.choice(BAD_PROMPTS)
            elif name == "target":
                target = rng.choice(BAD_TARGETS)
            elif name == "contrast":
                contrast = rng.choice(BAD_TARGETS)
            elif name == "position":
                position = rng.choice(BAD_POSITIONS)
            elif name == "by":
                by = rng.choice(BAD_BY + ([] if family == "mixtral" else ["expert"]))  # no experts on a dense model
            else:
                batch_size = rng.choice(BAD_BATCH)
    kwargs = {"prompts": prompts, "target": target, "contrast": contrast, "position": position, "by": by,
              "batch_size": batch_size}
    if not bad:
        tokenizer = tiny_model(family).tokenizer
        lengths = [len(tokenizer(p)["input_ids"]) for p in prompts]
        if any(not -length <= int(position) < length for length in lengths):
            bad = True  # position outside a prompt
    if bad:
        return kwargs, ERROR
    return kwargs, Ok(tuple(prompts), tuple(targets), None if contrasts is None else tuple(contrasts), int(position))


FUZZ_FAMILIES = ["llama", "gpt2", "gemma2", "mixtral"]
DRAWS_PER_FAMILY = 25
# A padding-unsafe family (its recurrent state reads the pad tokens): attribute runs its prompts grouped by length,
# so each padded-looking batch still gives every prompt its own logit (checked against a plain forward alone).
PADDING_UNSAFE = "recurrent_gemma"


@pytest.mark.parametrize("family", FUZZ_FAMILIES + [PADDING_UNSAFE])
def test_seeded_random_fuzz(family):
    rng = random.Random(f"dla-fuzz-{family}")
    model = tiny_model(family)
    outcomes = {"ok": 0, ERROR: 0}
    for draw in range(DRAWS_PER_FAMILY):
        kwargs, expect = _draw(rng, family)
        where = f"{family} draw {draw}: {kwargs!r}"
        try:
            attr = _run(model, kwargs)
        except InputError:
            assert expect == ERROR, f"{where}: InputError on valid input"
            outcomes[ERROR] += 1
            continue
        except Exception as error:  # any other type is the bug this test hunts
            raise AssertionError(f"{where}: {type(error).__name__}: {error}") from error
        assert expect != ERROR, f"{where}: accepted invalid input"
        check_answer(attr, model, expect)
        assert not math.isnan(attr.error)
        outcomes["ok"] += 1
    assert outcomes["ok"] >= 5 and outcomes[ERROR] >= 5, outcomes  # both sides of the line were exercised
