"""Costs that must not grow with the model: a ``by="neuron"`` plan's labels and component records at Llama-3.1-70B's
shape (80 blocks, d_mlp 28672, 64 heads: ~2.3M neuron labels), built from its config on the meta device (no
weights), and the views of a result that read them, checked by what they create (no per-neuron object until a
label is read; the time they take is ``benchmarks/labels_70b.py``'s); and the lazy ``Labels`` / ``Components`` sequences agreeing
with the eager lists they replace (every label, its index, the run-wise views) on tiny families.
"""

from __future__ import annotations

import pytest
import torch
from conftest import PROMPTS, TARGET, plain_logits, tiny_model, tolerance

from dla_recipes.components import Labels
from dla_recipes.plan import build_plan
from dla_recipes.present.attribution import Attribution
from dla_recipes.result import components_of

# Llama-3.1-70B's shape (config.json of meta-llama/Llama-3.1-70B, the sizes the plan reads).
LLAMA_70B = {"hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64,
             "num_key_value_heads": 8, "vocab_size": 128256}
@pytest.fixture(scope="module")
def llama70b(tmp_path_factory):
    """A StandardizedTransformer of Llama-3.1-70B's shape on the meta device: its config saved to a folder, loaded
    without weights (nnsight builds the model under ``init_empty_weights``)."""
    from transformers import LlamaConfig

    import dla_recipes
    from dla_recipes.testing import tiny

    folder = tmp_path_factory.mktemp("llama70b")
    LlamaConfig(**LLAMA_70B).save_pretrained(folder)
    model = dla_recipes.load(str(folder), tokenizer=tiny.tokenizer(128), check_renaming=False)
    assert model.lm_head.weight.device.type == "meta"
    return model


class Counted:
    """Counts what a block of code creates: ``Component`` records made one at a time (``Component.__new__``: the
    runs' own iterators use ``tuple.__new__`` and are counted apart, through ``Run.components``) and label strings
    (``Component.label``, and each label a ``Labels`` sequence makes: indexed, sliced or iterated), so a test can
    say "no per-neuron object" without timing anything."""

    def __init__(self, monkeypatch):
        from dla_recipes import components

        self.records = self.labels = self.iterated = 0
        new, label, runs = components.Component.__new__, components.Component.label.fget, components.Run.components

        def counted_new(cls, *args, **kwargs):
            self.records += 1
            return new(cls, *args, **kwargs)

        def counted_label(component):
            self.labels += 1
            return label(component)

        def counted_runs(run):
            self.iterated += run.size
            return runs(run)

        getitem, iterate = components.Labels.__getitem__, components.Labels.__iter__

        def counted_getitem(labels, item):
            made = getitem(labels, item)
            self.labels += len(made) if isinstance(item, slice) else 1
            return made

        def counted_iter(labels):
            for label in iterate(labels):
                self.labels += 1
                yield label

        monkeypatch.setattr(components.Labels, "__getitem__", counted_getitem)
        monkeypatch.setattr(components.Labels, "__iter__", counted_iter)
        monkeypatch.setattr(components.Component, "__new__", counted_new)
        monkeypatch.setattr(components.Component, "label", property(counted_label))
        monkeypatch.setattr(components.Run, "components", counted_runs)

    def total(self) -> int:
        return self.records + self.labels + self.iterated


@pytest.mark.slow  # loading the 70B module tree (no weights) takes nnsight ~5-20 s on 2 shared cores
def test_neuron_labels_at_70b_shape_are_made_only_when_read(llama70b, monkeypatch):
    """Building a ``by="neuron"`` plan, its components, labels and an ``Attribution`` at Llama-70B's shape (2.3M
    columns) makes no per-neuron object: no ``Component`` record, no label string, no run iterated (structural;
    the time it takes is ``benchmarks/labels_70b.py``'s). The views that rank or sum every column (top, blocks,
    index, grid) make a number of records and labels bounded by the layers and k, never by the neurons."""
    build_plan.cache_clear()
    layers, d_mlp = LLAMA_70B["num_hidden_layers"], LLAMA_70B["intermediate_size"]
    values = torch.randn(1, 1 + layers * (1 + d_mlp), generator=torch.Generator().manual_seed(0))
    counted = Counted(monkeypatch)
    plan = build_plan(llama70b)
    components = plan.components("neuron")
    labels = plan.labels("neuron")
    cached, cached_labels = components_of(plan, "neuron")
    attr = Attribution(values=values, labels=cached_labels, constant=torch.zeros(1),
                       logit=torch.ones(1), output_logit=torch.ones(1), error=0.0, by="neuron",
                       components=cached)
    n = len(labels)
    built = (counted.records, counted.labels, counted.iterated)
    assert n == len(components) == 1 + layers * (1 + d_mlp)  # embed; each block's attn and neurons (no bias: no rest)
    assert isinstance(labels, Labels) and len(components.runs) <= 1 + 3 * layers, components
    # the plan itself may name its few whole terms (embed, each block's attn): O(layers), never O(neurons)
    assert max(built) <= 4 * (1 + 2 * layers), f"building made (records, labels, run items) = {built} for {n} columns"
    before = counted.total()
    top = attr.top(5, kind="neuron")
    blocks = attr.blocks()
    last = f"L{layers - 1}.N{d_mlp - 1}"
    where = attr.labels.index(last)
    grid = attr.grid("N")
    viewed = counted.total() - before
    assert where == n - 1 and attr.labels[where] == last and attr.components[where].index == d_mlp - 1
    assert len(top) == 5 and len(blocks.labels) == 1 + 2 * layers and grid.shape == (1, layers, d_mlp)
    # top's 5 rows, the blocks' 1 + 2 * layers labels, index's one lookup: a few records and labels per layer
    assert viewed <= 8 * (1 + 2 * layers) + 50, f"the views made {viewed} records / labels for {n} columns"


