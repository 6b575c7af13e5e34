"""A record an earlier call left (``transport.reuse``) is taken only for the same targets and the same weights, and a
call that takes one gives the numbers a call without it gives, bit for bit.

What depends only on the weights and the targets (the head, every term's direction, the pull-backs through ``W_O``
and ``W_down``) is kept per model, keyed on the host by the targets and a stamp of every parameter. Each test edits or
changes what the key must see, then compares ``torch.equal`` against the same call with nothing reused
(``fast=Fast(reuse=False)``): another target, a weight edited in place, a parameter replaced, a weight edited through
``.data`` (which no stamp sees: the self-check fails and the call runs again without the record), a record past its
byte budget; and a call that edits the forward pass takes none (a remote call neither: ``test_remote.py``). ``Reuse.forget`` is watched: it runs
only when a record had gone stale unseen, so a key that let another target's record through would show there (the
self-check then catches the wrong parts, and the call is made again: right numbers, twice the time).
"""

from __future__ import annotations

import pytest
import torch

import dla_recipes
from dla_recipes.question import Fast
from dla_recipes.testing import tiny
from dla_recipes.transport import reuse

PROMPTS = ["w5 w6 w7 w8 w9 w10 w11 w12", "w11 w12 w13", "w13 w14 w15 w16 w17"]  # padded


@pytest.fixture
def model():
    """A fresh tiny Llama (the tests edit its weights)."""
    return tiny.standardized("llama")


@pytest.fixture
def forgets(monkeypatch) -> list:
    """Each ``Reuse.forget`` call (a record found stale after the self-check failed)."""
    seen: list = []
    original = reuse.Reuse.forget

    def spy(self):
        seen.append(self)
        return original(self)

    monkeypatch.setattr(reuse.Reuse, "forget", spy)
    return seen


def attribute(model, target="w20", by="head", **kwargs):
    return dla_recipes.attribute(model, PROMPTS, target, contrast="w21", by=by, **kwargs)


def fresh(model, monkeypatch, target="w20", by="head", **kwargs):
    """The same call with nothing reused (every record made anew, none kept)."""
    return attribute(model, target, by, fast=Fast(reuse=False), **kwargs)


def same(a, b) -> None:
    for field in ("values", "constant", "logit"):
        x, y = getattr(a, field), getattr(b, field)
        assert torch.equal(x, y), (field, float((x - y).abs().max()))


def records(model) -> dict:
    store = reuse._STORES.get(model._module)
    return {} if store is None else dict(store.records)


@pytest.mark.parametrize("by", ["block", "head", "neuron"])
def test_a_record_serves_its_own_targets_only(model, monkeypatch, forgets, by):
    first = attribute(model, "w20", by)
    other = attribute(model, "w30", by)  # another target: another record
    again = attribute(model, "w20", by)  # the first record, taken whole
    assert len(records(model)) == 2 and any(r.served for r in records(model).values())
    same(first, fresh(model, monkeypatch, "w20", by))
    same(other, fresh(model, monkeypatch, "w30", by))
    same(again, first)
    assert not forgets


def test_a_weight_edited_in_place_is_seen(model, monkeypatch, forgets):
    attribute(model)
    with torch.no_grad():
        model._module.model.layers[1].self_attn.o_proj.weight.mul_(1.5)  # raises its version
    edited = attribute(model)
    same(edited, fresh(model, monkeypatch))
    assert not forgets  # the stamp changed: a new record, nothing stale taken


def test_a_replaced_parameter_is_seen(model, monkeypatch, forgets):
    attribute(model, by="neuron")
    mlp = model._module.model.layers[0].mlp
    mlp.down_proj.weight = torch.nn.Parameter(mlp.down_proj.weight.detach() * 2)
    same(attribute(model, by="neuron"), fresh(model, monkeypatch, by="neuron"))
    assert not forgets


def test_an_edit_through_data_is_caught_and_made_anew(model, monkeypatch, forgets):
    """``.data`` has a version of its own: the stamp does not change, the kept pull-backs are stale, the parts do
    not sum to the edited model's logit, and the call runs again without any record: the right numbers."""
    attribute(model)
    model._module.model.layers[1].self_attn.o_proj.weight.data.mul_(3.0)
    edited = attribute(model)
    assert len(forgets) == 1
    same(edited, fresh(model, monkeypatch))


def test_a_record_past_its_budget_is_not_kept(model, monkeypatch, forgets):
    monkeypatch.setattr(reuse, "KEEP_BYTES", 1024)  # below the head's own directions
    result = attribute(model, by="neuron")
    assert not records(model)
    same(result, fresh(model, monkeypatch, by="neuron"))
    same(attribute(model, by="neuron"), result)


def test_a_call_that_edits_the_forward_pass_takes_no_record(model, monkeypatch):
    given = []
    original = reuse.Reuse.for_target
    monkeypatch.setattr(reuse.Reuse, "for_target", lambda self, target: given.append(target) or original(self, target))

    def ablate(m):
        m.layers[0].mlp.output[:] = 0

    attribute(model, intervene=ablate)
    assert not given
    attribute(model)
    assert len(given) == 1


def test_a_module_slot_left_empty_is_walked_past(model, monkeypatch):
    """A submodule slot holding None (``register_module(name, None)``, a bias registered as None) is no tensor."""
    model._module.model.register_module("unused", None)
    attribute(model, by="neuron")
    same(attribute(model, by="neuron"), fresh(model, monkeypatch, by="neuron"))
