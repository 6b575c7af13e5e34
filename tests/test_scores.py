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

import bounds
import pytest
import torch
from conftest import PROMPTS, eager_model
from test_sources import REFUSED as SOURCE_REFUSED

import dla_recipes
from dla_recipes import DLAError, ExactnessError, InputError
from dla_recipes.plan import build_plan, module_at
from dla_recipes.plan.scores import score_spec
from dla_recipes.selfcheck import model_dtype
from dla_recipes.testing import tiny

KEYS = [0, -2]  # the first token and the one before the query (the 2-token prompt: both the same)
NEAR = [-2, -1]  # inside any tiny model's sliding window (the family sweep: key 0 is outside some)
# Every tolerance below is both forwards' rounding of a score (score_rounding, bounds.py's model): the padded batch's
# (its pairs, its own score) and each prompt alone's (the weights A, the attention call's q . k * scaling). Measured
# before: log A differences 2.2e-6 of max(1, |difference|), own products 1.5e-6 of max(1, |score|) on the tiny
# families; 4.5e-6 and 4.6e-6 on the real models (SmolLM2 on an AVX-512 / AMX Xeon).


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
    received, and (``inputs``) what its q / k projections and norms read and wrote (``score_rounding``)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    module = attention_module(model, layer)
    original = sys.modules[type(module).__module__].eager_attention_forward
    seen = {}

    def recording(mod, query, key, value, attention_mask, *args, **kwargs):
        out = original(mod, query, key, value, attention_mask, *args, **kwargs)
        if mod is module:
            seen.update(q=query[0].float(), k=key[0].float(), scaling=kwargs.get("scaling"), weights=out[1][0])
        return out

    def keep(name):
        return lambda m, args, out: seen.setdefault("inputs", {}).update({name: (args[0][0].double(), out[0].double())})

    spec = score_spec(model, build_plan(model), f"L{layer}.H{head}", "block")
    names = {"q_proj": spec.q_proj, "k_proj": spec.k_proj, "q_norm": spec.q_norm, "k_norm": spec.k_norm}
    handles = [getattr(module, path).register_forward_hook(keep(name)) for name, path in names.items() if path]
    # registered as "eager", get_interface returns it whatever the module's globals (nnsight's .source rewrites them)
    assert "eager" not in ALL_ATTENTION_FUNCTIONS
    ALL_ATTENTION_FUNCTIONS["eager"] = recording
    try:
        ids = model.tokenizer(prompt, return_tensors="pt")
        model._module(**ids, output_attentions=True)
    finally:
        del ALL_ATTENTION_FUNCTIONS["eager"]
        for handle in handles:
            handle.remove()
    assert "weights" in seen, "the attention function was not called through the interface"
    seen.update(spec=spec, module=module)
    return seen["weights"][head].float(), seen  # [q, k]: what the attention function returned


def side_rounding(model, seen, side: str, head: int, positions) -> torch.Tensor:
    """``[len(positions), head_dim]``: how far one forward may have rounded the query (``side="q"``) or key of
    ``head`` at ``positions``, channel by channel. Model: each channel is a read of the block's stream by the q / k
    projection (``bounds.read_rounding`` of ``sum_j |W[c, j] x_j|``, the stream's adds before the attention, its
    norm, a ``d``-term dot); a q / k norm scales that by its ``|output / input|`` and rounds ``gamma_{n+1} / 2 + 5u``
    of its output; the rotary mixes a channel with its partner (``rotary_partners``), ``5u`` of the pair more."""
    spec, module, inputs = seen["spec"], seen["module"], seen["inputs"]
    dtype = model_dtype(model)
    u = bounds.unit_roundoff(dtype)
    projection = getattr(module, spec.q_proj if side == "q" else spec.k_proj)
    x, out = inputs[f"{side}_proj"]
    plan = build_plan(model)
    adds = len(plan.components("block", stop=spec.stop))
    magnitude = bounds.absolute_product(x, projection.weight.detach())
    if projection.bias is not None:
        magnitude = magnitude + projection.bias.detach().double().abs()
    width = spec.head_dim
    error = bounds.read_rounding(x.shape[-1], adds, dtype) * magnitude  # [pos, heads * width]
    values = out
    if f"{side}_norm" in inputs:
        normed_in, normed_out = inputs[f"{side}_norm"]
        n = normed_in.shape[-1]
        ratio = (normed_out.abs() / normed_in.abs()).nan_to_num(nan=0.0, posinf=0.0).reshape(error.shape)
        values = normed_out.reshape(error.shape)
        error = ratio * error + (bounds.gamma(n) / 2 + 5 * u) * values.abs()
    index = head if side == "q" else spec.kv_head
    error = error.reshape(error.shape[0], -1, width)[list(positions), index]  # [positions, width]
    values = values.reshape(values.shape[0], -1, width)[list(positions), index].abs()
    if spec.rotary is None:
        return error
    partners = rotary_partners(spec.rotary, width)
    return error + sum(error[:, p] for p in partners) + 5 * u * (values + sum(values[:, p] for p in partners))


