"""A split term's rest column exists only where a bias writes there (issue 22, item 8c).

At a split granularity a term's block label (``L3.attn`` by head, ``L3.mlp`` by neuron) holds its rest: the biases
of its projection, of the map after it, of its norms. A term with none of them wrote nothing there: the column was
all zeros by construction and is gone; a term with a bias keeps it. Which terms have one is read here from the
model's own modules (HF names, not the family table): the same family with and without biases, a post-norm family,
a parallel block, a multiplier. The parts still sum to a plain forward of each prompt alone, and ``blocks()`` still
equals ``by="block"`` (the parts are summed into their term's block by their components, not by a rest label).
"""

from __future__ import annotations

import pytest
import torch
from conftest import CONTRAST, PROMPTS, TARGET, assert_parts_are_the_models, eager_model, tiny_model, tolerance

import dla_recipes
from dla_recipes.testing import tiny


def biased_llama():
    """The tiny llama with a bias on every projection (``attention_bias``, ``mlp_bias``), perturbed like the others."""
    import transformers

    config = tiny.config("llama")
    config.attention_bias = config.mlp_bias = True
    torch.manual_seed(0)
    model = tiny.perturb(transformers.LlamaForCausalLM(config).float().eval())
    return dla_recipes.load(model, tokenizer=tiny.tokenizer(config.vocab_size), device_map="cpu")


_BIASED = []


def model_for(family: str):
    if family != "llama+bias":
        return tiny_model(family)
    if not _BIASED:
        _BIASED.append(biased_llama())
    return _BIASED[0]


def hf_layers(model):
    """The decoder layers of the underlying transformers model."""
    hf = model._module
    return hf.transformer.h if hasattr(hf, "transformer") else hf.model.layers


def rms_only(norm) -> bool:
    """A norm with a gain and nothing else (its output at a zero input is zero)."""
    return [name for name, _ in norm.named_parameters()] == ["weight"]


# (family, by, term): from a decoder layer's own modules, whether something besides the parts writes into the rest
WRITES_REST = {
    ("llama", "head", "attn"): lambda layer: layer.self_attn.o_proj.bias is not None,
    ("llama", "neuron", "mlp"): lambda layer: layer.mlp.down_proj.bias is not None,
    ("llama+bias", "head", "attn"): lambda layer: layer.self_attn.o_proj.bias is not None,
    ("llama+bias", "neuron", "mlp"): lambda layer: layer.mlp.down_proj.bias is not None,
    ("gpt2", "head", "attn"): lambda layer: layer.attn.c_proj.bias is not None,  # Conv1D, with its bias
    ("gpt2", "neuron", "mlp"): lambda layer: layer.mlp.c_proj.bias is not None,
    # sandwich norms: the heads and neurons pass an RMS post-norm (no bias) before the stream
    ("gemma2", "head", "attn"): lambda layer: (layer.self_attn.o_proj.bias is not None
                                               or not rms_only(layer.post_attention_layernorm)),
    ("gemma2", "neuron", "mlp"): lambda layer: (layer.mlp.down_proj.bias is not None
                                                or not rms_only(layer.post_feedforward_layernorm)),
    # a parallel block: the attention's out_proj has no bias, the MLP's fc_out has one
    ("gptj", "head", "attn"): lambda layer: layer.attn.out_proj.bias is not None,
    ("gptj", "neuron", "mlp"): lambda layer: layer.mlp.fc_out.bias is not None,
    # every write times residual_multiplier (a scale, not a bias)
    ("granite", "head", "attn"): lambda layer: layer.self_attn.o_proj.bias is not None,
}


