"""A call's preparation kept for the same question (``transport.memo``) serves that question only, and a call that
takes it gives the numbers a call that prepares anew gives, bit for bit, and the model's own logit.

What ``attribute`` prepares before its trace (the prompts tokenized and padded, the tokens resolved, the positions
placed, the batches and the result's layout) is kept per plan, keyed on the host by the arguments and the
tokenizer's state. Each test changes one thing the key must see and checks that the call is prepared anew and
right: another prompt, target, contrast, position (``-1`` and ``[-1]`` give results of other shapes), batch size,
a token added to the tokenizer, its padding side flipped on a padded batch; that a call that warned warns again;
that arguments the key cannot describe (a tensor target, token-id prompts) are never kept; and that at most
``CALLS`` preparations are kept.
"""

from __future__ import annotations

import pytest
import torch
from conftest import CONTRAST, PROMPTS, TARGET, assert_parts_are_the_models

import dla_recipes
from dla_recipes.plan import build_plan
from dla_recipes.question import Fast
from dla_recipes.testing import tiny
from dla_recipes.transport import memo, spacing


@pytest.fixture
def model():
    """A fresh tiny Llama (some tests edit its tokenizer)."""
    return tiny.standardized("llama")


@pytest.fixture
def recalls(monkeypatch) -> list:
    """Each ``memo.recall``'s answer: the preparation found (or None)."""
    seen: list = []
    original = memo.recall

    def spy(plan, key):
        found = original(plan, key)
        seen.append(found)
        return found

    monkeypatch.setattr(memo, "recall", spy)
    return seen


def kept(model) -> dict:
    return dict(memo._KEPT.get(build_plan(model), {}))


def fresh(model, monkeypatch, *args, **kwargs):
    """The same call prepared anew, nothing kept."""
    return dla_recipes.attribute(model, *args, fast=Fast(memo=False), **kwargs)


def same(a, b) -> None:
    a, b = getattr(a, "sites", a), getattr(b, "sites", b)
    for field in ("values", "constant", "logit"):
        x, y = getattr(a, field), getattr(b, field)
        assert x.shape == y.shape and torch.equal(x, y), (field, tuple(x.shape), tuple(y.shape))
    assert a.labels == b.labels and a.prompts == b.prompts and a.target_tokens == b.target_tokens


@pytest.mark.parametrize("by", ["block", "head", "neuron"])
def test_the_same_question_takes_its_preparation_and_the_same_numbers(model, monkeypatch, recalls, by):
    first = dla_recipes.attribute(model, PROMPTS, TARGET, contrast=CONTRAST, by=by)
    again = dla_recipes.attribute(model, PROMPTS, TARGET, contrast=CONTRAST, by=by)
    assert recalls[0] is None and recalls[1] is not None  # the second call found the first's batches
    same(again, first)
    same(again, fresh(model, monkeypatch, PROMPTS, TARGET, contrast=CONTRAST, by=by))
    assert_parts_are_the_models(model, again, PROMPTS, f"memo {by}")  # against a plain forward of each prompt


def test_another_granularity_shares_the_preparation(model, monkeypatch, recalls):
    dla_recipes.attribute(model, PROMPTS, TARGET, contrast=CONTRAST, by="block")
    heads = dla_recipes.attribute(model, PROMPTS, TARGET, contrast=CONTRAST, by="head")
    assert recalls[1] is not None
    same(heads, fresh(model, monkeypatch, PROMPTS, TARGET, contrast=CONTRAST, by="head"))


