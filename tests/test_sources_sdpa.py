"""``by="source"`` without eager attention: the pattern recomputed from the attention call's inputs (sdpa).

Under sdpa the attention module returns no weights, so the recipe recomputes the pattern at the attributed sites
from what transformers' attention function receives (``trace.kinds.pattern``). Every tiny family that splits by
source under eager attention must split under sdpa too, its parts equal to the eager model's (the eager model
returns the pattern it computed: its parts are what ``test_sources`` checks against first principles) and summing
to the sdpa model's own logit (a plain transformers forward of each prompt alone); the families transformers cannot
run with sdpa at all are named (``NO_SDPA``). A recomputation made wrong on purpose (a perturbed key) is refused by
the heads rebuilt from it against the output projection's real input, never answered.
"""

import pytest
import torch
from conftest import (
    CONTRAST,
    PROMPTS,
    TARGET,
    assert_parts_are_the_models,
    eager_model,
    is_source_refusal,
    plain_logits,
)
from test_positions import batch_bound, batch_ratio, difference
from test_sources import SUPPORTED

import dla_recipes
from dla_recipes import DLAError, ExactnessError
from dla_recipes.plan import build_plan, module_at
from dla_recipes.testing import tiny
from dla_recipes.trace.kinds import pattern

# Families transformers itself refuses to load with attn_implementation="sdpa" (a ValueError naming sdpa; measured):
# soft-capped attention (gemma2, vaultgemma), attention sinks (gpt_oss), flint. They split by source under eager.
NO_SDPA = ["gemma2", "gpt_oss", "vaultgemma", "flint"]
# Families whose attention is their own code (no attention implementation to switch): transformers runs it whatever
# attn_implementation says, and it returns its pattern, which the split reads as under eager.
OWN_ATTENTION = ["bloom"]
# sdpa and eager are two forwards of the same model: a part may differ between them by both forwards' rounding of the
# logit it is a term of (test_positions.batch_bound, bounds.py's model; measured 3.9e-6 of the largest part at most,
# gemma4_moe on an AVX-512 / AMX Xeon, 9.6e-7 on AVX2). A wrong split is off by a source's share of a head, ~1e-1
# of the largest part.


_SDPA: dict[str, object] = {}


def sdpa_model(family: str):
    """A tiny perturbed ``family`` model with sdpa attention (cached for the session), the same weights as
    ``eager_model(family)`` (``tiny.standardized`` builds each family from one seed)."""
    if family not in _SDPA:
        _SDPA[family] = tiny.standardized(family, attn_implementation="sdpa")
    return _SDPA[family]


def attention_module(model):
    """The torch module of the last block with attention heads whose second output is the pattern under eager
    attention (a hybrid's last block may be a recurrent one)."""
    plan = build_plan(model)
    i, term = [(i, p.term) for i, terms in enumerate(plan.layers) for p in terms if p.term.splits_heads][-1]
    return module_at(model.layers[i], term.split.projection.rsplit(".", 1)[0])._module


def returns_no_pattern(model) -> bool:
    """Whether a plain forward of the model (a hook on the last block's attention) returns no attention weights."""
    seen = []
    handle = attention_module(model).register_forward_hook(lambda m, a, out: seen.append(out))
    try:
        ids = model.tokenizer(PROMPTS[0], return_tensors="pt")
        with torch.no_grad():
            model._module(**ids)
    finally:
        handle.remove()
    out = seen[0]
    return not (isinstance(out, tuple) and len(out) > 1 and out[1] is not None)


def last_positions(model, prompts) -> list[int]:
    return [len(model.tokenizer(p)["input_ids"]) - 1 for p in prompts]


def limits(model, prompts=PROMPTS, positions=None) -> torch.Tensor:
    """``[len(prompts)]``: how far each row's parts may move between two forwards (sdpa and eager, another batch):
    both forwards' rounding of the row's logit difference (``test_positions.batch_bound``), at its last position
    unless ``positions`` says."""
    positions = last_positions(model, prompts) if positions is None else positions
    return batch_bound(model, prompts, difference(model), positions)


def gap(ours, eager, limit) -> float:
    """The largest ``|ours - eager|`` of a row's parts (the same labels) over the row's ``limit``."""
    assert ours.labels == eager.labels
    return batch_ratio(ours.values, eager.values, limit)


# every family but NO_SDPA: those that split under eager (SUPPORTED and others) and those refused under eager
FAMILIES = [f for f in SUPPORTED if f not in NO_SDPA] + [f for f in tiny.FAMILIES if f not in SUPPORTED
                                                        and f not in NO_SDPA]