def rotary_partners(module_name: str, width: int) -> list[torch.Tensor]:
    """``[[width]]``: the channel each channel's rotary pairs it with, read off the module's own ``rotate_half``
    (the halves, ``m + d/2``, or interleaved pairs, ``m ^ 1``); both where it has none."""
    rotate = getattr(sys.modules[module_name], "rotate_half", None)
    channel = torch.arange(width)
    if rotate is None:
        return [(channel + width // 2) % width, channel ^ 1]
    return [(rotate(torch.arange(1.0, width + 1)).abs() - 1).long()]


def score_rounding(model, seen, head: int, q_pos: int, keys) -> torch.Tensor:
    """``[len(keys)]``: how far one forward may have rounded ``head``'s score of query ``q_pos`` at each key. Model:
    ``score = scaling * q . k``, a ``head_dim``-term dot of a query and key each rounded as ``side_rounding`` says:
    ``scaling * sum_m (|k_m| dq_m + |q_m| dk_m + dq_m dk_m) + gamma_dh * scaling * sum_m |q_m k_m|``, then scaled
    and masked (``2u``) and stored (half its ulp)."""
    dtype = model_dtype(model)
    q = seen["q"][head, q_pos].double().abs()  # [d]
    kv = seen["k"].shape[0]
    k = seen["k"][head // (seen["q"].shape[0] // kv), list(keys)].double().abs()  # [keys, d]
    scaling = seen["scaling"] if seen["scaling"] is not None else q.shape[-1] ** -0.5
    dq = side_rounding(model, seen, "q", head, [q_pos])[0]
    dk = side_rounding(model, seen, "k", head, keys)
    score = scaling * (k * q).sum(-1)
    accumulated = torch.float32 if torch.finfo(dtype).bits < 32 else dtype
    product = scaling * (k * dq + q * dk + dk * dq).sum(-1) + bounds.gamma(q.shape[-1], accumulated) * score
    u = bounds.unit_roundoff(dtype)
    return product + 2 * u * score + bounds.half_ulp(score, dtype)


def check_against_eager(model, attr, layer: int, head: int, prompts=PROMPTS) -> tuple[float, float, float]:
    """The pairs' sum against the padded batch's own score, the score differences between the keys against ``log A``
    differences, the scores against the model's own product (each prompt alone): each gap over its bound, both
    forwards' ``score_rounding``; returns the three largest ratios."""
    sum_ratio = log_ratio = own_ratio = 0.0
    cap = attr.softcap
    dtype = model_dtype(model)
    u = bounds.unit_roundoff(dtype)
    for b, prompt in enumerate(prompts):
        weights, seen = eager_reference(model, layer, head, prompt)
        q_pos, keys = attr.queries[b], attr.keys[b]
        rounding = 2 * score_rounding(model, seen, head, q_pos, keys)  # [keys]: both forwards' (score_rounding)
        total = attr.values[b].double().sum((-2, -1)) + attr.constant[b].double()
        sum_ratio = max(sum_ratio, float(((total - attr.score[b].double()).abs() / rounding).max()))
        capped = total if cap is None else cap * torch.tanh(total / cap)
        logs = torch.log(weights[q_pos, list(keys)].double())
        # the softmax, in float32: the score less the row's largest (u of that), the exp (2u), the division (u; the
        # normaliser cancels in a difference), the weights stored in the model's dtype; a soft-cap's tanh (3u)
        spread = (torch.log(weights[q_pos].double().max()) - logs).abs()
        softmax = bounds.unit_roundoff(torch.float32) * (spread + 3) + u
        if cap is not None:
            softmax = softmax + 3 * u * capped.abs()
        for first in range(len(keys)):
            for second in range(first + 1, len(keys)):
                want = float(logs[first] - logs[second])
                got = float(capped[first] - capped[second])
                limit = float(rounding[first] + rounding[second] + softmax[first] + softmax[second])
                log_ratio = max(log_ratio, abs(got - want) / limit)
        kv = seen["k"].shape[0]
        q = seen["q"][head, q_pos]
        k = seen["k"][head // (seen["q"].shape[0] // kv), list(keys)]
        scaling = seen["scaling"] if seen["scaling"] is not None else q.shape[-1] ** -0.5
        own = (k @ q).double() * scaling  # the model's own pre-softmax product at the query and each key
        own_ratio = max(own_ratio, float(((attr.score[b].double() - own).abs() / rounding).max()))
    return sum_ratio, log_ratio, own_ratio


def prompt_rounding(model, attr, layer: int, head: int) -> torch.Tensor:
    """``[prompts, keys]``: one forward's ``score_rounding`` of ``attr``'s scores, each prompt alone."""
    rows = []
    for b, prompt in enumerate(attr.prompts):
        _, seen = eager_reference(model, layer, head, prompt)
        rows.append(score_rounding(model, seen, head, attr.queries[b], attr.keys[b]))
    return torch.stack(rows)


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
    sum_ratio, log_ratio, own_ratio = check_against_eager(model, attr, layer, head)  # over both forwards' rounding
    assert sum_ratio <= 1, f"{family} by={by}: the pairs off the score by {sum_ratio:.3g} bounds"
    assert log_ratio <= 1, f"{family} by={by}: score differences off log A differences by {log_ratio:.3g} bounds"
    assert own_ratio <= 1, f"{family} by={by}: score off the model's own q . k * scaling by {own_ratio:.3g} bounds"
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
    # each pair is a float32 product of a query and a key component (the forward's reads: score_rounding, both
    # splits), regrouped by a float32 sum of the heads' pairs (bounds.sum_bound)
    sums = torch.zeros(b, k, c, c, dtype=torch.float64)
    sums.index_add_(3, index, torch.zeros(b, k, c, heads.values.shape[3], dtype=torch.float64).index_add_(
        2, index, heads.values.double().abs()))
    limit = 2 * prompt_rounding(model, block, layer, 0)[..., None, None] + bounds.gamma(len(groups) ** 2) * sums
    assert float(((regrouped - block.values).abs() / limit).max()) <= 1
    assert torch.equal(heads.score, block.score)  # the model's own q . k: the same forward, whatever the split reads


def test_padded_batch_equals_each_prompt_alone():
    model = eager_model("gemma3")
    batch = dla_recipes.attribute_scores(model, PROMPTS, "L1.H0", keys=KEYS, by="head")
    for b, prompt in enumerate(PROMPTS):
        alone = dla_recipes.attribute_scores(model, prompt, "L1.H0", keys=KEYS, by="head")
        assert alone.keys[0] == batch.keys[b]
        limit = 2 * prompt_rounding(model, alone, 1, 0)[0]  # [keys]: both forwards' (score_rounding)
        assert float(((alone.values[0] - batch.values[b]).abs().amax((-2, -1)) / limit).max()) <= 1
        assert float(((alone.score[0] - batch.score[b]).abs() / limit).max()) <= 1


def test_views():
    attr = dla_recipes.attribute_scores(eager_model("llama"), PROMPTS, "L1.H0", keys=[0, 1], by="head")
    frame = attr.to_frame()
    assert len(frame) == attr.values.numel()
    summed = frame.groupby(["prompt", "key"])["value"].sum()
    for b in range(len(PROMPTS)):
        for k, key in enumerate(attr.keys[b]):
            # torch's float32 sum of the pairs (bounds.sum_bound) against pandas' float64 one
            limit = float(bounds.sum_bound(attr.values[b, k].flatten()))
            assert abs(summed[(b, key)] - float(attr.values[b, k].sum())) <= limit
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
        ratios = check_against_eager(model, attr, layer, head, IOI)  # over both forwards' rounding
        assert max(ratios) <= 1, (name, layer, ratios)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_low_precision(family, dtype):
    model = dla_recipes.load(tiny.build(family).to(dtype), tokenizer=tiny.tokenizer(), device_map="cpu",
                             attn_implementation="eager")
    attr = dla_recipes.attribute_scores(model, PROMPTS, "L1.H0", keys=KEYS, by="head")
    # both forwards' rounding in the model's dtype (score_rounding: its query, key and score rounded in it; measured
    # before: log A differences 1.2e-2 in bfloat16, the pairs' sum 9.2e-3 of max(1, |score|))
    sum_ratio, log_ratio, own_ratio = check_against_eager(model, attr, 1, 0)
    assert max(sum_ratio, log_ratio, own_ratio) <= 1, (family, dtype, sum_ratio, log_ratio, own_ratio)
