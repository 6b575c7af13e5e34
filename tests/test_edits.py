"""Edits after a sublayer's projection (issue 22, items 1-3): attributed as ``L{i}.{term}.edit``, caught when unknown.

A split term's heads or neurons are read from its projection's input, so an edit of what the sublayer writes
(steering ``mlp.output``, patching ``self_attn.output``) is in none of them. With ``intervene=`` (or inside
``trace_attribution``) each split term has an ``.edit`` column holding what it wrote beyond its parts and bias; the
reference here is always the model's own: a plain transformers forward with the same edit made by a torch hook,
and the steering vector's own share computed from first principles (the final norm frozen at the real stream,
written in the test). An edit the package does not know of (a torch hook on the projection) must raise in
bfloat16 too, naming the term, not pass under the stream's looser bound.
"""

import bounds
import pytest
import torch

import dla_recipes
from dla_recipes import models

pytestmark = pytest.mark.slow  # both real models in bfloat16 (and float32), ~12 s of CPU for SmolLM2's part alone

EIFFEL = "The Eiffel Tower is in the city of"
CORRUPT = "The Colosseum is in the city of"


def _load(name: str, dtype):
    model = dla_recipes.load(models.REGISTRY[name](), dtype=dtype, device_map="cpu")
    dla_recipes.attribute(model, "a b", " Paris")  # dispatch the weights once: torch hooks go on the real modules
    return model


@pytest.fixture(scope="module", params=["smollm2-135m", "gemma3-270m"])
def bf16_model(request):
    return _load(request.param, torch.bfloat16)


def _decoder(model):
    hf = model._module
    return hf.model.language_model if hasattr(hf.model, "language_model") else hf.model


def _ids(model, tokens):
    return [model.tokenizer(t, add_special_tokens=False)["input_ids"][0] for t in tokens]


def _plain(model, prompt: str, hooks=()):
    """``(logits [vocab] at the last position, final norm input [d_model])`` of a plain transformers forward of
    ``prompt`` alone, with ``hooks`` ``[(module, fn)]`` registered as forward hooks for the call."""
    seen = {}
    handles = [module.register_forward_hook(fn) for module, fn in hooks]
    handles.append(_decoder(model).norm.register_forward_hook(lambda m, i, o: seen.__setitem__("x", i[0])))
    try:
        ids = model.tokenizer(prompt, return_tensors="pt")
        with torch.no_grad():
            logits = model._module(**ids).logits[0, -1].float()
    finally:
        for h in handles:
            h.remove()
    return logits, seen["x"][0, -1].float()


def _writes(model):
    """Each block's two modules whose outputs are what it adds to the stream, in order (Gemma: the post-norms)."""
    for layer in _decoder(model).layers:
        post = getattr(layer, "post_attention_layernorm", None) if hasattr(layer, "pre_feedforward_layernorm") else None
        yield (post, layer.post_feedforward_layernorm) if post is not None else (layer.self_attn, layer.mlp)


