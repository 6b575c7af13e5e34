"""Attribution to any direction read by any norm: the stream a sublayer reads, through the norm that reads it.

The parts (terms written before that point) must sum to ``norm(stream) @ v``, where the reference is the norm's
own output captured by a plain PyTorch forward hook (no nnsight, no dla_recipes arithmetic). Every row is read
through the one norm that really reads the stream: the bug TransformerLens fixed, where neuron rows used the
attention norm's scale while the other rows used the MLP norm's, cannot happen here.
"""

import pytest
import torch
from conftest import PROMPTS, hooked_output, tiny_model, tolerance

import dla_recipes
from dla_recipes import InputError
from dla_recipes.plan import module_at

LAYER = 1  # a middle block of the three


def _direction(model, seed=0):
    torch.manual_seed(seed)
    return torch.randn(model.lm_head.weight.shape[-1])


def _hooked_norm_output(model, norm_path: str, prompt: str) -> torch.Tensor:
    """``[pos, d_model]``: the norm's real output in a plain forward of one prompt (a forward hook, no nnsight)."""
    return hooked_output(model, module_at(model.layers[LAYER], norm_path)._module, prompt).float()


@pytest.mark.parametrize("family,sublayer,norm", [
    ("gpt2", "attn", "ln_1"), ("gpt2", "mlp", "ln_2"),  # LayerNorm
    ("llama", "attn", "input_layernorm"), ("llama", "mlp", "post_attention_layernorm"),  # RMSNorm
    ("gemma2", "mlp", "pre_feedforward_layernorm"),  # 1 + w, after a sandwich-normed attention
    ("gptj", "mlp", "ln_1"),  # parallel block: the MLP reads the block's input through ln_1
])
@pytest.mark.parametrize("by", ["block", "neuron"])
def test_parts_sum_to_the_norm_output_along_the_direction(family, sublayer, norm, by):
    model = tiny_model(family)
    v = _direction(model)
    attr = dla_recipes.attribute_direction(model, PROMPTS, v, layer=LAYER, sublayer=sublayer, by=by)
    gaps = (attr.values.sum(-1) + attr.constant - attr.logit).abs()
    assert bool((gaps <= tolerance(attr.logit)).all()), gaps
    for i, prompt in enumerate(PROMPTS):  # the model's own normed stream, captured without nnsight
        expected = float(_hooked_norm_output(model, norm, prompt)[-1] @ v)
        assert float(attr.logit[i]) == pytest.approx(expected, abs=1e-4 * max(1.0, abs(expected)))
    # only the terms written before the point are attributed (by term: a split term without a bias has no rest label)
    plan = dla_recipes.plan.build_plan(model)
    written = {(c.layer, c.term) for c in attr.components}
    assert (LAYER, "mlp") not in written and (LAYER - 1, "mlp") in written
    parallel = plan.layers[LAYER][1].parallel
    assert ((LAYER, "attn") in written) == (sublayer == "mlp" and not parallel)


def test_every_row_uses_the_mlp_norm():
    """Neuron rows and block rows share one frozen scale: the MLP norm's (ln2), not the attention norm's."""
    model = tiny_model("gpt2")
    v = _direction(model, seed=1)
    neurons = dla_recipes.attribute_direction(model, PROMPTS, v, layer=LAYER, sublayer="mlp", by="neuron")
    blocks = dla_recipes.attribute_direction(model, PROMPTS, v, layer=LAYER, sublayer="mlp", by="block")
    torch.testing.assert_close(neurons.blocks().values, blocks.values, atol=2e-5, rtol=1e-4)
    ln1 = float(_hooked_norm_output(model, "ln_1", PROMPTS[0])[-1] @ v)
    ln2 = float(_hooked_norm_output(model, "ln_2", PROMPTS[0])[-1] @ v)
    assert abs(ln1 - ln2) > 1e-2  # the two readings differ, so using the wrong norm would be caught
    assert float(neurons.logit[0]) == pytest.approx(ln2, abs=1e-4 * max(1.0, abs(ln2)))


def test_one_direction_per_prompt():
    model = tiny_model("llama")
    directions = torch.stack([_direction(model, seed=s) for s in range(len(PROMPTS))])
    together = dla_recipes.attribute_direction(model, PROMPTS, directions, layer=LAYER)
    for i, prompt in enumerate(PROMPTS):
        alone = dla_recipes.attribute_direction(model, prompt, directions[i], layer=LAYER)
        torch.testing.assert_close(together.values[i], alone.values[0], atol=1e-5, rtol=1e-4)


def test_direction_errors_name_the_problem():
    model = tiny_model("llama")
    v = _direction(model)
    with pytest.raises(InputError, match=r"layer 7 is outside this 3-block model"):
        dla_recipes.attribute_direction(model, PROMPTS, v, layer=7)
    with pytest.raises(InputError, match=r"block 1 has no 'experts' sublayer \(it has attn, mlp\)"):
        dla_recipes.attribute_direction(model, PROMPTS, v, layer=1, sublayer="experts")
    with pytest.raises(InputError, match=r"direction has shape \(5,\)"):
        dla_recipes.attribute_direction(model, PROMPTS, torch.ones(5), layer=1)
    with pytest.raises(InputError, match=r"reads the stream without a norm in front of it \(olmo2\)"):
        dla_recipes.attribute_direction(tiny_model("olmo2"), PROMPTS, v, layer=1)
