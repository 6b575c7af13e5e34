"""``attribute_scores``: a head's pre-softmax score split into query x key component pairs, against the model's own.

The references never run dla_recipes' recipe: a plain transformers forward of each prompt alone with eager attention
and ``output_attentions=True`` gives the attention weights ``A``, whose log differences between two keys are the score
differences (the softmax's normaliser cancels; a soft-capped family's scores are capped first); and the attention
function the model calls (``eager_attention_forward``, patched for one forward to record its query and key) gives the
model's own pre-softmax product ``q . k * scaling`` at the query and each key. The attribution runs on the padded
batch.
"""

from __future__ import annotations

import sys

import pytest
import torch
from conftest import PROMPTS, eager_model
from test_sources import REFUSED as SOURCE_REFUSED

import dla_recipes
from dla_recipes import DLAError, ExactnessError, InputError
from dla_recipes.plan import build_plan, module_at
from dla_recipes.testing import tiny

KEYS = [0, -2]  # the first token and the one before the query (the 2-token prompt: both the same)
NEAR = [-2, -1]  # inside any tiny model's sliding window (the family sweep: key 0 is outside some)
# Largest gaps measured over the 73 supported tiny families (float32, the three padded prompts against each prompt
# alone, by block and by head): |score differences - log A differences| 2.2e-6 (olmo2; relative to max(1,
# |difference|)), |score - the model's own q . k * scaling| 1.5e-6 (olmo3; relative to max(1, |score|)): the padded
# batch's float32 rounding against each prompt alone. The tolerances are about twice the largest.
LOG_GAP = 4.5e-6
OWN_GAP = 3e-6
# measured on the real models (float32 on the CPU, two prompts padded, two heads each): log A differences 3.7e-6
# (SmolLM2) and 4.5e-6 (Gemma-3-270M), the model's own product 9.0e-7 and 6.0e-7 on an AVX2 machine, and 4.6e-6 for
# SmolLM2's own product on an AVX-512 / AMX Xeon (its float32 kernels accumulate in another order); about twice
# the largest
REAL_LOG_GAP = 9e-6
REAL_OWN_GAP = 9e-6


def attention_module(model, layer: int):
    plan = build_plan(model)
    term = next(p.term for p in plan.layers[layer] if p.term.splits_heads)
    return module_at(model.layers[layer], term.split.projection.rsplit(".", 1)[0])._module


def last_attention_layer(model) -> int:
    plan = build_plan(model)
    return [i for i, terms in enumerate(plan.layers) if any(p.term.splits_heads for p in terms)][-1]


