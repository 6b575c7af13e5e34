"""``attribute(..., by="source")``: per-(head, source position) parts against a first-principles reference.

The reference never runs dla_recipes' recipe: a plain transformers forward of each prompt alone, eager attention,
with torch forward hooks capturing the last block's attention pattern ``A`` (the attention module's second
output), its values (the value projection's or value norm's output), its post-norm's input and output, and the
final norm's input and output. Each source's write ``A[h, p, s] * v[s, group(h)] @ W_O[:, h]^T`` (a ``d_model``
vector) is carried through the post-norm and the final norm, each frozen at the stream it really read (the scale
held: ``(y - b) / c(x)`` elementwise, ``c`` the centering of a LayerNorm), the block's multipliers, and read along
``lm_head``'s target minus contrast rows. The attribution itself runs on the padded batch.
"""

import bounds
import pytest
import torch
from conftest import (
    BOUND_CEILING,
    CONTRAST,
    PROMPTS,
    SOURCE_WRONG,
    TARGET,
    assert_parts_are_the_models,
    eager_model,
    is_source_refusal,
    plain_differences,
    source_cases,
)
from test_positions import attribution_bound, batch_ratio, difference, targets_of

import dla_recipes
from dla_recipes import DLAError, ExactnessError, InputError
from dla_recipes.plan import build_plan, module_at
from dla_recipes.testing import tiny

# Families whose attention cannot be split by source: Falcon (no eager attention to switch to), latent attention,
# a mixture of attention, attention without an eager pattern, no heads at all, KV-shared layers (gemma4: its
# other layers are split in test_kv_shared_layers_refused_but_others_split). Every other family must split.
REFUSED = ["deepseek_v3", "recurrent_gemma", "falcon",
           "falcon_new_arch", "zaya", "deepseek_v4", "zamba2", "jetmoe", "gemma4"]
# The families the first-principles reference below knows how to read (multipliers after the last block, fused
# value layouts); every other family is checked by test_every_family_splits_exactly_or_refuses_clearly. Refused means
# only a refusal (``conftest.is_source_refusal``): an ExactnessError is a failure.
SUPPORTED = ["gpt2", "llama", "mistral", "qwen2", "qwen3", "gemma", "olmo", "phi3", "smollm3", "apertus", "gptj",
             "gpt_neox", "gpt_neox_sequential", "mixtral", "qwen2_moe", "olmoe", "gemma2", "gemma3", "glm4", "olmo2",
             "olmo3", "exaone4", "granite", "cohere", "bloom", "opt", "phi", "gemma4_moe", "doge"]