def eager(attr: Attribution) -> Attribution:
    """``attr`` with its components and labels as plain tuples and lists: the views read them one column at a time."""
    return Attribution(**{**attr.__dict__, "labels": list(attr.labels), "components": tuple(attr.components)})


@pytest.mark.parametrize("by", ["neuron", "head", "source"])
def test_lazy_labels_and_views_match_the_eager_ones(by):
    import dla_recipes

    model = tiny_model("llama")
    attr = dla_recipes.attribute(model, PROMPTS[:2], TARGET, by=by)
    labels, components = attr.labels, attr.components
    assert isinstance(labels, Labels)
    listed = [c.label for c in components]
    assert list(labels) == listed and labels == listed and listed == labels and len(labels) == len(listed)
    assert [labels[j] for j in range(len(listed))] == listed and labels[-1] == listed[-1]
    assert labels[2:7] == listed[2:7] and labels[::-3] == listed[::-3]
    for j, label in enumerate(listed):
        assert labels.index(label) == j and label in labels
    assert "L0.N99999" not in labels and "nothing" not in labels and 3 not in labels
    with pytest.raises(ValueError):
        labels.index("L0.N99999")
    assert labels + ["constant"] == [*listed, "constant"] and ["x"] + labels == ["x", *listed]
    plain = eager(attr)
    for kind in ("head", "neuron", "block", "source"):
        try:
            expected = plain.top(6, kind=kind)
        except dla_recipes.InputError:
            with pytest.raises(dla_recipes.InputError):
                attr.top(6, kind=kind)
            continue
        assert attr.top(6, kind=kind).equals(expected)
    blocks, plain_blocks = attr.blocks(), plain.blocks()
    assert torch.equal(blocks.values, plain_blocks.values) and blocks.labels == plain_blocks.labels
    if by == "source":
        assert torch.equal(attr.sources().nan_to_num(7.0), plain.sources().nan_to_num(7.0))
    kind = "N" if by == "neuron" else "H"
    assert torch.equal(attr.grid(kind).nan_to_num(7.0), plain.grid(kind).nan_to_num(7.0))


def test_saved_lazy_labels_read_back_equal(tmp_path):
    import dla_recipes

    attr = dla_recipes.attribute(tiny_model("llama"), PROMPTS[:2], TARGET, by="neuron")
    back = Attribution.load(attr.save(tmp_path / "a.pt"))
    assert back == attr and isinstance(back.labels, Labels) and list(back.labels) == list(attr.labels)
    state = torch.load(tmp_path / "a.pt", weights_only=True)
    assert state["fields"]["labels"] is None  # not one string a column: rebuilt from the runs


@pytest.mark.parametrize("family", ["llama", "recurrent_gemma"])  # padding-safe; padding-unsafe (grouped by length)
@pytest.mark.parametrize("target", [TARGET, None])  # None: a second pass per batch, prepared from the first's ids
def test_prompts_are_tokenized_once(family, target, monkeypatch):
    import dla_recipes

    model = tiny_model(family)
    tokenizer_type = type(model.tokenizer)
    prompts = list(PROMPTS)  # 6, 2 and 4 tokens: three batches where padding is unsafe
    calls = []
    original = tokenizer_type.__call__

    def counted(self, text=None, *args, **kwargs):
        texts = [text] if isinstance(text, str) else list(text or [])
        if any(t in prompts for t in texts):
            calls.append(texts)
        return original(self, text, *args, **kwargs)

    monkeypatch.setattr(tokenizer_type, "__call__", counted)
    attr = dla_recipes.attribute(model, prompts, target, by="head")
    monkeypatch.undo()
    assert sum(len(texts) for texts in calls) == len(prompts) and len(calls) == 1, calls  # each prompt once, one call
    for k, prompt in enumerate(prompts):  # the one tokenization padded into each batch: the model's own output
        logits = plain_logits(model, prompt)[-1]
        token = model.tokenizer.convert_tokens_to_ids(attr.target_tokens[k]) if target is None else \
            model.tokenizer.convert_tokens_to_ids(TARGET)
        assert abs(float(attr.output_logit[k]) - float(logits[token])) <= float(tolerance(logits[token]))