@pytest.mark.parametrize(("family", "by", "term"), list(WRITES_REST), ids=lambda x: str(x))
def test_a_rest_label_is_there_where_a_bias_writes(family, by, term):
    model = model_for(family)
    attr = dla_recipes.attribute(model, PROMPTS, TARGET, contrast=CONTRAST, by=by)
    assert_parts_are_the_models(model, attr, what=f"{family} by={by}")
    rests = {c.layer: j for j, c in enumerate(attr.components) if c.term == term and c.part is None}
    expected = [WRITES_REST[family, by, term](layer) for layer in hf_layers(model)]
    assert [i in rests for i in range(len(expected))] == expected, (sorted(rests), expected)
    for i, j in rests.items():  # a kept rest holds what the bias wrote: not zero
        assert float(attr.values[:, j].abs().max()) > 0, f"L{i}.{term}"
    parts = [c for c in attr.components if c.term == term and c.part is not None]
    assert parts, f"{family}: {term} was not split by={by}"
    block = dla_recipes.attribute(model, PROMPTS, TARGET, contrast=CONTRAST)
    summed = attr.blocks()
    assert summed.labels == block.labels
    assert bool(((summed.values - block.values).abs() <= tolerance(block.logit)[:, None]).all())


def test_the_biased_and_unbiased_llama_differ_only_by_their_rests():
    """The same family, with and without biases: the unbiased one has no rest label at a split granularity, the
    biased one has one per split term, and nothing else differs (the test could not pass on a plan that drops or
    keeps every rest)."""
    plain, biased = tiny_model("llama"), model_for("llama+bias")
    for by, term in (("head", "attn"), ("neuron", "mlp")):
        a = dla_recipes.attribute(plain, PROMPTS, TARGET, contrast=CONTRAST, by=by)
        b = dla_recipes.attribute(biased, PROMPTS, TARGET, contrast=CONTRAST, by=by)
        rests = [f"L{i}.{term}" for i in range(len(hf_layers(plain)))]
        assert not set(rests) & set(a.labels)
        assert [label for label in b.labels if label not in rests] == a.labels


def test_by_source_and_an_edited_pass_drop_the_rest_and_keep_the_edit():
    """By source (heads split per source position) the unbiased attention has no rest either; in an edited pass
    each split term keeps its ``.edit`` column, which ``blocks()`` sums into the term with its parts."""
    model = eager_model("llama")
    attr = dla_recipes.attribute(model, PROMPTS, TARGET, contrast=CONTRAST, by="source")
    assert not any(c.term == "attn" and c.part is None for c in attr.components)
    assert_parts_are_the_models(model, attr, what="llama by=source")
    model = tiny_model("llama")

    def steer(m):
        m.layers[1].self_attn.output[0][:, -1] *= 1.5  # after the projection: in L1.attn.edit

    edited = dla_recipes.attribute(model, PROMPTS, TARGET, contrast=CONTRAST, by="head", intervene=steer)
    assert "L1.attn.edit" in edited.labels and "L1.attn" not in edited.labels
    assert float(edited.values[:, edited.labels.index("L1.attn.edit")].abs().max()) > 1e-3
    block = dla_recipes.attribute(model, PROMPTS, TARGET, contrast=CONTRAST, intervene=steer)
    summed = edited.blocks()
    assert summed.labels == block.labels
    assert bool(((summed.values - block.values).abs() <= tolerance(block.logit)[:, None]).all())


def test_an_attribution_read_back_from_its_labels_sums_the_same_blocks():
    """An ``Attribution`` built from labels alone (no components) reads each part's block from the labels:
    heads are an ``attn``'s, an experts term keeps its block label after its parts (``L3.mlp`` after ``L3.E2``)."""
    for family, by in (("llama", "head"), ("llama", "neuron"), ("qwen2_moe", "expert"), ("granitemoeshared", "neuron")):
        attr = dla_recipes.attribute(tiny_model(family), PROMPTS, TARGET, contrast=CONTRAST, by=by)
        hand = dla_recipes.Attribution(values=attr.values, labels=list(attr.labels), constant=attr.constant,
                                       logit=attr.logit, output_logit=attr.output_logit, error=attr.error, by=by)
        assert [(c.layer, c.term) for c in hand.components] == [(c.layer, c.term) for c in attr.components], family
        assert hand.blocks().labels == attr.blocks().labels
        torch.testing.assert_close(hand.blocks().values, attr.blocks().values)