CHANGES = {
    "prompts": {"prompts": ["w5 w6 w7", "w11 w12", "w13 w14 w15 w16"]},
    "one prompt fewer": {"prompts": PROMPTS[:2]},
    "target": {"target": "w30"},
    "target id": {"target": 30},
    "contrast": {"contrast": "w22"},
    "no contrast": {"contrast": None},
    "mean contrast": {"contrast": "mean"},
    "one target per prompt": {"target": ["w20", "w30", "w40"]},
    "position": {"position": -2},
    "a list of one position": {"position": [-1]},
    "a slice": {"position": slice(-2, None)},
    "all positions": {"position": "all"},
    "next tokens": {"target": "next", "contrast": None, "position": "all"},
    "batch size": {"batch_size": 1},
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_a_changed_argument_is_prepared_anew(model, monkeypatch, recalls, change):
    base = {"prompts": PROMPTS, "target": TARGET, "contrast": CONTRAST, "position": -1, "batch_size": None}
    dla_recipes.attribute(model, base.pop("prompts"), **base)
    args = {"prompts": PROMPTS, "target": TARGET, "contrast": CONTRAST, "position": -1, "batch_size": None,
            **CHANGES[change]}
    prompts = args.pop("prompts")
    changed = dla_recipes.attribute(model, prompts, **args)
    assert recalls[-1] is None, change  # not the first call's preparation
    same(changed, fresh(model, monkeypatch, prompts, **args))
    again = dla_recipes.attribute(model, prompts, **args)  # ... and now its own, kept
    assert recalls[-1] is not None, change
    same(again, changed)


def test_a_prompt_list_edited_in_place_is_a_new_question(model, monkeypatch, recalls):
    prompts = list(PROMPTS)
    dla_recipes.attribute(model, prompts, TARGET, contrast=CONTRAST)
    prompts[1] = "w11 w12 w40"
    edited = dla_recipes.attribute(model, prompts, TARGET, contrast=CONTRAST)
    assert recalls[-1] is None and edited.prompts[1] == "w11 w12 w40"
    assert_parts_are_the_models(model, edited, prompts, "edited prompts")


def test_a_token_added_to_the_tokenizer_is_seen(model, monkeypatch, recalls):
    """An added token may tokenize a prompt otherwise: the tokenizer's length is in the key (the token added here is
    in none of the prompts, as the tiny vocabulary fills the model's embedding)."""
    dla_recipes.attribute(model, PROMPTS, TARGET, contrast=CONTRAST)
    model.tokenizer.add_tokens(["zzz"])
    again = dla_recipes.attribute(model, PROMPTS, TARGET, contrast=CONTRAST)
    assert recalls[-1] is None and len(kept(model)) == 2  # the tokenizer's length changed: prepared anew
    same(again, fresh(model, monkeypatch, PROMPTS, TARGET, contrast=CONTRAST))


@pytest.mark.parametrize("side", ["left", "right"])
def test_a_flipped_padding_side_is_seen(model, monkeypatch, recalls, side):
    """The prompts have other lengths: the batch is padded, and the positions follow the padding side."""
    model.tokenizer.padding_side = "right" if side == "left" else "left"
    first = dla_recipes.attribute(model, PROMPTS, TARGET, contrast=CONTRAST, by="head")
    model.tokenizer.padding_side = side
    flipped = dla_recipes.attribute(model, PROMPTS, TARGET, contrast=CONTRAST, by="head")
    assert recalls[-1] is None
    padded = kept(model)
    assert len(padded) == 2  # one preparation per padding side
    masks = {key[-1][2]: prep[0][0].encoding["attention_mask"] for key, prep in padded.items()}
    assert not torch.equal(masks["left"], masks["right"])
    assert_parts_are_the_models(model, flipped, PROMPTS, f"padded on the {side}")
    assert_parts_are_the_models(model, first, PROMPTS, "padded on the other side")


def test_a_call_that_warned_warns_again(model, monkeypatch, recalls):
    """The tiny tokenizer has no spaced forms: ``spaced_id`` is made to name one, so "w20" warns."""
    monkeypatch.setattr(spacing, "spaced_id", lambda tokenizer, word: 99 if word == "w20" else None)
    for _ in range(2):
        with pytest.warns(UserWarning, match="'w20' has no leading space"):
            dla_recipes.attribute(model, PROMPTS, TARGET, contrast=CONTRAST)
    assert recalls == [None, None] and not kept(model)
    dla_recipes.attribute(model, PROMPTS, "w30", contrast=CONTRAST)  # no warning: kept
    assert len(kept(model)) == 1


def test_true_is_not_the_id_1(model):
    """``True == 1`` and ``hash(True) == hash(1)``: a key of values alone would hand the id's preparation to a bool,
    which ``attribute`` refuses."""
    dla_recipes.attribute(model, PROMPTS, 1)
    with pytest.raises(dla_recipes.InputError, match="target is a bool"):
        dla_recipes.attribute(model, PROMPTS, True)


@pytest.mark.parametrize("what", ["tensor target", "numpy id", "token-id prompts", "weighted set", "top token"])
def test_what_the_key_cannot_describe_is_never_kept(model, recalls, what):
    import numpy as np

    ids = [[5, 6, 7, 8, 9, 10], [11, 12], [13, 14, 15, 16]]
    prompts, target = {
        "tensor target": (PROMPTS, torch.tensor([20, 20, 20])),
        "numpy id": (PROMPTS, np.int64(20)),
        "token-id prompts": (ids, TARGET),
        "weighted set": (PROMPTS, {"w20": 1.0, "w30": 0.5}),
        "top token": (PROMPTS, None),
    }[what]
    for _ in range(2):
        dla_recipes.attribute(model, prompts, target)
    assert all(found is None for found in recalls) and not kept(model), what


def test_at_most_calls_preparations_are_kept(model, monkeypatch):
    monkeypatch.setattr(memo, "CALLS", 3)
    for k in range(5):
        dla_recipes.attribute(model, PROMPTS, f"w{20 + k}")
    targets = [key[1] for key in kept(model)]
    assert targets == [("str", "w22"), ("str", "w23"), ("str", "w24")]  # the most recently asked