def _sum_bound(model, prompt: str, target: int, contrast: int, hooks=()) -> float:
    """How far the parts may sum from the model's own bfloat16 ``logit(target) - logit(contrast)``, one forward's
    rounding (bounds.py's models, read from a plain forward of ``prompt`` with ``hooks``): each logit stored (half
    its ulp) after a float32 dot (``gamma_d``); the final norm's output stored in bf16 and read along ``W_U[t] -
    W_U[c]``, and every add of the stream (its result, each channel) read along the frozen norm's direction ``c``:
    independent roundings (``bounds.random_bound``; the worst case is past the logit itself); the recipe's float32
    dots of each write with ``c`` (``gamma_d`` of ``sum |c| |write|``)."""
    writes, results = [], []
    seen = {}

    def keep(module, args, output):
        writes.append((output[0] if isinstance(output, tuple) else output)[0, -1].float())

    handles = [module.register_forward_hook(fn) for module, fn in hooks]
    handles += [module.register_forward_hook(keep) for pair in _writes(model) for module in pair]
    norm = _decoder(model).norm
    handles.append(norm.register_forward_hook(lambda m, i, o: seen.update(x=i[0][0, -1].float(), y=o[0, -1].float())))
    try:
        ids = model.tokenizer(prompt, return_tensors="pt")
        with torch.no_grad():
            out = model._module(**ids, output_hidden_states=True)
    finally:
        for h in handles:
            h.remove()
    stream = out.hidden_states[0][0, -1].float()
    for write in writes:  # the stream after each add, as the model rounded it
        stream = (stream.to(torch.bfloat16) + write.to(torch.bfloat16)).float()
        results.append(stream)
    logits = out.logits[0, -1].float()
    rows = model._module.lm_head.weight.detach().float()
    c = _direction(model, seen["x"], target, contrast)
    stored = sum(bounds.half_ulp(float(logits[i]), torch.bfloat16) for i in (target, contrast))
    heads = sum(float(bounds.dot_bound(seen["y"], rows[i])) for i in (target, contrast))
    rounded = bounds.random_bound(seen["y"] * (rows[target] - rows[contrast]), torch.bfloat16)
    rounded += bounds.random_bound(torch.stack(results) * c, torch.bfloat16)
    ours = float(bounds.dot_bound(c, torch.stack([out.hidden_states[0][0, -1].float(), *writes]).abs().sum(0)))
    return stored + heads + rounded + ours


def _direction(model, stream: torch.Tensor, target: int, contrast: int) -> torch.Tensor:
    """``[d_model]``: ``logit(target) - logit(contrast)`` as a function of what is added to the stream, through the
    final RMSNorm frozen at the real ``stream`` (gain ``w`` on Llama, ``1 + w`` on Gemma): ``s * gain * (W_U[t] -
    W_U[c])``, from first principles."""
    norm = _decoder(model).norm
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6))
    weight = norm.weight.detach().float()
    gain = 1 + weight if "Gemma" in type(norm).__name__ else weight
    rows = model._module.lm_head.weight.detach().float()
    return torch.rsqrt((stream * stream).mean() + eps) * gain * (rows[target] - rows[contrast])


def _direct_share(model, vector: torch.Tensor, stream: torch.Tensor, target: int, contrast: int) -> float:
    """What ``vector`` added to the stream contributes to ``logit(target) - logit(contrast)`` (``_direction``)."""
    return float((vector.detach().float() * _direction(model, stream, target, contrast)).sum())


def _vector(model, target: int, contrast: int, seed: int) -> torch.Tensor:
    """``[d_model]``: a random steering vector plus a push along the logit difference's unembedding rows (so its
    share of the logit is a few hundredths to tenths, as the issue's)."""
    rows = model._module.lm_head.weight.float()
    push = rows[target] - rows[contrast]
    d = push.shape[0]
    return torch.randn(d, generator=torch.Generator().manual_seed(seed)) * 0.5 + 2 * push / push.norm()


def _steer(layer: int, vec: torch.Tensor):
    def fn(mm):
        mm.layers[layer].mlp.output[:, -1] += vec.to(mm.lm_head.weight.dtype)
    return fn


def _steer_hook(vec):
    def hook(module, args, output):
        output = output.clone()
        output[:, -1] += vec.to(output.dtype)
        return output
    return hook


# The sum: the trace runs the edited forward the torch hook runs (its own logit equals the plain one's, bit for bit),
# so the parts are within that one forward's bf16 rounding of its logit (_sum_bound: 0.27-0.37 here, as the
# self-check's; measured 0.035-0.075 on an AVX-512 CPU, mostly each bf16 logit's half ulp, 0.0625 for Gemma-3's).
# A fixed slack on top of the logits' rounding (0.07, then 0.03) missed: the stream's rounding is ~0.04 at one
# standard deviation. The .edit column: _write_bound (measured: off the first-principles share by <= 0.0005, shares
# 0.18-0.29, and 0.0031, shares 3.7-4.4).


