"""The in-trace readers name what each sublayer adds to the residual stream, whatever the family.

Checked against the model's own stream: ``layer_input + attention_output + mlp_output == layer_output`` for every
family whose blocks add their terms to an unscaled stream (post-norm outputs, multiplied copies, BLOOM's dense
projections, Falcon's in-place MLP output, OPT's flattened MLP all included; JetMoE's routed heads have no head
tensor, so it is checked through attribute() in test_heads_neurons.py).
"""

import bounds
import pytest
import torch
from conftest import PROMPTS, tiny_model

import dla_recipes
from dla_recipes.families import Routed, Stream
from dla_recipes.testing import tiny


def _plain_sum_family(family: str) -> bool:
    entry = dla_recipes.families.family_of(tiny.config(family))
    terms = [t for kind in entry.kinds for t in kind.terms]
    return (entry.layer_scale is None and entry.collapse is None and {t.name for t in terms} == {"attn", "mlp"}
            and not any(t.stream != Stream() or t.hyper or isinstance(t.split, Routed) for t in terms))


PLAIN = [f for f in tiny.FAMILIES if _plain_sum_family(f)]


@pytest.mark.parametrize("family", PLAIN)
def test_input_plus_sublayers_is_the_output(family):
    model = tiny_model(family)
    layer = 1
    split = dla_recipes.trace.readers.find_term(model, layer, "attn").split == "heads"  # no heads: a position convolution
    with torch.no_grad(), model.trace(PROMPTS):
        x = dla_recipes.trace.layer_input(model, layer).save()
        heads = dla_recipes.trace.attention_head_outputs(model, layer).save() if split else x
        attention = dla_recipes.trace.attention_output(model, layer).save()
        mlp = dla_recipes.trace.mlp_output(model, layer, batch_size=len(PROMPTS)).save()
        out = dla_recipes.trace.layer_output(model, layer).save()
    # the model's adds and ours, each a float32 sum of the three in some order: bounds.sum_bound (gamma_3 of their |terms|) each side
    terms = torch.stack([x, attention, mlp])
    assert bool(((x + attention + mlp - out).abs() <= 2 * bounds.sum_bound(terms, dim=0)).all())
    assert not split or (heads.shape[:2] == x.shape[:2] and heads.shape[2] == model.num_heads)


def test_enough_families_are_checked():
    assert len(PLAIN) >= 25, PLAIN


def test_neuron_activations_are_the_down_projections_input():
    model = tiny_model("llama")
    with torch.no_grad(), model.trace(PROMPTS):
        acts = dla_recipes.trace.neuron_activations(model, 0).save()
        mlp = dla_recipes.trace.mlp_output(model, 0).save()
    weight = model.layers[0].mlp.down_proj.weight
    # the model's down projection and ours, each a d_ff-term float32 dot (bounds.dot_bound), both sides
    limit = 2 * bounds.dot_bound(acts[..., None, :], weight, dim=-1)
    assert bool(((acts @ weight.T - mlp).abs() <= limit).all())


def test_mixture_of_attention_has_no_head_tensor():
    model = tiny_model("jetmoe")
    with pytest.raises(ValueError, match="mixture of attention"), model.trace(PROMPTS):
        dla_recipes.trace.attention_head_outputs(model, 0)
