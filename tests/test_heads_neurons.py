"""Heads, neurons and experts: the parts of every split term sum to what the block really adds.

The block term is read from the model's own tensor (a post-norm's output, a scaled copy, a dense projection's
output...); its heads / neurons / experts are computed from the projection's input and weights. They must agree
on every family, through post-norms, routing and grouped projections, and a causal check ties one JetMoE head's
attribution to what zeroing it does to the model's own attention output.
"""

import pytest
import torch
from conftest import CONTRAST, PROMPTS, TARGET, fast_sweep, tiny_model, tolerance
from torch.utils._python_dispatch import TorchDispatchMode

import dla_recipes
from dla_recipes import ExactnessError
from dla_recipes.families import Family, Heads, LayerKind, Term
from dla_recipes.testing import tiny

GRANULARITY = {"heads": "head", "neurons": "neuron", "experts": "expert"}


def _splits(model) -> list[str]:
    """The granularities at which this family's tiny model has something to split."""
    plan = dla_recipes.plan.build_plan(model)
    splits = {word for terms in plan.layers for planned in terms for word, splits in (
        ("heads", planned.term.splits_heads), ("neurons", planned.term.splits_neurons),
        ("experts", planned.term.splits_experts)) if splits}
    return sorted({GRANULARITY[s] for s in splits} | ({"neuron"} if "experts" in splits else set()))


# mixers without heads (RWKV-4 time mixing, Mamba / Mamba-2 / xLSTM mixers; Zamba's shared attention feeds the
# mixer, it writes nothing itself): one mixer term per block, by design; every other family splits its heads
NO_HEADS = ("falcon_mamba", "mamba", "mamba2", "rwkv", "xlstm", "zamba", "zamba2")


@pytest.mark.parametrize("family", fast_sweep(tiny.FAMILIES))
def test_parts_plus_rest_equal_the_block_term(family):
    """At every granularity the family's tiny model splits (heads, neurons, experts; the model is loaded by the
    test, not at collection): the parts plus each block's rest equal the block term. No family with attention
    heads is left at block level (a skipped family is not a done family)."""
    model = tiny_model(family)
    splits = _splits(model)
    assert ("head" in splits) == (family not in NO_HEADS), (family, splits)
    block = dla_recipes.attribute(model, PROMPTS, TARGET, contrast=CONTRAST, by="block")
    bound = tolerance(block.logit)[:, None]
    for by in splits:
        split = dla_recipes.attribute(model, PROMPTS, TARGET, contrast=CONTRAST, by=by)
        assert len(split.labels) > len(block.labels), f"{family}: nothing was split at by={by!r}"
        summed = split.blocks()
        assert summed.labels == block.labels, (family, by)
        gap = (summed.values - block.values).abs()
        assert bool((gap <= bound).all()), (family, by, float(gap.max()))


def test_the_families_without_heads_are_families():
    """``NO_HEADS`` names tiny families (the sweep above checks each family's heads against it)."""
    assert set(NO_HEADS) <= set(tiny.FAMILIES), sorted(set(NO_HEADS) - set(tiny.FAMILIES))


def test_post_norm_heads_sum_to_what_the_block_adds_not_the_pre_norm_output():
    """Gemma-2: the heads pass through the frozen post-attention norm. A table that forgets the post-norm
    (a deliberately mis-described test double) is caught by the self-check, at head and at block level."""
    model = tiny_model("gemma2")
    real = dla_recipes.families.family_of(model)
    attention, mlp = real.terms
    forgets_norm = Family("gemma2", real.model_types, (LayerKind((
        Term("attn", attention.output, Heads(attention.split.projection)), mlp)),), softcap=real.softcap)
    reads_pre_norm = Family("gemma2", real.model_types, (LayerKind((
        Term("attn", "self_attn.output", Heads(attention.split.projection)), mlp)),), softcap=real.softcap)
    for double, by in [(forgets_norm, "head"), (reads_pre_norm, "block")]:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(dla_recipes.families.table, "FAMILIES", (double,))
            with pytest.raises(ExactnessError, match="family 'gemma2': the parts sum to"):
                dla_recipes.attribute(model, PROMPTS, TARGET, by=by)