def _write_bound(model, prompt: str, layer: int, sublayer: str, c: torch.Tensor, hooks) -> tuple[float, float]:
    """``(bf16, float32)``: how far block ``layer``'s ``sublayer`` (``"mlp"`` or ``"attn"``) write, read along ``c``,
    may be from its parts plus an edit's own share, one forward's rounding. Model: bf16, the projection's output
    and the sublayer's output (an edit added to it) each stored once (Gemma: carried through the post-norm frozen at
    its input, whose output is stored too), independent roundings (``bounds.random_bound``); float32, the parts'
    dots (``gamma`` of ``|c| |W| |input|`` through the projection, its ``d_model + width`` terms) and two reads of
    the write (``bounds.dot_bound``)."""
    block = _decoder(model).layers[layer]
    module = block.mlp if sublayer == "mlp" else block.self_attn
    projection = module.down_proj if sublayer == "mlp" else module.o_proj
    sandwich = hasattr(block, "pre_feedforward_layernorm")  # Gemma: a post-norm after each sublayer
    post = None
    if sandwich:
        post = block.post_feedforward_layernorm if sublayer == "mlp" else block.post_attention_layernorm
    seen = {}

    def first(output):
        return (output[0] if isinstance(output, tuple) else output)[0, -1].float()

    keep = [(projection, lambda m, i, o: seen.update(input=i[0][0, -1].float(), out=first(o))),
            (module, lambda m, i, o: seen.update(write=first(o)))]
    if post is not None:
        keep.append((post, lambda m, i, o: seen.update(x=i[0][0, -1].float(), post=first(o))))
    _plain(model, prompt, [*hooks, *keep])
    frozen = torch.ones_like(c)
    if post is not None:
        x = seen["x"]
        frozen = (1 + post.weight.detach().float()) * torch.rsqrt((x * x).mean() + post.eps)
    carried = frozen * c
    stored = [seen["out"] * carried, seen["write"] * carried] + ([seen["post"] * c] if post is not None else [])
    written = seen["post"] if post is not None else seen["write"]
    weight = projection.weight.detach().float()  # [d_model, width]
    parts = bounds.gamma(sum(weight.shape)) * float(carried.abs() @ weight.abs() @ seen["input"].abs())
    return (bounds.random_bound(torch.stack(stored), torch.bfloat16),
            parts + 2 * float(bounds.dot_bound(c, written)))


@pytest.mark.real
@pytest.mark.parametrize("by", ["neuron", "head", "block"])
def test_steering_mlp_output_is_attributed_as_its_edit(bf16_model, by):
    """The issue's call: ``mm.layers[12].mlp.output[:, -1] += vec`` in bf16. The parts sum to the edited model's
    own logit (a plain forward with the same edit as a torch hook), and by neuron the steering vector's share is
    in ``L12.mlp.edit`` (it was reported nowhere: ``L12.mlp`` 0.0 where the vector wrote -0.043)."""
    model = bf16_model
    target, contrast = _ids(model, [" Paris", " Rome"])
    vec = _vector(model, target, contrast, seed=1)
    attr = dla_recipes.attribute(model, EIFFEL, " Paris", contrast=" Rome", by=by, intervene=_steer(12, vec))
    steer = [(_decoder(model).layers[12].mlp, _steer_hook(vec))]
    logits, stream = _plain(model, EIFFEL, steer)
    expected = float(logits[target] - logits[contrast])
    assert float(attr.logit[0]) == expected  # the same edited forward: the same computation on the same input
    total = float(attr.values.sum() + attr.constant.sum())
    assert abs(total - expected) <= _sum_bound(model, EIFFEL, target, contrast, steer), (total, expected)
    if by == "block":
        assert not any(label.endswith(".edit") for label in attr.labels)
    elif by == "head":  # the MLP is whole by head: no edit column of its own, the attention has one
        assert "L12.mlp.edit" not in attr.labels and "L12.attn.edit" in attr.labels
    else:  # the neurons read down_proj's input: the vector is in the edit column, nowhere else
        edit = float(attr.values[0, attr.labels.index("L12.mlp.edit")])
        written = vec.to(torch.bfloat16).float()
        post = getattr(_decoder(model).layers[12], "post_feedforward_layernorm", None)
        if post is not None:  # Gemma: mlp.output is the post-norm's input; it carries the vector frozen at its real input
            seen = {}
            _plain(model, EIFFEL, [(_decoder(model).layers[12].mlp, _steer_hook(vec)),
                                   (post, lambda m, i, o: seen.__setitem__("x", i[0][0, -1].float()))])
            x = seen["x"]
            written = (1 + post.weight.float()) * written * torch.rsqrt((x * x).mean() + post.eps)
        share = _direct_share(model, written, stream, target, contrast)
        limit = sum(_write_bound(model, EIFFEL, 12, "mlp", _direction(model, stream, target, contrast), steer))
        assert abs(edit - share) <= limit, (edit, share)  # one forward's rounding of the write (_write_bound)
        assert abs(share) > 5 * limit  # the test measures something