def _frozen_transpose(module, x: torch.Tensor, y: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """``J^T d`` for the norm ``module`` frozen at input ``x`` (output ``y``): ``J r = g_s * c(r)``."""
    centered = "LayerNorm" in type(module).__name__ and "RMS" not in type(module).__name__
    bias = getattr(module, "bias", None)
    y = y - (bias.float() if isinstance(bias, torch.Tensor) else 0.0)
    c = (lambda t: t - t.mean(-1, keepdim=True)) if centered else (lambda t: t)
    gain_scale = y / c(x)
    return c(gain_scale * d)


_FACTORS = {  # what multiplies the last block's attention write on its way to the final norm
    "granite": lambda hf, layer: hf.config.residual_multiplier,
    "doge": lambda hf, layer: layer.post_attention_residual.float(),
    "gemma4_moe": lambda hf, layer: layer.layer_scalar.float(),
}
_FUSED = {  # the values inside a fused projection's output, as each model's attention slices them
    "gpt2": lambda out, heads, head_dim: out.split(out.shape[-1] // 3, dim=-1)[2],
    "phi3": lambda out, heads, head_dim: out[..., heads * head_dim + (out.shape[-1] - heads * head_dim) // 2:],
    "gpt_neox": lambda out, heads, head_dim: out.view(*out.shape[:-1], heads, 3 * head_dim).chunk(3, dim=-1)[2],
}
_FUSED["gpt_neox_sequential"] = _FUSED["bloom"] = _FUSED["gpt_neox"]
_LOGIT_SCALE = {"cohere": lambda c: c.logit_scale, "granite": lambda c: 1.0 / c.logits_scaling}


@torch.no_grad()
def reference_parts(model, family: str, prompt: str) -> torch.Tensor:
    """``[heads, length]``: the last block's per-(head, source) parts of logit(TARGET) - logit(CONTRAST) at the
    prompt's last token, from hooks on a plain forward of the prompt alone."""
    hf, plan = model._module, build_plan(model)
    i = len(plan.layers) - 1
    layer_envoy = model.layers[i]
    term = next(p.term for p in plan.layers[i] if p.term.splits_heads)
    attention = module_at(layer_envoy, term.split.projection.rsplit(".", 1)[0])._module
    values = module_at(layer_envoy, term.split.values.rsplit(".", 1)[0])._module
    o_proj = module_at(layer_envoy, term.split.projection)._module
    norms = {"final": model.ln_final._module}
    if term.write.post_norm:
        norms["post"] = module_at(layer_envoy, term.write.post_norm)._module
    seen: dict = {}
    hooks = [attention.register_forward_hook(lambda m, a, out: seen.__setitem__("A", out[1])),
             values.register_forward_hook(lambda m, a, out: seen.__setitem__("v", out))]
    for name, norm in norms.items():
        hooks.append(norm.register_forward_hook(lambda m, a, out, name=name: seen.__setitem__(name, (a[0], out))))
    ids = model.tokenizer(prompt, return_tensors="pt")
    try:
        with torch.no_grad():
            hf(input_ids=ids["input_ids"], attention_mask=ids["attention_mask"])
    finally:
        for hook in hooks:
            hook.remove()
    p = ids["input_ids"].shape[1] - 1
    A = seen["A"][0, :, p].float()  # [heads, keys]
    heads, keys = A.shape
    weight = o_proj.weight.float()
    weight = weight.T if type(o_proj).__name__ == "Conv1D" else weight  # [d_model, heads * head_dim]
    head_dim = weight.shape[1] // heads
    v = seen["v"][0].float()
    if family in _FUSED:
        v = _FUSED[family](v, heads, head_dim)
    v = v.reshape(keys, -1, head_dim)  # [keys, kv, head_dim]
    v = v.repeat_interleave(heads // v.shape[1], dim=1)  # [keys, heads, head_dim]: query head h reads group h // n
    w_o = weight.view(-1, heads, head_dim)  # [d_model, heads, head_dim]
    writes = torch.einsum("hs,shd,Dhd->hsD", A, v, w_o)  # each source's write [heads, keys, d_model]
    unembed = hf.get_output_embeddings().weight.float()
    tok = model.tokenizer.convert_tokens_to_ids
    d = (unembed[tok(TARGET)] - unembed[tok(CONTRAST)]) * _LOGIT_SCALE.get(family, lambda c: 1.0)(hf.config)
    x, y = seen["final"]
    d = _frozen_transpose(norms["final"], x[0, p].float(), y[0, p].float(), d)
    d = d * _FACTORS.get(family, lambda hf, layer: 1.0)(hf, layer_envoy._module)
    if "post" in norms:
        x, y = seen["post"]
        d = _frozen_transpose(norms["post"], x[0, p].float(), y[0, p].float(), d)
    return writes @ d  # [heads, keys]


def regrouped_limit(model, attr, heads) -> torch.Tensor:
    """``[batch]``: how far ``attr`` (by source) regrouped by head or by block may be from ``heads`` (by head, another
    forward of the same prompts). Model: both forwards' rounding of each row's logit
    (``test_positions.attribution_bound``), plus the regrouping's float32 sum of a row's sources, at most
    ``gamma_n * sum |sources|`` (``bounds.sum_bound`` over every source of the row)."""
    grid = attr.sources()  # [batch, layers, heads, sources]
    regrouping = bounds.sum_bound(grid.nan_to_num().flatten(1), dim=-1)
    return attribution_bound(model, heads, targets_of(model, heads)) + regrouping


@pytest.mark.parametrize("family", SUPPORTED)
def test_sources_match_first_principles(family):
    model = eager_model(family)
    attr = dla_recipes.attribute(model, PROMPTS, TARGET, contrast=CONTRAST, by="source")
    heads = dla_recipes.attribute(model, PROMPTS, TARGET, contrast=CONTRAST, by="head")
    assert attr.labels[1].endswith(".S0") and "L0.H0.S0" in attr.labels
    assert_parts_are_the_models(model, attr, PROMPTS, f"{family} by=source")
    summed = attr.heads()
    assert summed.labels == heads.labels
    limit = regrouped_limit(model, attr, heads)  # both forwards' rounding, plus the sources' sum
    assert batch_ratio(summed.values, heads.values, limit) <= 1
    assert batch_ratio(attr.blocks().values, heads.blocks().values, limit) <= 1
    grid = attr.sources()  # [batch, layers, heads, sources]
    last = grid.shape[1] - 1
    lengths = [len(p.split()) for p in PROMPTS]
    assert grid.shape[-1] == max(lengths)
    for b, prompt in enumerate(PROMPTS):
        ref = reference_parts(model, family, prompt)
        assert ref.shape[-1] == lengths[b]
        ours = grid[b, last]
        error = float((ours[:, : lengths[b]] - ref).abs().max())
        scale = max(1.0, float(ref.abs().max()))
        assert error <= 1e-6 * scale, f"{family} prompt {b}: {error:.3g}"
        assert bool((ours[:, lengths[b]:] == 0).all())  # sources this prompt does not have
        assert float(ref.abs().max()) > 1e-4  # the reference is not trivially zero


@pytest.mark.parametrize("family", source_cases([f for f in tiny.FAMILIES
                                                  if f not in SUPPORTED and f not in REFUSED and f not in SOURCE_WRONG]))
def test_every_family_splits_exactly_or_refuses_clearly(family):
    """Every other family: by='source' either sums to the model's own logit (a plain forward of each prompt alone,
    the eager model's), its sources summing to the by='head' parts, with the pattern rebuilding the heads' real
    outputs in the trace, or refuses (a plain DLAError or an InputError naming by='source' or the heads). An
    ExactnessError is a family that claims the split and gets it wrong: a failure, as is any other exception."""
    model = eager_model(family)  # every tiny family loads with eager attention (measured)
    try:
        attr = dla_recipes.attribute(model, PROMPTS, TARGET, contrast=CONTRAST, by="source")
    except DLAError as error:
        if is_source_refusal(error):
            return
        raise
    heads = dla_recipes.attribute(model, PROMPTS, TARGET, contrast=CONTRAST, by="head")
    assert_parts_are_the_models(model, attr, PROMPTS, f"{family} by=source")
    assert_parts_are_the_models(model, heads, PROMPTS, f"{family} by=head (eager)")
    assert attr.heads().labels == heads.labels
    assert batch_ratio(attr.heads().values, heads.values, regrouped_limit(model, attr, heads)) <= 1
    assert attr.diagnostics["norm_fit_error"] <= 1e-4  # includes the pattern rebuilding the heads' outputs


@pytest.mark.parametrize("family", REFUSED + sorted(SOURCE_WRONG))
def test_refused_clearly(family):
    """Refused up front (REFUSED) or, where the family's heads are not pattern times values (``SOURCE_WRONG``: a
    gate, a norm or a scale after the pattern), when the rebuilt heads do not match what the output projection
    reads: a refusal naming the block, never an ExactnessError."""
    model = eager_model(family)
    with pytest.raises(DLAError) as raised:
        dla_recipes.attribute(model, PROMPTS, TARGET, contrast=CONTRAST, by="source")
    assert is_source_refusal(raised.value), f"{family}: not a refusal: {type(raised.value).__name__}: {raised.value}"
    assert not isinstance(raised.value, ExactnessError)
    if family in SOURCE_WRONG:
        assert "are not its attention pattern times its values" in str(raised.value), str(raised.value)


def test_kv_shared_layers_refused_but_others_split():
    model = eager_model("gemma4")
    with pytest.raises(DLAError, match="reuses another block's keys and values") as raised:
        dla_recipes.attribute(model, PROMPTS, TARGET, by="source")
    assert is_source_refusal(raised.value)
    attr = dla_recipes.attribute(model, PROMPTS, TARGET, contrast=CONTRAST, by="source", sources={"layers": [0, 1]})
    assert_parts_are_the_models(model, attr, PROMPTS, "gemma4 by=source, layers 0 and 1")
    heads = dla_recipes.attribute(model, PROMPTS, TARGET, contrast=CONTRAST, by="head")
    assert any(label.startswith("L1.H0.S") for label in attr.labels) and "L2.H0" in attr.labels
    assert batch_ratio(attr.heads().values, heads.values, regrouped_limit(model, attr, heads)) <= 1


def test_layers_and_top_heads():
    model = eager_model("llama")
    heads = dla_recipes.attribute(model, PROMPTS, TARGET, contrast=CONTRAST, by="head")
    only = dla_recipes.attribute(model, PROMPTS, TARGET, contrast=CONTRAST, by="source", sources={"layers": [-1]})
    assert_parts_are_the_models(model, only, PROMPTS, "llama by=source, the last layer")
    last = len(build_plan(model).layers) - 1
    split = {label.rsplit(".S", 1)[0] for label in only.labels if ".S" in label}
    assert split == {f"L{last}.H{h}" for h in range(build_plan(model).num_heads)}
    assert batch_ratio(only.heads().values, heads.values, regrouped_limit(model, only, heads)) <= 1
    top = dla_recipes.attribute(model, PROMPTS, TARGET, contrast=CONTRAST, by="source", sources={"top_heads": 2})
    assert_parts_are_the_models(model, top, PROMPTS, "llama by=source, the top 2 heads")
    split = {label.rsplit(".S", 1)[0] for label in top.labels if ".S" in label}
    ranked = heads.values.abs().max(0).values
    order = [heads.labels[j] for j in torch.argsort(ranked, descending=True).tolist() if ".H" in heads.labels[j]]
    assert split == set(order[:2])
    assert batch_ratio(top.heads().values, heads.values, regrouped_limit(model, top, heads)) <= 1
    assert len(top.labels) == len(heads.labels) + 2 * (max(len(p.split()) for p in PROMPTS) - 1)


def test_bad_options():
    model = eager_model("llama")
    with pytest.raises(InputError, match="unknown keys"):
        dla_recipes.attribute(model, PROMPTS, TARGET, by="source", sources={"heads": 3})
    with pytest.raises(InputError, match="top_heads"):
        dla_recipes.attribute(model, PROMPTS, TARGET, by="source", sources={"top_heads": 0})
    with pytest.raises(InputError, match="outside"):
        dla_recipes.attribute(model, PROMPTS, TARGET, by="source", sources={"layers": [99]})
    with pytest.raises(InputError, match="by='source'"):
        dla_recipes.attribute(model, PROMPTS, TARGET, by="head", sources={"top_heads": 2})


def test_padded_batch_equals_each_prompt_alone():
    model = eager_model("qwen2")
    batch = dla_recipes.attribute(model, PROMPTS, TARGET, contrast=CONTRAST, by="source").sources()
    for b, prompt in enumerate(PROMPTS):
        single = dla_recipes.attribute(model, prompt, TARGET, contrast=CONTRAST, by="source")
        alone = single.sources()[0]
        n = alone.shape[-1]
        limit = float(attribution_bound(model, single, difference(model))[0])  # both batchings' rounding
        assert float((batch[b, ..., :n] - alone).abs().max()) <= limit
        assert bool((batch[b, ..., n:] == 0).all())


def test_earlier_position_has_zeros_after_it():
    model = eager_model("llama")
    attr = dla_recipes.attribute(model, PROMPTS[0], TARGET, position=2, by="source")
    grid = attr.sources()
    assert grid.shape[-1] == 3 and attr.positions == (2,)


@pytest.mark.server
def test_remote_equals_local(tmp_path):
    """On the loopback NDIF server, eager attention (sdpa, the default: test_sources_sdpa)."""
    from conftest import serve_tiny, single_threaded

    with serve_tiny(tmp_path, ("llama", "gemma2")) as server:
        for family in ("llama", "gemma2"):
            # nnsight sends the client model's attention implementation with the request; the server switches to it
            remote_model = server.remote_model(family, attn_implementation="eager")
            local_model = server.local_model(family, attn_implementation="eager")
            with server.client():
                remote = dla_recipes.attribute(remote_model, PROMPTS, TARGET, contrast=CONTRAST, by="source",
                                               remote=True)
            with single_threaded():
                local = dla_recipes.attribute(local_model, PROMPTS, TARGET, contrast=CONTRAST, by="source")
            assert remote.labels == local.labels and any(".S" in label for label in remote.labels)
            assert torch.equal(remote.values, local.values), float((remote.values - local.values).abs().max())
        options = {"layers": [1], "top_heads": 2}  # the chosen heads travel with the request
        with server.client():
            remote = dla_recipes.attribute(server.remote_model("llama", attn_implementation="eager"), PROMPTS, TARGET,
                                           contrast=CONTRAST, by="source", remote=True, sources=options)
        with single_threaded():
            local = dla_recipes.attribute(server.local_model("llama", attn_implementation="eager"), PROMPTS, TARGET,
                                          contrast=CONTRAST, by="source", sources=options)
        assert remote.labels == local.labels and sum(".S" in label for label in remote.labels) == 2 * 6
        assert torch.equal(remote.values, local.values)


@pytest.mark.real
@pytest.mark.slow  # loads SmolLM2 for this test alone: ~4 s of CPU
def test_real_smollm2():
    from dla_recipes import models

    model = dla_recipes.load(models.default_model_path(), attn_implementation="eager", device_map="cpu")
    prompt = "The Eiffel Tower is in the city of"
    attr = dla_recipes.attribute(model, prompt, " Paris", contrast=" Rome", by="source")
    heads = dla_recipes.attribute(model, prompt, " Paris", contrast=" Rome", by="head")
    limit = regrouped_limit(model, attr, heads)  # both forwards' rounding, plus the sources' sum
    assert batch_ratio(attr.heads().values, heads.values, limit) <= 1
    grid = attr.sources()[0]
    ref = reference_parts_for(model, prompt, " Paris", " Rome")
    assert float((grid[-1] - ref).abs().max()) <= 1e-5 * max(1.0, float(ref.abs().max()))


def reference_parts_for(model, prompt, target, contrast):
    """``reference_parts`` for real tokens (SmolLM2 is a llama)."""
    global TARGET, CONTRAST
    saved = TARGET, CONTRAST
    tok = model.tokenizer
    TARGET, CONTRAST = tok.convert_ids_to_tokens(tok(target)["input_ids"])[0], tok.convert_ids_to_tokens(tok(contrast)["input_ids"])[0]
    try:
        return reference_parts(model, "llama", prompt)
    finally:
        TARGET, CONTRAST = saved


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_low_precision(family, dtype):
    """A bfloat16 / float16 model: the pattern and values the model computed in low precision, the parts in
    float32; they sum to the model's own logit (a plain forward of each prompt alone, in the model's dtype) and to
    the by="head" parts within the dtype's tolerance."""
    model = dla_recipes.load(tiny.build(family).to(dtype), tokenizer=tiny.tokenizer(), device_map="cpu",
                             attn_implementation="eager")
    attr = dla_recipes.attribute(model, PROMPTS, TARGET, contrast=CONTRAST, by="source")
    heads = dla_recipes.attribute(model, PROMPTS, TARGET, contrast=CONTRAST, by="head")
    # |parts - the plain forward's pre-cap logit difference|: two forwards (the padded batch, each prompt alone), each
    # within the self-check's bound of its own rounding: twice diagnostics["bound"] (measured before: 1.45e-3 of
    # max(1, |logit|) in bfloat16, 1.9e-4 in float16)
    totals = attr.values.double().sum(-1) + attr.constant.double()
    expected = torch.tensor(plain_differences(model), dtype=torch.float64)
    ratio = float(((totals - expected).abs() / (2 * attr.diagnostics["bound"])).max())
    assert ratio <= 1, (totals.tolist(), expected.tolist())
    assert bool((attr.diagnostics["bound"] <= BOUND_CEILING[dtype] * torch.clamp(attr.logit.abs(), min=1.0)).all())
    # sources regrouped by head against by="head": the head outputs' own store (head_store_bounds; measured before:
    # 2.7e-4 of max(1, max |by="head"|) in bfloat16, 3.5e-5 in float16)
    limit = head_store_bounds(model, heads.labels)
    regrouped = attr.heads()
    assert regrouped.labels == heads.labels
    split = limit[0] > 0  # the heads' columns; the others are the same reads
    assert torch.equal(regrouped.values[:, ~split], heads.values[:, ~split])
    assert float(((regrouped.values - heads.values)[:, split].abs() / limit[:, split]).max()) <= 1
    # the frozen norms reproduce outputs the model stored through at most two roundings in its dtype (2u of the
    # largest), the heads rebuilt from pattern and values an output stored once; float32's own (measured before:
    # 3.8e-3 in bfloat16, 5.1e-4 in float16)
    u = bounds.unit_roundoff(dtype)
    assert attr.diagnostics["norm_fit_error"] <= 2 * u + u * u + bounds.gamma(model.config.hidden_size + 1)


def head_store_bounds(model, labels, prompts=PROMPTS) -> torch.Tensor:
    """``[prompts, labels]``: how far a head's part summed from its sources (pattern times values, in float32) may be
    from its ``by="head"`` part (the model's head output, at the last token) in a low-precision llama or gemma3.
    Model: the head output is the attention's ``A @ V``, accumulated in float32 and stored once in the model's
    dtype: independent roundings of its channels read along the head's direction ``c_h = W_O[:, h]^T c`` (``c``
    the final norm's frozen direction, through a post-norm frozen at its input: ``bounds.random_bound``); float32's
    own products of both sides (``gamma`` of their ``d_model + head_dim + keys`` terms, the values' largest over the
    keys and the stored output, times ``|c_h|``) and the float32 sum of each head's sources. Other columns: 0."""
    hf = model._module
    dtype = next(hf.parameters()).dtype
    layers = hf.model.layers
    rows = hf.lm_head.weight.detach().float()
    t, c = (model.tokenizer.convert_tokens_to_ids(x) for x in (TARGET, CONTRAST))
    limits = torch.zeros(len(prompts), len(labels), dtype=torch.float64)
    for b, prompt in enumerate(prompts):
        seen = {}

        def keep(name, seen=seen):
            def hook(module, args, out):
                seen[name] = (args[0][0, -1].float(), (out[0] if isinstance(out, tuple) else out)[0].float())
            return hook

        modules = {"final": hf.model.norm}
        for i, layer in enumerate(layers):
            modules[f"o{i}"], modules[f"v{i}"] = layer.self_attn.o_proj, layer.self_attn.v_proj
            if hasattr(layer, "pre_feedforward_layernorm"):
                modules[f"post{i}"] = layer.post_attention_layernorm
        handles = [module.register_forward_hook(keep(name)) for name, module in modules.items()]
        try:
            with torch.no_grad():
                hf(**model.tokenizer(prompt, return_tensors="pt"))
        finally:
            for handle in handles:
                handle.remove()
        x = seen["final"][0]
        norm = hf.model.norm
        gain = norm.weight.detach().float() + (1.0 if "Gemma" in type(norm).__name__ else 0.0)
        direction = torch.rsqrt(x.pow(2).mean() + getattr(norm, "variance_epsilon", getattr(norm, "eps", 0.0)))
        direction = direction * gain * (rows[t] - rows[c])
        for i, layer in enumerate(layers):
            carried = direction
            if f"post{i}" in seen:
                post, y = layer.post_attention_layernorm, seen[f"post{i}"][0]
                carried = direction * (1 + post.weight.detach().float()) * torch.rsqrt(y.pow(2).mean() + post.eps)
            weight = layer.self_attn.o_proj.weight.detach().float()  # [d_model, heads * head_dim]
            heads = model.config.num_attention_heads
            width = weight.shape[1] // heads
            read = (weight.T @ carried).view(heads, width)  # each head channel's direction
            size = (weight.abs().T @ carried.abs()).view(heads, width)
            output = seen[f"o{i}"][0].view(heads, width)  # the stored head outputs at the last token
            values = seen[f"v{i}"][1].abs().amax(0).view(-1, width)  # [kv heads, width]: the largest over the keys
            values = values.repeat_interleave(heads // values.shape[0], 0)
            keys = seen[f"v{i}"][1].shape[0]
            for h in range(heads):
                j = labels.index(f"L{i}.H{h}")
                own = float(((values[h] + output[h].abs()) * size[h]).sum())
                limits[b, j] = (bounds.random_bound(output[h] * read[h], dtype)
                                + bounds.gamma(weight.shape[0] + width + keys + 2) * own)
    return limits


def test_cli_by_source(tmp_path, capsys):
    """``python -m dla_recipes ... --by source`` loads the model with eager attention and prints head-source parts."""
    from dla_recipes.__main__ import main

    folder = tmp_path / "tiny-llama"
    tiny.build("llama").save_pretrained(folder)
    tiny.tokenizer().save_pretrained(folder)
    assert main(["w1 w2 w3", "--target", "w9", "--model", str(folder), "--by", "source", "--top", "40"]) == 0
    out = capsys.readouterr().out
    assert "by: source" in out and ".S2 " in out


def test_sources_heatmap():
    from dla_recipes import plots

    attr = dla_recipes.attribute(eager_model("llama"), PROMPTS, TARGET, contrast=CONTRAST, by="source")
    tokens = PROMPTS[0].split()
    rows, matrix = plots.source_matrix(attr, 0, k=3)
    grid = attr.sources()[0]
    assert len(rows) == 3 and matrix.shape == (3, len(tokens))
    layer, head = (int(x) for x in rows[0][1:].split(".H"))
    assert torch.equal(matrix[0], grid[layer, head])
    assert float(grid[layer, head].abs().sum()) == float(torch.nan_to_num(grid.abs()).sum(-1).max())
    fig = plots.sources_heatmap(attr, tokens, k=3)
    assert list(fig.data[0].y) == rows and fig.data[0].x[0] == "0: 'w5'"
    assert plots.sources_heatmap(attr, tokens, prompt=None, k=3).data[0].z is not None