@pytest.mark.parametrize("family", FAMILIES)
def test_sdpa_equals_eager(family):
    """Where the eager model splits by source, the sdpa model (which returns no pattern) splits too: the same parts
    within both forwards' rounding (``limits``), summing to the sdpa model's own logit; where eager refuses, sdpa
    refuses."""
    eager = eager_model(family)
    try:
        reference = dla_recipes.attribute(eager, PROMPTS, TARGET, contrast=CONTRAST, by="source")
    except DLAError as error:
        assert family not in SUPPORTED and is_source_refusal(error), f"{family}: {type(error).__name__}: {error}"
        try:
            model = sdpa_model(family)
        except ValueError as refused:  # transformers runs this family with no sdpa at all
            assert "scaled_dot_product_attention" in str(refused), str(refused)
            return
        with pytest.raises(DLAError) as raised:
            dla_recipes.attribute(model, PROMPTS, TARGET, contrast=CONTRAST, by="source")
        assert is_source_refusal(raised.value), f"{family}: {type(raised.value).__name__}: {raised.value}"
        return
    model = sdpa_model(family)
    own_code = family in OWN_ATTENTION  # else: the sdpa model returns no pattern, it is recomputed
    assert returns_no_pattern(model) != own_code, f"{family}: returns its pattern: {own_code}"
    attr = dla_recipes.attribute(model, PROMPTS, TARGET, contrast=CONTRAST, by="source")
    assert any(".S" in label for label in attr.labels)
    ratio = gap(attr, reference, limits(model))  # both forwards' rounding (limits)
    assert ratio <= 1, f"{family}: sdpa vs eager {ratio:.3g} bounds"
    assert_parts_are_the_models(model, attr, PROMPTS, f"{family} by=source (sdpa)")
    assert attr.diagnostics["norm_fit_error"] <= 1e-4  # includes the recomputed pattern rebuilding the heads


@pytest.mark.parametrize("family", NO_SDPA)
def test_transformers_refuses_sdpa(family):
    """The families left out above cannot be loaded with sdpa at all (transformers' own refusal), while they split
    by source under eager attention (test_sources)."""
    with pytest.raises(ValueError, match="scaled_dot_product_attention"):
        tiny.standardized(family, attn_implementation="sdpa")


@pytest.mark.parametrize("family", ["llama", "gemma3", "gpt2"])
def test_each_prompt_alone_and_every_position(family):
    """A prompt alone (sdpa gets no mask: causal) equals its row of the padded batch (a boolean mask), and every
    position of every prompt (several sites per prompt, each its own query row) equals eager's."""
    model, eager = sdpa_model(family), eager_model(family)
    batch = dla_recipes.attribute(model, PROMPTS, TARGET, contrast=CONTRAST, by="source").sources()
    for b, prompt in enumerate(PROMPTS):
        alone = dla_recipes.attribute(model, prompt, TARGET, contrast=CONTRAST, by="source")
        assert_parts_are_the_models(model, alone, [prompt], f"{family} alone (sdpa)")
        grid, n = alone.sources()[0], alone.sources().shape[-1]
        ratio = batch_ratio(batch[b, ..., :n].nan_to_num(), grid.nan_to_num(), limits(model, [prompt]))
        assert ratio <= 1, (family, b, ratio)  # both batchings' rounding (limits)
        assert bool((batch[b, ..., n:] == 0).all())
    every = dla_recipes.attribute(model, PROMPTS, TARGET, contrast=CONTRAST, by="source", position="all").sites
    reference = dla_recipes.attribute(eager, PROMPTS, TARGET, contrast=CONTRAST, by="source", position="all").sites
    assert len(every) == sum(len(p.split()) for p in PROMPTS)
    ratio = gap(every, reference, limits(model, list(every.prompts), [int(p) for p in every.positions]))
    assert ratio <= 1, (family, ratio)  # both forwards' rounding at each site (limits)
    own = {prompt: own_differences(model, prompt) for prompt in PROMPTS}
    totals = every.values.double().sum(-1) + every.constant.double()
    for s, (prompt, position) in enumerate(zip(every.prompts, every.positions, strict=True)):
        want = own[prompt][position]
        assert abs(float(totals[s]) - want) <= 1e-4 * max(1.0, abs(want)), (family, prompt, position)


def own_differences(model, prompt: str) -> list[float]:
    """``[pos]``: the model's own logit(TARGET) - logit(CONTRAST) before its final soft-cap at every position of a
    plain transformers forward of ``prompt`` alone (each capped logit undone on its own, as
    ``conftest.plain_differences``)."""
    cap = build_plan(model).softcap
    ids = [model.tokenizer.convert_tokens_to_ids(token) for token in (TARGET, CONTRAST)]
    y = plain_logits(model, prompt)[:, ids].double()
    if cap is not None:
        y = cap * torch.atanh(y / cap)
    return (y[:, 0] - y[:, 1]).tolist()


def test_perturbed_key_is_refused(monkeypatch):
    """The pattern recomputed from a wrong key (the call's key with noise of its own size added) does not rebuild
    the heads the output projection reads: a refusal naming the block, never an answer nor an ExactnessError."""
    model = sdpa_model("llama")
    real = pattern.call_inputs

    def perturbed(call, family, heads):
        named = real(call, family, heads)
        key = named["key"]
        noise = torch.randn(key.shape, generator=torch.Generator().manual_seed(0)).to(key)
        named["key"] = key + noise * key.std()
        return named

    monkeypatch.setattr(pattern, "call_inputs", perturbed)
    with pytest.raises(DLAError, match="are not its attention pattern times its values") as raised:
        dla_recipes.attribute(model, PROMPTS, TARGET, contrast=CONTRAST, by="source")
    assert is_source_refusal(raised.value) and not isinstance(raised.value, ExactnessError)
    monkeypatch.setattr(pattern, "call_inputs", real)  # the same model splits again
    dla_recipes.attribute(model, PROMPTS, TARGET, contrast=CONTRAST, by="source")