@pytest.mark.real
def test_a_patched_attention_output_reports_what_the_attention_wrote(bf16_model):
    """The issue's second call: layer 10's attention output patched from another prompt, by head in bf16. Its
    heads, edit and rest sum to what the patched attention wrote (the by-block L10.attn of the same pass), not to
    the overwritten clean heads; the whole sums to the edited model's own logit."""
    model, family = bf16_model, dla_recipes.families.family_of(bf16_model).name
    target, contrast = _ids(model, [" Paris", " Rome"])
    corrupt = {}
    attn = _decoder(model).layers[10].self_attn
    handle = attn.register_forward_hook(lambda m, i, o: corrupt.__setitem__("o", o[0][0, -1].clone()))
    _plain(model, CORRUPT)
    handle.remove()
    value = corrupt["o"]

    def patch(mm):
        mm.layers[10].self_attn.output[0][:, -1] = value

    def patch_hook(module, args, output):
        out = output[0].clone()
        out[:, -1] = value
        return (out, *output[1:])

    heads = dla_recipes.attribute(model, EIFFEL, " Paris", contrast=" Rome", by="head", intervene=patch)
    block = dla_recipes.attribute(model, EIFFEL, " Paris", contrast=" Rome", by="block", intervene=patch)
    logits, stream = _plain(model, EIFFEL, [(attn, patch_hook)])
    expected = float(logits[target] - logits[contrast])
    assert float(heads.logit[0]) == expected  # the same edited forward: the same computation on the same input
    total = float(heads.values.sum() + heads.constant.sum())
    assert abs(total - expected) <= _sum_bound(model, EIFFEL, target, contrast, [(attn, patch_hook)]), (total, expected)
    layer10 = [j for j, c in enumerate(heads.components) if c.layer == 10 and c.term == "attn"]
    wrote = float(block.values[0, block.labels.index("L10.attn")])
    # the same bf16 tensors read two ways: the float32 dots' rounding (_write_bound) and the sum of the parts
    _, float32 = _write_bound(model, EIFFEL, 10, "attn", _direction(model, stream, target, contrast),
                              [(attn, patch_hook)])
    limit = float32 + float(bounds.sum_bound(heads.values[0, layer10]))
    assert abs(float(heads.values[0, layer10].sum()) - wrote) <= limit
    clean = dla_recipes.attribute(model, EIFFEL, " Paris", contrast=" Rome", by="head")
    clean_heads = sum(float(clean.values[0, j]) for j, c in enumerate(clean.components)
                      if c.layer == 10 and c.part == "head")
    patched_heads = sum(float(heads.values[0, j]) for j in layer10 if heads.components[j].part == "head")
    if family == "llama":  # no post-norm: the heads read o_proj's (clean) input, through the patched final scale
        rescaled = clean_heads * float(heads.diagnostics["scale"][0] / clean.diagnostics["scale"][0])
        # each head's part is one float32 product by its run's scale, the scales' ratio one more: 4u a head
        limit = 4 * bounds.unit_roundoff() * sum(abs(float(heads.values[0, j])) for j in layer10
                                                 if heads.components[j].part == "head")
        assert abs(patched_heads - rescaled) <= limit
    assert abs(float(heads.values[0, heads.labels.index("L10.attn.edit")])) > 0.01  # the patch is in the edit