@torch.no_grad()
def eager_reference(model, layer: int, head: int, prompt: str):
    """``(A [q, k], seen)`` of block ``layer``'s attention in a plain forward of ``prompt`` alone: the weights it
    returned, and (``seen``) the query ``[heads, q, d]``, key ``[kv, k, d]`` and scaling its attention function
    received."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    module = attention_module(model, layer)
    original = sys.modules[type(module).__module__].eager_attention_forward
    seen = {}

    def recording(mod, query, key, value, attention_mask, *args, **kwargs):
        out = original(mod, query, key, value, attention_mask, *args, **kwargs)
        if mod is module:
            seen.update(q=query[0].float(), k=key[0].float(), scaling=kwargs.get("scaling"), weights=out[1][0])
        return out

    # registered as "eager", get_interface returns it whatever the module's globals (nnsight's .source rewrites them)
    assert "eager" not in ALL_ATTENTION_FUNCTIONS
    ALL_ATTENTION_FUNCTIONS["eager"] = recording
    try:
        ids = model.tokenizer(prompt, return_tensors="pt")
        model._module(**ids, output_attentions=True)
    finally:
        del ALL_ATTENTION_FUNCTIONS["eager"]
    assert "weights" in seen, "the attention function was not called through the interface"
    return seen["weights"][head].float(), seen  # [q, k]: what the attention function returned


def check_against_eager(model, attr, layer: int, head: int, prompts=PROMPTS, sum_rtol: float = 1e-5):
    """The score differences between the keys against ``log A`` differences, the scores against the model's own
    product; returns the two largest relative gaps."""
    log_gap = own_gap = 0.0
    cap = attr.softcap
    for b, prompt in enumerate(prompts):
        weights, seen = eager_reference(model, layer, head, prompt)
        q_pos, keys = attr.queries[b], attr.keys[b]
        total = attr.values[b].double().sum((-2, -1)) + attr.constant[b].double()
        assert torch.allclose(total, attr.score[b].double(), rtol=0, atol=sum_rtol * max(1.0, float(total.abs().max())))
        capped = total if cap is None else cap * torch.tanh(total / cap)
        logs = torch.log(weights[q_pos, list(keys)].double())
        for first in range(len(keys)):
            for second in range(first + 1, len(keys)):
                want = float(logs[first] - logs[second])
                got = float(capped[first] - capped[second])
                log_gap = max(log_gap, abs(got - want) / max(1.0, abs(want)))
        kv = seen["k"].shape[0]
        q = seen["q"][head, q_pos]
        k = seen["k"][head // (seen["q"].shape[0] // kv), list(keys)]
        scaling = seen["scaling"] if seen["scaling"] is not None else q.shape[-1] ** -0.5
        own = (k @ q).double() * scaling  # the model's own pre-softmax product at the query and each key
        own_gap = max(own_gap, float(((attr.score[b].double() - own).abs() / own.abs().clamp(min=1.0)).max()))
    return log_gap, own_gap


def supported_or_refused(family: str, by: str):
    model = eager_model(family)
    layers = [i for i, terms in enumerate(build_plan(model).layers) if any(p.term.splits_heads for p in terms)]
    if not layers:  # no attention heads at all: the head label is refused
        with pytest.raises(InputError, match="head="):
            dla_recipes.attribute_scores(model, PROMPTS, "L0.H0", by=by)
        return None
    layer = layers[-1]
    head = min(1, build_plan(model).num_heads - 1)
    try:
        attr = dla_recipes.attribute_scores(model, PROMPTS, f"L{layer}.H{head}", query=-1, keys=NEAR, by=by)
    except ExactnessError:
        raise
    except DLAError as error:
        assert "attribute_scores" in str(error) or "head=" in str(error), str(error)
        REFUSALS[family] = str(error)
        print(f"REFUSED {family} {by}: {error}")
        return None
    assert attr.values.shape == (len(PROMPTS), len(NEAR), len(attr.query_labels), len(attr.key_labels))
    assert float(attr.values.abs().max()) > 0
    log_gap, own_gap = check_against_eager(model, attr, layer, head)
    print(f"GAP {family} {by} {log_gap:.3g} {own_gap:.3g}")
    assert log_gap <= LOG_GAP, f"{family} by={by}: score differences off log A differences by {log_gap:.3g}"
    assert own_gap <= OWN_GAP, f"{family} by={by}: score off the model's own q . k * scaling by {own_gap:.3g}"
    return attr


REFUSALS: dict = {}
SOURCE_FAMILIES = [f for f in tiny.FAMILIES if f not in SOURCE_REFUSED]
# Families attribute_scores must split (the rest of SOURCE_FAMILIES may refuse, naming why; an ExactnessError fails)
MUST_SPLIT = ["llama", "qwen2", "qwen3", "gemma", "gemma2", "gemma3", "olmo", "olmo2", "mistral", "mixtral", "granite",
              "glm4", "phi", "exaone4", "smollm3"]


@pytest.mark.parametrize("by", ["block", "head"])
@pytest.mark.parametrize("family", SOURCE_FAMILIES)
def test_every_family_splits_or_refuses(family, by):
    attr = supported_or_refused(family, by)
    if family in MUST_SPLIT:
        assert attr is not None, f"{family}: refused: {REFUSALS.get(family)}"


def test_by_head_regroups_to_by_block():
    """Each block's heads and rest sum to its by='block' component, on both sides of the matrix."""
    model = eager_model("qwen3")
    layer = last_attention_layer(model)
    block = dla_recipes.attribute_scores(model, PROMPTS, f"L{layer}.H0", keys=KEYS)
    heads = dla_recipes.attribute_scores(model, PROMPTS, f"L{layer}.H0", keys=KEYS, by="head")
    groups = [block.query_labels.index(label.split(".H")[0] + ".attn") if ".H" in label else block.query_labels.index(label)
              for label in heads.query_labels]
    index = torch.tensor(groups)
    b, k, c = block.values.shape[:3]
    rows = torch.zeros(b, k, c, heads.values.shape[3]).index_add_(2, index, heads.values)
    regrouped = torch.zeros_like(block.values).index_add_(3, index, rows)
    assert torch.allclose(regrouped, block.values, atol=1e-6)
    assert torch.allclose(heads.score, block.score, atol=1e-7)


def test_padded_batch_equals_each_prompt_alone():
    model = eager_model("gemma3")
    batch = dla_recipes.attribute_scores(model, PROMPTS, "L1.H0", keys=KEYS, by="head")
    for b, prompt in enumerate(PROMPTS):
        alone = dla_recipes.attribute_scores(model, prompt, "L1.H0", keys=KEYS, by="head")
        assert alone.keys[0] == batch.keys[b]
        assert torch.allclose(alone.values[0], batch.values[b], atol=1e-6)
        assert torch.allclose(alone.score[0], batch.score[b], atol=1e-6)


def test_views():
    attr = dla_recipes.attribute_scores(eager_model("llama"), PROMPTS, "L1.H0", keys=[0, 1], by="head")
    frame = attr.to_frame()
    assert len(frame) == attr.values.numel()
    summed = frame.groupby(["prompt", "key"])["value"].sum()
    for b in range(len(PROMPTS)):
        for k, key in enumerate(attr.keys[b]):
            assert abs(summed[(b, key)] - float(attr.values[b, k].sum())) < 1e-6
    top = attr.top(3)
    assert len(top) == 3 and abs(top["value"].iloc[0]) == float(attr.values[0, 0].abs().max())
    fig = attr.heatmap(k=4)
    assert len(fig.data[0].y) == 4
    assert attr.difference(0, 0, 1).shape == attr.values.shape[2:]


