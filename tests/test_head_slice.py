"""``dla_recipes.head_slice``: where one head's output is, on every kind of attention, for editing it in nnsight.

Zeroing the slice in the forward pass (``attribute(..., intervene=...)``) must make that head's part exactly 0 while
the unedited head's part is not, and the edited attribution must sum to the logit of a plain transformers forward
with the same slice zeroed by a torch pre-hook. The heads' slices must tile the projection's input. Families: GQA
(Llama), GQA with heads wider than ``hidden_size / heads`` (Seed-OSS, as Gemma-3-270M), fused QKV with a ``Conv1D``
(GPT-2), per-head fused QKV (GPT-NeoX), fused QKV (Phi-3), latent attention (DeepSeek-V3, values narrower than the
queries), a grouped low-rank output projection (DeepSeek-V4, input ``[batch, pos, groups, in / groups]``) and a
position convolution after the projection (Inkling). Heads routed to experts (JetMoE) and blocks without heads
(Mamba) are refused with an ``InputError`` saying why.
"""

from __future__ import annotations

import pytest
import torch
from conftest import CONTRAST, PROMPTS, TARGET, tiny_model, tolerance

import dla_recipes

FAMILIES = ["llama", "seed_oss", "gpt2", "gpt_neox", "phi3", "deepseek_v3", "deepseek_v4", "inkling"]
LAYER = 1


def hooked_logit_difference(model, prompt: str, hs) -> float:
    """TARGET - CONTRAST at the last token of ``prompt`` alone, in a plain transformers forward whose projection
    input has ``hs``'s features zeroed by a torch forward pre-hook (no nnsight involved)."""
    def pre_hook(_, args):
        x = args[0].clone()
        x[hs.index] = 0
        return (x,) + tuple(args[1:])

    handle = hs.site(model)._module.register_forward_pre_hook(pre_hook)
    try:
        ids = model.tokenizer(prompt, return_tensors="pt")
        with torch.no_grad():
            logits = model._module(**ids).logits[0, -1].float()
    finally:
        handle.remove()
    target, contrast = (model.tokenizer(t, add_special_tokens=False)["input_ids"][0] for t in (TARGET, CONTRAST))
    return float(logits[target] - logits[contrast])


@pytest.mark.parametrize("family", FAMILIES)
def test_the_heads_tile_the_projection_input(family):
    model = tiny_model(family)
    heads = model.num_heads
    slices = [dla_recipes.head_slice(model, LAYER, h) for h in range(heads)]
    with torch.no_grad(), model.trace(PROMPTS[0]):
        x = slices[0].site(model).input.save()
    seen = torch.zeros_like(x, dtype=torch.int64)
    for hs in slices:
        assert hs.width > 0 and hs.module == f"layers[{LAYER}].{hs.projection}"
        seen[hs.index] += 1
    assert bool((seen == 1).all()), "every feature of the projection's input belongs to exactly one head"


@pytest.mark.parametrize("family", FAMILIES)
def test_zeroing_the_slice_zeroes_the_heads_part(family):
    model = tiny_model(family)
    hs = dla_recipes.head_slice(model, LAYER, -1)  # the last head: on DeepSeek-V4, in the second group
    assert hs.head == model.num_heads - 1

    def ablate(m):
        hs.site(m).input[hs.index] = 0

    label = f"L{LAYER}.H{hs.head}"
    edited = dla_recipes.attribute(model, PROMPTS, TARGET, contrast=CONTRAST, by="head", intervene=ablate)
    clean = dla_recipes.attribute(model, PROMPTS, TARGET, contrast=CONTRAST, by="head")
    assert torch.all(edited.values[:, edited.labels.index(label)] == 0)
    assert torch.all(clean.values[:, clean.labels.index(label)] != 0), "the head wrote nothing: the test cannot fail"
    reference = torch.tensor([hooked_logit_difference(model, p, hs) for p in PROMPTS])
    assert torch.all((edited.total - reference).abs() <= tolerance(reference)), (edited.total, reference)


def test_wide_heads_are_not_hidden_size_over_heads():
    """Seed-OSS's heads (as Gemma-3-270M's) are wider than ``hidden_size // num_heads``: the slice is the projection's."""
    model = tiny_model("seed_oss")
    hs = dla_recipes.head_slice(model, LAYER, 1)
    assert hs.width == model.config.head_dim != model.config.hidden_size // model.num_heads
    assert hs.columns == slice(hs.width, 2 * hs.width)


def test_grouped_projection_names_the_group():
    model = tiny_model("deepseek_v4")
    groups = model.layers[LAYER].self_attn.o_a_proj._module.n_groups
    per_group = model.num_heads // groups
    assert {dla_recipes.head_slice(model, LAYER, h).group for h in range(model.num_heads)} == set(range(groups))
    assert dla_recipes.head_slice(model, LAYER, per_group).columns.start == 0


def test_routed_heads_and_blocks_without_heads_are_refused():
    with pytest.raises(dla_recipes.InputError, match="mixture of attention.*routed"):
        dla_recipes.head_slice(tiny_model("jetmoe"), LAYER, 0)
    with pytest.raises(dla_recipes.InputError, match="no attention heads"):
        dla_recipes.head_slice(tiny_model("mamba"), LAYER, 0)
    model = tiny_model("llama")
    with pytest.raises(dla_recipes.InputError, match="head 4 is outside block 1's 4 heads"):
        dla_recipes.head_slice(model, LAYER, model.num_heads)
    with pytest.raises(dla_recipes.InputError, match="outside this"):
        dla_recipes.head_slice(model, model.num_layers, 0)