def test_mis_described_stream_gate_is_caught():
    """Doge without its per-channel residual gates: the naive sum is wrong and attribute refuses to return it."""
    model = tiny_model("doge")
    real = dla_recipes.families.family_of(model)
    ungated = Family("doge", real.model_types, (LayerKind(tuple(
        Term(t.name, t.output, type(t.split)(t.split.projection) if t.split else None) for t in real.terms)),))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(dla_recipes.families.table, "FAMILIES", (ungated,))
        with pytest.raises(ExactnessError, match="family 'doge'"):
            dla_recipes.attribute(model, PROMPTS, TARGET)


def test_jetmoe_head_attribution_is_causal():
    """Zeroing one JetMoE head's slice of the grouped output projection's input (in the last block, where only
    the direct path remains) changes the logit, read through the frozen final norm, by minus its attribution."""
    model = tiny_model("jetmoe")
    config = model.config
    last = model.num_layers - 1
    attr = dla_recipes.attribute(model, PROMPTS[0], TARGET, by="head")
    block = dla_recipes.attribute(model, PROMPTS[0], TARGET, by="block")
    per_slot = config.num_key_value_heads
    head_dim = config.kv_channels
    heads = per_slot * config.num_experts_per_tok
    assert heads == sum(label.startswith(f"L{last}.H") for label in attr.labels)
    for head in range(heads):
        slot, within = divmod(head, per_slot)
        with model.edit() as (_, edited):
            sorted_experts = edited.layers[last].self_attn.experts.router.output[0]
            grouped = edited.layers[last].self_attn.experts.output_linear.inputs[0][0]
            rows = sorted_experts % config.num_experts_per_tok == slot
            grouped[rows, within * head_dim:(within + 1) * head_dim] = 0
        ablated = dla_recipes.attribute(edited, PROMPTS[0], TARGET, by="block")
        label = f"L{last}.attn"
        scale = attr.diagnostics["scale"][0]
        change = (ablated.values[0, ablated.labels.index(label)] / ablated.diagnostics["scale"][0]
                  - block.values[0, block.labels.index(label)] / scale)
        predicted = -attr.values[0, attr.labels.index(f"L{last}.H{head}")] / scale
        assert float(change) == pytest.approx(float(predicted), abs=1e-5), head
        assert abs(float(predicted)) > 1e-6  # the head does something, so the check can fail


class _LargestAllocation(TorchDispatchMode):
    """Records the largest tensor any operation allocates (outputs that alias an input are views, not counted)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {a.untyped_storage().data_ptr() for a in torch.utils._pytree.tree_leaves((args, kwargs))
                  if isinstance(a, torch.Tensor) and a.device.type != "meta"}
        for o in torch.utils._pytree.tree_leaves(out):
            if isinstance(o, torch.Tensor) and o.device.type != "meta" and o.untyped_storage().data_ptr() not in inputs:
                self.largest = max(self.largest, o.numel())
        return out


@pytest.mark.parametrize("family", ["llama", "mixtral"])
def test_neurons_never_build_a_batch_by_neuron_by_model_tensor(family):
    """With a wide MLP, per-neuron attribution allocates nothing near [batch, d_mlp, d_model]: each neuron's
    output column is read along the direction first ([batch, d_mlp]), then multiplied by the activations."""
    import transformers

    config = tiny.config(family)
    config.intermediate_size, config.hidden_size = 4096, 256
    hf = getattr(transformers, type(tiny.build(family)).__name__)(config).eval()
    model = dla_recipes.load(hf, tokenizer=tiny.tokenizer(), device_map="cpu")
    prompts = ["w1 w2 w3", "w4 w5 w6", "w7 w8 w9", "w10 w11 w12"]
    forbidden = len(prompts) * config.intermediate_size * config.hidden_size
    with _LargestAllocation() as neurons:
        attr = dla_recipes.attribute(model, prompts, TARGET, by="neuron")
    with _LargestAllocation() as logits_only, model.trace(prompts):
        model.logits.save()
    assert attr.error <= 1e-4 * max(1.0, float(attr.logit.abs().max()))
    # nothing bigger than the forward's own largest activation or the answer itself ([batch, n_components] plus
    # the few scalars packed beside it), and far below the forbidden tensor
    assert neurons.largest <= max(logits_only.largest, attr.values.numel() + (len(dla_recipes.trace.Readout.FIELDS) + 2) * len(prompts))
    assert neurons.largest * 8 <= forbidden, (neurons.largest, forbidden)
