"""``check="adds"``: a write no component made is caught at its block; autocast over float32 is held to bfloat16.

A hidden write is a vector added by a plain torch forward hook (not ``intervene=``) to a block's output or to what
a sublayer writes (the module whose output the family table reads as the term: the MLP, or its post-norm), sized
as a fraction of the median norm of the stream leaving that block (a plain forward), in a seeded random direction
or along the logit's (``lm_head``'s target row minus its contrast row), at 0.3%, 1%, 3% and 10% of it. The stated
threshold is 0.3% of the stream's norm, at every checked block, in float32, bfloat16 and float16: at and above it,
every write raises ``ExactnessError`` naming its block, and a healthy call never raises (on SmolLM2 and Gemma-3
``benchmarks/HIDDEN_WRITES.md`` measured every write caught from 0.03%, the smallest size it tries). A write to a
block's output is held to no change at all (what the next block reads must be the stream the block wrote), a
write to a sublayer's output to the rounding of the block's adds, channel by channel (``dla_recipes.math.adds``).

Under ``torch.autocast("cpu", dtype=torch.bfloat16)`` a float32 model's parts sum to the logit of a plain
transformers forward under the same autocast within bfloat16's rounding; a hidden write there is refused with the
cause named first ("the forward ran under autocast to bfloat16").
"""

from __future__ import annotations

import pytest
import torch
from conftest import CONTRAST, FAST_FAMILIES, PROMPTS, TARGET, cover, plain_logits

import dla_recipes
from dla_recipes import models
from dla_recipes.errors import InputError
from dla_recipes.plan import build_plan
from dla_recipes.plan.build import module_at
from dla_recipes.testing import tiny
from dla_recipes.testing.hooks import adding
from dla_recipes.trace.adds import checked_blocks

THRESHOLD = 0.003  # of the stream's norm: caught at and above it (the module docstring)
SIZES = (THRESHOLD, 0.01, 0.03, 0.1)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# a parallel block, a multiplier on each write, sandwich norms, a hybrid mixer with parallel MLP, routed experts
MORE = ("cohere", "granite", "olmo2", "falcon_h1", "qwen2_moe", "phi", "bloom", "mamba")
_MODELS: dict = {}


def model_in(family: str, dtype: torch.dtype):
    if (family, dtype) not in _MODELS:
        _MODELS[(family, dtype)] = dla_recipes.load(tiny.build(family).to(dtype), tokenizer=tiny.tokenizer(),
                                                    device_map="cpu")
    return _MODELS[(family, dtype)]


def stream_norms(model) -> list[float]:
    """The median norm of the stream leaving each block, over the prompts' positions (a plain forward, hooked)."""
    norms: dict[int, list] = {}
    handles = [layer._module.register_forward_hook(
        lambda m, a, out, i=i: norms.setdefault(i, []).append((out[0] if isinstance(out, tuple) else out).float()))
        for i, layer in enumerate(model.layers)]
    try:
        for prompt in PROMPTS:
            plain_logits(model, prompt)
    finally:
        for handle in handles:
            handle.remove()
    return [float(torch.cat([x.reshape(-1, x.shape[-1]) for x in norms[i]]).norm(dim=-1).median())
            for i in range(len(model.layers))]


def sublayer_module(model, i: int):
    """The torch module whose output block ``i``'s last term (read at an ``.output``) is, per the family table."""
    plan = build_plan(model)
    term = [p.term for p in plan.layers[i] if p.term.output.endswith(".output")][-1].output
    return module_at(model.layers[i], term.rsplit(".", 1)[0])._module


def directions(model, d: int, seed: int) -> dict[str, torch.Tensor]:
    """A seeded random unit direction and the logit's (``lm_head``'s target row minus its contrast row), unit."""
    weight = model._module.get_output_embeddings().weight.float()
    t, c = (model.tokenizer.convert_tokens_to_ids(token) for token in (TARGET, CONTRAST))
    random = torch.randn(d, generator=torch.Generator().manual_seed(seed))
    return {"random": random / random.norm(), "logit": (weight[t] - weight[c]) / (weight[t] - weight[c]).norm()}