def test_no_attention_call_is_refused(monkeypatch):
    """A model whose attention returns no pattern and calls no attention function by the name it looks for is
    refused before any answer, naming the family and the fix."""
    monkeypatch.setattr(pattern, "CALL", "no_such_attention_function")
    with pytest.raises(DLAError, match="llama.*attn_implementation='eager'") as raised:
        dla_recipes.attribute(sdpa_model("llama"), PROMPTS, TARGET, by="source")
    assert is_source_refusal(raised.value)


def test_unknown_call_argument_is_refused(monkeypatch):
    """A keyword argument of the attention call the recomputation does not know (one that could change the
    pattern) is refused by name."""
    monkeypatch.setattr(pattern, "INERT", pattern.INERT - {"scaling"})
    with pytest.raises(DLAError, match="scaling, which this recomputation does not know") as raised:
        dla_recipes.attribute(sdpa_model("llama"), PROMPTS, TARGET, by="source")
    assert is_source_refusal(raised.value)


def test_ignored_mask_is_refused(monkeypatch):
    """A recomputation that loses the mask (the padding and causality of the batch) is caught by the rebuilt heads."""
    monkeypatch.setattr(pattern, "ARGUMENTS", pattern.ARGUMENTS[:-1])  # the 5th positional input is dropped
    with pytest.raises(DLAError, match="are not its attention pattern times its values") as raised:
        dla_recipes.attribute(sdpa_model("llama"), PROMPTS, TARGET, contrast=CONTRAST, by="source")
    assert is_source_refusal(raised.value) and not isinstance(raised.value, ExactnessError)


@pytest.mark.server
def test_remote_sdpa_equals_local(tmp_path):
    """On the loopback NDIF server, sdpa (the default): remote equals local bit for bit, and eager within ``limits``."""
    from conftest import serve_tiny, single_threaded

    with serve_tiny(tmp_path, ("llama", "gemma3")) as server:
        for family in ("llama", "gemma3"):
            with server.client():
                remote = dla_recipes.attribute(server.remote_model(family, attn_implementation="sdpa"), PROMPTS,
                                               TARGET, contrast=CONTRAST, by="source", remote=True)
            with single_threaded():
                local = dla_recipes.attribute(server.local_model(family, attn_implementation="sdpa"), PROMPTS,
                                              TARGET, contrast=CONTRAST, by="source")
                eager = dla_recipes.attribute(server.local_model(family, attn_implementation="eager"), PROMPTS,
                                              TARGET, contrast=CONTRAST, by="source")
            assert remote.labels == local.labels and any(".S" in label for label in remote.labels)
            assert torch.equal(remote.values, local.values), float((remote.values - local.values).abs().max())
            limit = limits(sdpa_model(family))  # both forwards' rounding (limits; the served weights: tiny.build)
            assert gap(remote, eager, limit) <= 1


@pytest.mark.real
@pytest.mark.slow  # loads each real model twice (sdpa and eager): seconds of CPU
@pytest.mark.parametrize("name", ["smollm2-135m", "gemma3-270m"])
def test_real_models_sdpa_equals_eager(name):
    from dla_recipes import models

    path = models.REGISTRY[name]()
    prompts = ["The Eiffel Tower is in the city of", "Paris is the capital of"]
    attrs = {}
    for implementation in ("sdpa", "eager"):
        model = dla_recipes.load(path, dtype=torch.float32, device_map="cpu", attn_implementation=implementation)
        attrs[implementation] = dla_recipes.attribute(model, prompts, " Paris", contrast=" Rome", by="source")
        if implementation == "sdpa":
            assert returns_no_pattern(model)
            ids = [model.tokenizer(t, add_special_tokens=False)["input_ids"][0] for t in (" Paris", " Rome")]
            for b, prompt in enumerate(prompts):  # the parts sum to the sdpa model's own logit difference
                with torch.no_grad():
                    logits = model._module(**model.tokenizer(prompt, return_tensors="pt")).logits[0, -1].double()
                own = float(logits[ids[0]] - logits[ids[1]])
                total = float(attrs["sdpa"].values[b].double().sum() + attrs["sdpa"].constant[b].double())
                assert abs(total - own) <= 1e-4 * max(1.0, abs(own)), (name, b, total, own)
    # both forwards' rounding of each prompt's logit difference (limits; measured: 2.11e-6 of the largest part at
    # most, SmolLM2-135M on an AVX-512 CPU); a wrong pattern or value moves a part by O(1)
    limit = batch_bound(model, prompts, lambda b, p, z: z[p, ids[0]] - z[p, ids[1]], last_positions(model, prompts))
    ratio = gap(attrs["sdpa"], attrs["eager"], limit)
    assert ratio <= 1, ratio