@pytest.mark.real
def test_an_unknown_edit_after_the_projection_is_caught_in_bf16(bf16_model):
    """A torch hook on layer 12's down projection (an edit dla_recipes does not know of) moves the logit by a few
    hundredths, well inside the stream's bf16 bound (~0.2-0.4): by neuron the term's own check names L12.mlp."""
    model = bf16_model
    target, contrast = _ids(model, [" Paris", " Rome"])
    vec = _vector(model, target, contrast, seed=2) * 0.3
    _, stream = _plain(model, EIFFEL)
    share = _direct_share(model, vec.to(torch.bfloat16), stream, target, contrast)
    attr = dla_recipes.attribute(model, EIFFEL, " Paris", contrast=" Rome", by="neuron")
    assert abs(share) < float(attr.diagnostics["bound"][0])  # the stream's bound alone would let it through
    handle = _decoder(model).layers[12].mlp.down_proj.register_forward_hook(_steer_hook(vec))
    try:
        with pytest.raises(dla_recipes.ExactnessError, match=r"L12\.mlp wrote .* intervene=fn"):
            dla_recipes.attribute(model, EIFFEL, " Paris", contrast=" Rome", by="neuron")
    finally:
        handle.remove()


@pytest.mark.real
def test_the_frozen_scale_is_the_models_float32_scale(bf16_model):
    """Item 2: in bf16 the final norm's frozen scale is the one the model computed in float32 from its stream
    (``1/sqrt(mean(x^2) + eps)``), not a fit to the bf16-rounded output (off by a common 3.6e-4 before)."""
    model = bf16_model
    attr = dla_recipes.attribute(model, EIFFEL, " Paris", contrast=" Rome", by="block")
    _, stream = _plain(model, EIFFEL)
    norm = _decoder(model).norm
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6))
    expected = float(torch.rsqrt((stream * stream).mean() + eps))
    # both float32 computations of it: a mean of d squares (gamma_{d+1}), the eps add and the root (2u), halved by
    # the root: relative (gamma_{d+1} + u) / 2 + 2u each; a fit to the bf16 output was off by 3.6e-4
    relative = (bounds.gamma(stream.shape[-1] + 1) + bounds.unit_roundoff()) / 2 + 2 * bounds.unit_roundoff()
    limit = 2 * relative * abs(expected)
    assert abs(float(attr.diagnostics["scale"][0]) - expected) <= limit


@pytest.mark.real
def test_a_tolerance_below_the_rounding_says_so():
    """Item 3: a user tolerance below the dtype's own rounding fails saying that, never "far beyond" a bound
    larger than the gap, and never blaming the family table (Gemma-3 bf16 tolerance=1e-3; SmolLM2 fp32 1e-9)."""
    for name, dtype, tol in (("gemma3-270m", torch.bfloat16, 1e-3), ("smollm2-135m", torch.float32, 1e-9)):
        model = _load(name, dtype)
        with pytest.raises(dla_recipes.ExactnessError) as info:
            dla_recipes.attribute(model, [EIFFEL, CORRUPT], " Paris", contrast=" Rome", tolerance=tol)
        message = str(info.value)
        assert "below this dtype's own rounding" in message and f"tolerance={tol:g}" in message, message
        assert "far beyond" not in message and "family table" not in message, message


@pytest.mark.parametrize("by", ["head", "neuron"])
def test_real_models_under_ndif_autocast_bracket(bf16_model, by):
    """Issue 19: NDIF runs every request inside ``torch.autocast("cuda", dtype=bfloat16)``; on the CPU the same
    bracket is ``torch.autocast("cpu", dtype=torch.bfloat16)``. The model's own forward (bf16 weights) does not move
    under it, and neither may the parts: they are the recipe's float32 products, which it computes with autocast
    off. Measured before that fix: the parts moved by 1.2e-3 (SmolLM2, by head) to 2.3e-3 (by neuron) of the
    largest part; after: 0 (the issue asks <= 1e-5)."""
    prompts = [EIFFEL, CORRUPT]
    plain = dla_recipes.attribute(bf16_model, prompts, " Paris", contrast=" Rome", by=by)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        bracketed = dla_recipes.attribute(bf16_model, prompts, " Paris", contrast=" Rome", by=by)
    assert torch.equal(bracketed.logit, plain.logit)  # the model's own forward: unmoved
    moved = float((bracketed.values - plain.values).abs().max())
    assert moved <= 1e-5 * float(plain.values.abs().max()), moved