def test_bad_input():
    model = eager_model("llama")
    with pytest.raises(InputError, match="head="):
        dla_recipes.attribute_scores(model, PROMPTS, "L9.H0")
    with pytest.raises(InputError, match="head="):
        dla_recipes.attribute_scores(model, PROMPTS, "L1.H99")
    with pytest.raises(InputError, match="head="):
        dla_recipes.attribute_scores(model, PROMPTS, "layer 1 head 0")
    with pytest.raises(InputError, match="keys="):
        dla_recipes.attribute_scores(model, PROMPTS, "L1.H0", query=1, keys=[2])
    with pytest.raises(InputError, match="query="):
        dla_recipes.attribute_scores(model, PROMPTS, "L1.H0", query=5)
    with pytest.raises(InputError, match="keys="):
        dla_recipes.attribute_scores(model, PROMPTS, "L1.H0", keys=[-9])
    with pytest.raises(InputError, match="by="):
        dla_recipes.attribute_scores(model, PROMPTS, "L1.H0", by="neuron")


@pytest.mark.server
def test_remote_equals_local(tmp_path):
    from conftest import serve_tiny, single_threaded

    with serve_tiny(tmp_path, ("llama", "gemma3")) as server:
        for family in ("llama", "gemma3"):
            remote_model = server.remote_model(family)
            local_model = server.local_model(family)
            with server.client():
                remote = dla_recipes.attribute_scores(remote_model, PROMPTS, "L1.H0", keys=KEYS, by="head",
                                                      remote=True)
            with single_threaded():
                local = dla_recipes.attribute_scores(local_model, PROMPTS, "L1.H0", keys=KEYS, by="head")
            assert remote.query_labels == local.query_labels
            assert torch.equal(remote.values, local.values), float((remote.values - local.values).abs().max())
            assert torch.equal(remote.score, local.score)


def test_key_outside_the_sliding_window_is_refused():
    """exaone4's block 1 slides: the model's own weights give key 0 nothing, and the recipe refuses it by name."""
    model = eager_model("exaone4")
    weights, _ = eager_reference(model, 1, 1, PROMPTS[0])
    assert float(weights[-1, 0]) == 0.0  # the model itself does not attend there
    with pytest.raises(InputError, match="sliding window"):
        dla_recipes.attribute_scores(model, PROMPTS, "L1.H1", keys=[0])


def test_soft_capped_scores_are_before_the_cap():
    """gemma2 caps its scores (attn_logit_softcapping) before the softmax: ``score`` is the pre-cap score, and the
    cap of it gives the model's own log-weight differences (the sweep's check)."""
    attr = supported_or_refused("gemma2", "head")
    assert attr is not None and attr.softcap == eager_model("gemma2")._module.config.attn_logit_softcapping


REAL = ["smollm2-135m", pytest.param("gemma3-270m", marks=pytest.mark.slow)]
IOI = ["When Mary and John went to the store, John gave a drink to", "The Eiffel Tower is in the city of"]


@pytest.mark.real
@pytest.mark.parametrize("name", REAL)
def test_real_models(name):
    from dla_recipes import models

    model = dla_recipes.load(models.REGISTRY[name](), dtype=torch.float32, device_map="cpu",
                             attn_implementation="eager")
    layers = len(build_plan(model).layers)
    for layer, head in ((layers - 1, 0), (layers // 2, 1)):
        attr = dla_recipes.attribute_scores(model, IOI, f"L{layer}.H{head}", keys=[1, 3, -1], by="head")
        log_gap, own_gap = check_against_eager(model, attr, layer, head, IOI)
        print(f"GAP {name} L{layer}.H{head} {log_gap:.3g} {own_gap:.3g}")
        assert log_gap <= REAL_LOG_GAP and own_gap <= REAL_OWN_GAP, (name, layer, log_gap, own_gap)


# measured on tiny llama and gemma3 (by="head", L1.H0, the three padded prompts against each alone): |score
# differences - log A differences| (the model's own weights, rounded in its dtype) up to 1.2e-2 in bfloat16 (gemma3)
# and 8.0e-4 in float16; |pairs' sum - the model's own score| / max(1, |score|) up to 9.2e-3 and 1.0e-3 (the pairs
# in float32 from the components, the model's query and key rounded in its dtype on the way): about twice those
LOW_PRECISION = {torch.bfloat16: (2.5e-2, 2e-2), torch.float16: (1.6e-3, 2.1e-3)}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_low_precision(family, dtype):
    model = dla_recipes.load(tiny.build(family).to(dtype), tokenizer=tiny.tokenizer(), device_map="cpu",
                             attn_implementation="eager")
    attr = dla_recipes.attribute_scores(model, PROMPTS, "L1.H0", keys=KEYS, by="head")
    log_tolerance, sum_tolerance = LOW_PRECISION[dtype]
    log_gap, own_gap = check_against_eager(model, attr, 1, 0, sum_rtol=sum_tolerance)
    assert log_gap <= log_tolerance, (family, dtype, log_gap)
    assert own_gap <= OWN_GAP, (family, dtype, own_gap)