def attributed_with(model, module, vector):
    """``attribute(check="adds")`` with ``vector`` added to ``module``'s output: the error's message, or None."""
    handle = module.register_forward_hook(adding(vector))
    try:
        dla_recipes.attribute(model, PROMPTS, TARGET, contrast=CONTRAST, by="block", check="adds")
        return None
    except dla_recipes.ExactnessError as error:
        return str(error)
    finally:
        handle.remove()


@pytest.mark.parametrize(("family", "dtype"), cover(FAST_FAMILIES + MORE, DTYPES, per_family=1))
def test_a_hidden_write_is_caught_at_its_block(family, dtype):
    model = model_in(family, dtype)
    plan = build_plan(model)
    checked = sorted(checked_blocks(plan))
    assert checked == list(range(len(plan.layers))), f"{family}: every block is checked ({checked})"
    healthy = dla_recipes.attribute(model, PROMPTS, TARGET, contrast=CONTRAST, by="head", check="adds")
    assert healthy.values.shape[0] == len(PROMPTS)  # a healthy call never raises (here: by head, all its reads)
    norms = stream_norms(model)
    last = len(plan.layers) - 1
    missed = []
    for k, (layer, site) in enumerate([(0, "block"), (last // 2, "sublayer"), (last, "block"), (0, "sublayer"),
                                       (last, "sublayer")]):
        module = model.layers[layer]._module if site == "block" else sublayer_module(model, layer)
        for name, v in directions(model, model.lm_head.weight.shape[-1], k).items():
            for size in SIZES:
                message = attributed_with(model, module, size * norms[layer] * v)
                if message is None or f"block {layer}'s" not in message:
                    missed.append((layer, site, name, size, (message or "returned")[:160]))
    assert not missed, f"{family} {dtype}: writes at or above {THRESHOLD:.0%} not caught at their block: {missed}"


def test_the_error_names_the_block_and_the_writes_size():
    model = model_in("llama", torch.bfloat16)
    norms = stream_norms(model)
    v = directions(model, model.lm_head.weight.shape[-1], 0)["random"]
    message = attributed_with(model, model.layers[1]._module, 0.02 * norms[1] * v)
    assert "the stream between block 1's output and block 2's input" in message, message
    percent = float(message.split("% of the stream's norm")[0].rsplit("(", 1)[1])
    assert 1.0 < percent < 4.0, message  # 2% of the median norm, measured at one prompt's position
    message = attributed_with(model, sublayer_module(model, 2), 0.02 * norms[2] * v)
    assert "block 2's residual adds" in message and "rounding allows" in message, message
    # the default check is the whole logit's: this write is below its bound in bfloat16 (the reason for check="adds")
    handle = model.layers[1]._module.register_forward_hook(adding(0.002 * norms[1] * v))
    try:
        dla_recipes.attribute(model, PROMPTS, TARGET, contrast=CONTRAST, by="block")
        with pytest.raises(dla_recipes.ExactnessError, match="block 1's output"):
            dla_recipes.attribute(model, PROMPTS, TARGET, contrast=CONTRAST, by="block", check="adds")
    finally:
        handle.remove()


def test_check_is_a_choice():
    model = model_in("llama", torch.float32)
    with pytest.raises(InputError, match="check='everything'"):
        dla_recipes.attribute(model, PROMPTS, TARGET, check="everything")
    with pytest.raises(InputError, match="check=True"):
        dla_recipes.attribute_direction(model, PROMPTS, torch.ones(model.lm_head.weight.shape[-1]), layer=1,
                                        check=True)


def test_attribute_direction_checks_the_blocks_before_its_norm():
    model = model_in("llama", torch.bfloat16)
    d = torch.ones(model.lm_head.weight.shape[-1])
    dla_recipes.attribute_direction(model, PROMPTS, d, layer=2, check="adds")  # healthy
    norms = stream_norms(model)
    handle = sublayer_module(model, 1).register_forward_hook(adding(THRESHOLD * norms[1] * d / d.norm()))
    try:
        with pytest.raises(dla_recipes.ExactnessError, match="block 1's residual adds"):
            dla_recipes.attribute_direction(model, PROMPTS, d, layer=2, check="adds")
    finally:
        handle.remove()


def autocast_differences(model) -> torch.Tensor:
    """Per prompt: the target's minus the contrast's logit before any soft-cap (``lm_head``'s output, read by a
    torch hook, times the family's logit scale) of a plain transformers forward of the prompt alone, under
    ``torch.autocast("cpu", dtype=torch.bfloat16)`` (float64)."""
    ids = [model.tokenizer.convert_tokens_to_ids(token) for token in (TARGET, CONTRAST)]
    heads: list = []
    handle = model._module.get_output_embeddings().register_forward_hook(lambda m, a, out: heads.append(out))
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            for prompt in PROMPTS:
                plain_logits(model, prompt)
    finally:
        handle.remove()
    rows = [h[0, -1, ids].double() * build_plan(model).logit_scale for h in heads]
    return torch.stack([r[0] - r[1] for r in rows])


@pytest.mark.parametrize(("family", "by"), cover(["llama", "gpt2", "gemma2", "mixtral", "qwen3", "olmo2"],
                                                 ["block", "head", "neuron"], per_family=1))
def test_autocast_over_float32_is_attributed_within_bfloat16(family, by):
    model = model_in(family, torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        attr = dla_recipes.attribute(model, PROMPTS, TARGET, contrast=CONTRAST, by=by, check="adds")
    own = autocast_differences(model)
    total = attr.values.double().sum(-1) + attr.constant.double()
    # two bfloat16 forwards (the padded batch, each prompt alone), each within the self-check's bound of its own
    # rounding (conftest.own_ratio's model), the bound sized by bfloat16 (not float32's 1e-4 * max(1, |logit|))
    bound = attr.diagnostics["bound"].double()
    assert bool(((total - own).abs() <= 2 * bound).all()), (family, by, (total - own).tolist(), bound.tolist())
    assert bool((bound > 1e-3 * torch.clamp(own.abs(), min=1.0)).all()), "the bound is bfloat16's, not float32's"


def test_autocast_is_named_as_the_cause():
    model = model_in("llama", torch.float32)
    norms = stream_norms(model)
    v = directions(model, model.lm_head.weight.shape[-1], 1)["random"]
    handle = sublayer_module(model, 1).register_forward_hook(adding(0.05 * norms[1] * v))
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(dla_recipes.ExactnessError) as error:
            dla_recipes.attribute(model, PROMPTS, TARGET, contrast=CONTRAST, by="block", check="adds")
    finally:
        handle.remove()
    assert str(error.value).startswith("The forward ran under autocast to bfloat16 (the parameters are float32"), error
    assert "block 1's residual adds" in str(error.value)


REAL = [pytest.param("smollm2-135m", marks=pytest.mark.slow), pytest.param("gemma3-270m", marks=pytest.mark.slow)]


@pytest.mark.real
@pytest.mark.parametrize("name", REAL)
def test_real_models_hidden_writes_in_bfloat16(name):
    model = dla_recipes.load(models.REGISTRY[name](), dtype=torch.bfloat16, device_map="cpu", dispatch=True)
    prompts = ["The Eiffel Tower is in the city of", "The capital of Italy is"]
    dla_recipes.attribute(model, prompts, " Paris", contrast=" Rome", by="head", check="adds")  # healthy
    hf = model._module.model.layers
    n = len(hf)
    gen = torch.Generator().manual_seed(0)
    missed = []
    for layer in (1, n // 2, n - 2):
        enc = model.tokenizer(prompts[0], return_tensors="pt")
        with torch.no_grad():
            stream = model._module(**enc, output_hidden_states=True).hidden_states[layer + 1][0].float()
        v = torch.randn(stream.shape[-1], generator=gen)
        v = THRESHOLD * float(stream.norm(dim=-1).median()) * v / v.norm()
        post = getattr(hf[layer], "post_feedforward_layernorm", None) or hf[layer].mlp
        for site, module in (("block", hf[layer]), ("mlp", post)):
            handle = module.register_forward_hook(adding(v))
            try:
                dla_recipes.attribute(model, prompts, " Paris", contrast=" Rome", by="block", check="adds")
                missed.append((layer, site, "returned"))
            except dla_recipes.ExactnessError as error:
                if f"block {layer}'s" not in str(error):
                    missed.append((layer, site, str(error)[:160]))
            finally:
                handle.remove()
    assert not missed, missed
    with torch.autocast("cpu", dtype=torch.bfloat16):  # a bfloat16 model under autocast: nothing changes
        dla_recipes.attribute(model, prompts, " Paris", contrast=" Rome", by="block", check="adds")


@pytest.mark.real
@pytest.mark.slow
def test_real_float32_model_under_autocast():
    model = dla_recipes.load(models.REGISTRY["smollm2-135m"](), dtype=torch.float32, device_map="cpu", dispatch=True)
    prompts = ["The Eiffel Tower is in the city of", "The capital of Italy is"]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        attr = dla_recipes.attribute(model, prompts, " Paris", contrast=" Rome", by="head", check="adds")
        ids = [model.tokenizer(t, add_special_tokens=False)["input_ids"][0] for t in (" Paris", " Rome")]
        own = []
        for prompt in prompts:
            with torch.no_grad():
                logits = model._module(**model.tokenizer(prompt, return_tensors="pt")).logits[0, -1].double()
            own.append(float(logits[ids[0]] - logits[ids[1]]))
    total = attr.values.double().sum(-1) + attr.constant.double()
    bound = attr.diagnostics["bound"].double()
    assert bool(((total - torch.tensor(own, dtype=torch.float64)).abs() <= 2 * bound).all()), (total, own, bound)


@pytest.mark.parametrize(("family", "by"), cover(FAST_FAMILIES, ("block", "head"), per_family=1))
def test_the_add_check_never_waits_for_the_device(family, by):
    """``check="adds"`` (bfloat16, a padded batch, the second call): no wait and no upload while the forward runs,
    counted as a GPU would see them (``test_syncs``); its reads are at the sites, never a whole activation."""
    from test_syncs import PROMPTS as PADDED
    from test_syncs import bf16_model, counting, waits

    model = bf16_model(family)
    call = lambda: dla_recipes.attribute(model, PADDED, "w20", contrast="w21", by=by, check="adds")
    counting(model, call)  # the first call probes the norms
    _, traces = counting(model, call)
    assert traces
    for counts in traces:
        assert waits(counts) == [], (family, by, waits(counts))
        full = len(PADDED) * 10 * model.lm_head.weight.shape[-1]
        assert counts.largest_widening("recipe") < full, (family, by, counts.largest_widening("recipe"), full)
    # attribute_direction stops inside the forward, so its end (the copy of its result) is mid-forward: none of the
    # per-add check's own work may wait there
    d = torch.ones(model.lm_head.weight.shape[-1])
    direction = lambda: dla_recipes.attribute_direction(model, PADDED, d, layer=2, check="adds")
    counting(model, direction)
    _, traces = counting(model, direction)
    mine = [w for counts in traces for w in waits(counts) if "adds.py" in w[1]]
    assert mine == [], mine


def test_reduce_stats_keeps_the_site_whose_adds_fail():
    """``reduce="stats"`` sends back only the rows nearest to failing: a site whose adds fail is one of them, so the
    self-check on those rows raises as on all of them (here a small write off the logit's direction, at one prompt
    only, so its sum is no nearer to failing than the others')."""
    model = model_in("llama", torch.bfloat16)
    prompts = PROMPTS * 3  # 9 sites, the stats keep 4 rows
    dla_recipes.attribute(model, prompts, TARGET, contrast=CONTRAST, by="block", reduce="stats", check="adds")
    norms = stream_norms(model)
    both = directions(model, model.lm_head.weight.shape[-1], 2)
    v = both["random"] - (both["random"] @ both["logit"]) * both["logit"]  # off the logit: its sum stays in bound
    v = 0.001 * norms[1] * v / v.norm()

    def hook(module, args, output):  # the write at the last prompt only (row 8 of the batch)
        out = output[0] if isinstance(output, tuple) else output
        out = out.clone()
        out[-1] = out[-1] + v.to(out.dtype)
        return (out,) + tuple(output[1:]) if isinstance(output, tuple) else out

    handle = sublayer_module(model, 1).register_forward_hook(hook)
    try:
        with pytest.raises(dla_recipes.ExactnessError, match="block 1's residual adds"):
            dla_recipes.attribute(model, prompts, TARGET, contrast=CONTRAST, by="block", reduce="stats", check="adds")
    finally:
        handle.remove()


@pytest.mark.server
def test_remote_check_adds_equals_local(tmp_path):
    """``check="adds"`` travels with the request: on a loopback server run as NDIF runs a request (bfloat16, sdpa,
    under autocast) the attribution and its self-check's bound equal the same local model's under the same bracket."""
    from conftest import serve_tiny, single_threaded

    with serve_tiny(tmp_path, ("llama",), ndif=True) as server:
        with server.client():
            remote = dla_recipes.attribute(server.remote_model("llama"), PROMPTS, TARGET, contrast=CONTRAST,
                                           by="head", remote=True, check="adds")
        with single_threaded(), server.bracket():
            local = dla_recipes.attribute(server.local_model("llama", dispatch=True), PROMPTS, TARGET,
                                          contrast=CONTRAST, by="head", check="adds")
    assert torch.equal(remote.values, local.values), float((remote.values - local.values).abs().max())
    assert torch.equal(remote.diagnostics["bound"], local.diagnostics["bound"])
    # the adds were checked server side: each row's worst add, over its own rounding, as the local one
    assert torch.equal(remote.diagnostics["add_rounding"], local.diagnostics["add_rounding"])
    assert bool((remote.diagnostics["add_rounding"] > 0).all() & (remote.diagnostics["add_rounding"] <= 1).all())


def test_an_edit_through_intervene_is_a_components():
    """An edit of a sublayer's output passed as ``intervene=`` is that sublayer's write (the adds hold, and the parts
    sum to the edited model's logit); an edit of the stream itself is a write no component made, named at its block."""
    model = model_in("llama", torch.bfloat16)

    def steer(m):
        m.layers[1].mlp.output = m.layers[1].mlp.output + 0.05

    def edit_stream(m):
        m.layers[1].output = m.layers[1].output + 0.05

    attr = dla_recipes.attribute(model, PROMPTS, TARGET, contrast=CONTRAST, by="neuron", intervene=steer, check="adds")
    assert bool((attr.diagnostics["add_rounding"] <= 1).all())
    with pytest.raises(dla_recipes.ExactnessError, match="block 1's residual adds.*edit a sublayer's output"):
        dla_recipes.attribute(model, PROMPTS, TARGET, contrast=CONTRAST, by="block", intervene=edit_stream,
                              check="adds")


def test_dictionaries_keep_the_add_check():
    """Features (``dictionaries=``) with ``check="adds"``: a dictionary's term is read whole where it is added, so
    its block's adds are still checked (a healthy call passes, a hidden 1% write on that block's MLP is named at
    it); with a residual dictionary at block 2 the blocks after it are checked (the stream before it is the
    dictionary's own input: what was written there is its latents' and error's, not a hidden write)."""
    from dla_recipes.features import Dictionary, Encoder

    model = model_in("llama", torch.bfloat16)
    d, width = model.lm_head.weight.shape[-1], 32
    g = torch.Generator().manual_seed(0)
    sae = Dictionary(torch.randn(width, d, generator=g) * 0.1, torch.randn(d, generator=g) * 0.01,
                     Encoder(torch.randn(d, width, generator=g), torch.randn(width, generator=g) * 0.1 - 0.5))
    norms, v = stream_norms(model), directions(model, d, 3)["random"]
    for dictionaries, layer in (({"L1.mlp": sae}, 1), ({"L2.resid": sae}, 2)):
        call = {"contrast": CONTRAST, "by": "head", "check": "adds", "dictionaries": dictionaries}
        healthy = dla_recipes.attribute(model, PROMPTS, TARGET, **call)
        assert any(label.startswith(next(iter(dictionaries)) + ".F") for label in healthy.labels)
        handle = sublayer_module(model, layer).register_forward_hook(adding(0.01 * norms[layer] * v))
        try:
            with pytest.raises(dla_recipes.ExactnessError, match=f"block {layer}'s"):
                dla_recipes.attribute(model, PROMPTS, TARGET, **call)
        finally:
            handle.remove()
