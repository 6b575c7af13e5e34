"""``attribute(..., by="source", sources=dict(upstream="block"))``: path parts against an ablation on a plain forward.

The reference never runs dla_recipes' recipe: a plain transformers forward of each prompt alone, eager attention,
torch forward hooks capturing the last block's attention pattern ``A``, its input norm's input ``x``, what each
upstream component wrote (the embedding entering block 0, each block's attention and MLP outputs) and the final
norm's input and output. The part of ``L{last}.H{h}.S{s}<-{c}`` is an ablation through the model's own modules:
the value projection of the input norm's output at ``x_s`` minus that of its output at ``x_s - c_s`` with the
norm's scale held at the real one (the module called on ``x_s - c_s``, times ``r(x_s) / r(x_s - c_s)``, ``r`` the
RMSNorm scale ``1 / sqrt(mean(x^2) + eps)``), times ``A[h, s]`` and carried through ``o_proj``'s head slice and
the final norm (frozen at its real input) along lm_head's target minus contrast rows. The source's rest is the same
for the value of a zero stream (the value bias). The attribution itself runs on the padded batch.
"""

import contextlib

import bounds
import pytest
import torch
from conftest import CONTRAST, PROMPTS, TARGET, assert_parts_are_the_models, eager_model, source_cases
from test_positions import attribution_bound, batch_ratio, difference

import dla_recipes
from dla_recipes import DLAError, InputError
from dla_recipes.components import parse_labels
from dla_recipes.testing import tiny

UPSTREAM = {"upstream": "block"}
# RMSNorm families whose writes are the attention's and the MLP's outputs (the hooks below read them there):
# no bias (llama), a value bias (qwen2), a 1 + w gain and a scaled embedding (gemma).
REFERENCE = ["llama", "qwen2", "gemma"]
# Refused with a reason (plan.sources.check_upstream): a per-block scale (gemma4's layer_scalar), a gate on the
# stream (doge), a write read inside the attention module before its pattern (bloom).
REFUSED = ["gemma4_moe", "gemma4_moe_ple", "doge", "bloom"]
# Every comparison of parts below (the hooked reference, the paths against the sources, upstream heads against their
# blocks, a padded batch against each prompt alone, sdpa against eager): within both computations' rounding of the
# row's logit, the parts being terms of the stream it reads (test_positions.batch_bound, bounds.py's model).
# Measured before, of max(1, the largest part): 4.1e-8 to 6.7e-8 on the tiny families, 5.1e-7 on SmolLM2.


def rms_scale(norm, x: torch.Tensor) -> torch.Tensor:
    """``[..., 1]``: the RMSNorm scale ``1 / sqrt(mean(x^2) + eps)`` of ``norm`` at ``x``."""
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    return torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def forward_with(model, prompt: str, hooks: list) -> None:
    """A plain transformers forward of ``prompt`` alone with the torch ``hooks`` registered, each removed after it
    whatever happens."""
    with contextlib.ExitStack() as stack:
        for hook in hooks:
            stack.callback(hook.remove)
        model._module(**model.tokenizer(prompt, return_tensors="pt"))


@torch.no_grad()
def reference_paths(model, prompt: str, ids: tuple | None = None, by_head: bool = False) -> tuple[dict, torch.Tensor]:
    """``({label: [heads, length] part}, rest [heads, length])`` of the last block's heads at the prompt's last
    token, by ablation on a plain forward of the prompt alone (see the module docstring); ``ids``: the target's and
    the contrast's token ids (default TARGET's and CONTRAST's); ``by_head``: each upstream head's write ablated
    alone (``L1.H0``: its slice of ``o_proj``'s input times its columns of ``o_proj``'s weight), not the attention's."""
    hf = model._module
    blocks = hf.model.layers
    last = blocks[-1]
    seen: dict = {}
    hooks = [blocks[0].register_forward_pre_hook(lambda m, a, k: seen.__setitem__("embed", (a or (k["hidden_states"],))[0]),
                                                 with_kwargs=True),
             last.self_attn.register_forward_hook(lambda m, a, out: seen.__setitem__("A", out[1])),
             last.input_layernorm.register_forward_hook(lambda m, a, out: seen.__setitem__("x", a[0])),
             hf.model.norm.register_forward_hook(lambda m, a, out: seen.__setitem__("final", (a[0], out)))]
    for j, block in enumerate(blocks[:-1]):
        hooks.append(block.self_attn.register_forward_hook(lambda m, a, out, j=j: seen.__setitem__(f"L{j}.attn", out[0])))
        hooks.append(block.self_attn.o_proj.register_forward_hook(lambda m, a, out, j=j: seen.__setitem__(f"z{j}", a[0])))
        hooks.append(block.mlp.register_forward_hook(lambda m, a, out, j=j: seen.__setitem__(f"L{j}.mlp", out)))
    forward_with(model, prompt, hooks)
    A = seen["A"][0, :, -1].float()  # [heads, keys] at the last token
    heads, keys = A.shape
    norm, v_proj, o_proj = last.input_layernorm, last.self_attn.v_proj, last.self_attn.o_proj
    x = seen["x"][0].float()  # [keys, d_model]
    head_dim = o_proj.weight.shape[1] // heads
    ids = ids or tuple(model.tokenizer.convert_tokens_to_ids(t) for t in (TARGET, CONTRAST))
    unembed = hf.get_output_embeddings().weight.float()
    d = unembed[ids[0]] - unembed[ids[1]]
    fx, fy = (t[0, -1].float() for t in seen["final"])
    d = d * (fy / fx)  # the final RMSNorm frozen at its real input: J^T d = (y / x) * d elementwise
    w_o = o_proj.weight.float().view(-1, heads, head_dim)  # [d_model, heads, head_dim]
    along = torch.einsum("Dhd,D->hd", w_o, d)  # [heads, head_dim]: each head's o_proj slice, read along d

    def read(values: torch.Tensor) -> torch.Tensor:  # [keys, kv * head_dim] values -> [heads, keys] parts
        v = values.view(keys, -1, head_dim).repeat_interleave(heads // (values.shape[-1] // head_dim), dim=1)
        return A * torch.einsum("shd,hd->hs", v, along)

    real = v_proj(norm(x))
    parts = {}
    for j, block in enumerate(blocks[:-1]):  # each upstream head's write: its slice of o_proj's input, its columns
        weight = block.self_attn.o_proj.weight.float()
        for k in range(heads):
            cut = slice(k * head_dim, (k + 1) * head_dim)
            seen[f"L{j}.H{k}"] = (seen[f"z{j}"][..., cut].float() @ weight[:, cut].T)
    def writers(j):  # block j's upstream components, in forward order
        return ([f"L{j}.H{k}" for k in range(heads)] if by_head else [f"L{j}.attn"]) + [f"L{j}.mlp"]

    for label in ["embed"] + [c for j in range(len(blocks) - 1) for c in writers(j)]:
        c = seen[label][0].float()
        ablated = x - c
        held = norm(ablated) * rms_scale(norm, x) / rms_scale(norm, ablated)  # the norm at its real scale
        parts[label] = read(real - v_proj(held))
    return parts, read(v_proj(torch.zeros_like(x)))


def largest_gap(attr, parts: dict, rest: torch.Tensor, b: int, layer: int) -> tuple[float, float]:
    """``(max |ours - reference|, max |reference|)`` over block ``layer``'s path parts and rests of row ``b``."""
    worst, largest = 0.0, 0.0
    heads, length = rest.shape
    for h in range(heads):
        for s in range(length):
            for label, ref in parts.items():
                ours = float(attr.values[b, attr.labels.index(f"L{layer}.H{h}.S{s}<-{label}")])
                worst, largest = max(worst, abs(ours - float(ref[h, s]))), max(largest, abs(float(ref[h, s])))
            ours = float(attr.values[b, attr.labels.index(f"L{layer}.H{h}.S{s}")])  # the source's rest
            worst = max(worst, abs(ours - float(rest[h, s])))
    return worst, largest


@pytest.mark.parametrize("upstream", ["block", "head"])
@pytest.mark.parametrize("family", REFERENCE)
def test_paths_match_an_ablation_on_the_plain_forward(family, upstream):
    model = eager_model(family)
    attr = dla_recipes.attribute(model, PROMPTS, TARGET, contrast=CONTRAST, by="source",
                                 sources={"upstream": upstream})
    assert_parts_are_the_models(model, attr, PROMPTS, f"{family} by=source upstream={upstream}")
    limit = attribution_bound(model, attr, difference(model))  # both forwards' rounding (batch_bound)
    worst, largest = 0.0, 0.0
    for b, prompt in enumerate(PROMPTS):
        reference = reference_paths(model, prompt, by_head=upstream == "head")
        gap, size = largest_gap(attr, *reference, b, len(model.layers) - 1)
        worst, largest = max(worst, gap / float(limit[b])), max(largest, size)
    assert largest > 1e-3  # the reference is not trivially zero
    assert worst <= 1, f"{family}: {worst:.3g} bounds"
    if family == "qwen2":  # a value bias: the rest is not zero
        assert float(attr.values[:, [j for j, c in enumerate(attr.components)
                                     if c.source is not None and c.upstream is None]].abs().max()) > 1e-4


def same_as_source(model, attr, source, what: str, reference=None) -> None:
    """The path parts sum to the same call's ``L.H.S`` parts without upstream, and the heads to its heads: within
    both computations' rounding of each row's logit (``reference``, default TARGET - CONTRAST; batch_bound)."""
    assert attr.heads().labels == source.heads().labels, what
    limit = attribution_bound(model, source, reference or difference(model))
    grid, plain = attr.sources().nan_to_num(), source.sources().nan_to_num()
    assert batch_ratio(grid, plain, limit) <= 1, (what, batch_ratio(grid, plain, limit))
    assert batch_ratio(attr.heads().values, source.heads().values, limit) <= 1, what


SUPPORTED = [f for f in tiny.FAMILIES if f not in REFUSED]


@pytest.mark.parametrize("family", source_cases(SUPPORTED))
def test_every_family_sums_or_refuses(family):
    """Every family where by='source' works: the path parts sum to its source parts and to the model's own logit
    (a plain forward of each prompt alone), with the writes summing to the stream (the fit errors), or, for the
    REFUSED ones only, a refusal naming sources=dict(upstream=...)."""
    model = eager_model(family)
    try:
        source = dla_recipes.attribute(model, PROMPTS, TARGET, contrast=CONTRAST, by="source")
    except DLAError:
        return  # by='source' itself refuses (test_sources checks each refusal)
    attr = dla_recipes.attribute(model, PROMPTS, TARGET, contrast=CONTRAST, by="source", sources=UPSTREAM)
    assert_parts_are_the_models(model, attr, PROMPTS, f"{family} by=source upstream=block")
    same_as_source(model, attr, source, family)
    assert attr.diagnostics["norm_fit_error"] <= 1e-4  # the writes' sum against the stream, the parts' rebuild
    assert any("<-embed" in label for label in attr.labels)


# upstream="head" on families with other head layouts (fused QKV, parallel blocks, a bias on o_proj, experts)
HEAD_FAMILIES = ["gpt2", "gptj", "gpt_neox", "phi3", "mixtral", "cohere", "olmo", "opt", "granite"]


@pytest.mark.parametrize("family", HEAD_FAMILIES)
def test_upstream_heads_sum_to_upstream_blocks(family):
    """``upstream="head"``: each upstream attention's heads (and its bias's column) sum to its ``upstream="block"``
    part, MLPs and the embedding are the same columns, and the parts sum to the model's own logit."""
    model = eager_model(family)
    blocks = dla_recipes.attribute(model, PROMPTS, TARGET, contrast=CONTRAST, by="source", sources=UPSTREAM)
    heads = dla_recipes.attribute(model, PROMPTS, TARGET, contrast=CONTRAST, by="source", sources={"upstream": "head"})
    assert_parts_are_the_models(model, heads, PROMPTS, f"{family} by=source upstream=head")
    index = {label: j for j, label in enumerate(blocks.labels)}
    owner = []
    for c in heads.components:  # an upstream head's column belongs to its attention's column of upstream="block"
        up = c.upstream
        if up is not None and ".H" in up:
            up = up.split(".H")[0] + ".attn"
        owner.append(index[c._replace(upstream=up).label])
    summed = torch.zeros_like(blocks.values).index_add_(1, torch.tensor(owner), heads.values)
    # the heads' float32 pull-backs and their sum, within both computations' rounding of the logit (batch_bound)
    assert batch_ratio(summed, blocks.values, attribution_bound(model, blocks, difference(model))) <= 1
    assert any("<-L0.H1" in label for label in heads.labels)


@pytest.mark.parametrize("family", REFUSED)
def test_refused_with_the_reason(family):
    model = eager_model(family)
    with pytest.raises(DLAError, match=r"sources=dict\(upstream=...\) is not supported: "):
        dla_recipes.attribute(model, PROMPTS, TARGET, contrast=CONTRAST, by="source", sources=UPSTREAM)


def test_bad_input():
    model = eager_model("llama")
    with pytest.raises(InputError, match="'block', 'head'"):
        dla_recipes.attribute(model, PROMPTS, TARGET, by="source", sources={"upstream": "neuron"})
    with pytest.raises(InputError, match="upstream"):
        dla_recipes.attribute(model, PROMPTS, TARGET, by="source", sources={"upstreams": "block"})


def test_labels_and_views():
    model = eager_model("llama")
    attr = dla_recipes.attribute(model, PROMPTS, TARGET, contrast=CONTRAST, by="source",
                                 sources={"upstream": "block", "layers": [-1]})
    last = len(model.layers) - 1
    upstream = ["embed"] + [f"L{j}.{t}" for j in range(last) for t in ("attn", "mlp")]
    run = [label for label in attr.labels if label.startswith(f"L{last}.H0.S1")]
    assert run == [f"L{last}.H0.S1<-{c}" for c in upstream] + [f"L{last}.H0.S1"]
    assert parse_labels(attr.labels) == tuple(attr.components)  # the labels read back (an attribution from labels)
    assert attr.blocks().labels == dla_recipes.attribute(model, PROMPTS, TARGET, by="block").labels


def test_padded_batch_equals_each_prompt_alone():
    model = eager_model("qwen2")
    batch = dla_recipes.attribute(model, PROMPTS, TARGET, contrast=CONTRAST, by="source", sources=UPSTREAM)
    for b, prompt in enumerate(PROMPTS):
        alone = dla_recipes.attribute(model, prompt, TARGET, contrast=CONTRAST, by="source", sources=UPSTREAM)
        index = [batch.labels.index(label) for label in alone.labels]
        limit = attribution_bound(model, alone, difference(model))  # both batchings' rounding (batch_bound)
        assert batch_ratio(batch.values[b, index][None], alone.values, limit) <= 1
        rest = sorted(set(range(len(batch.labels))) - set(index))
        assert bool((batch.values[b, rest] == 0).all())  # sources this prompt does not have


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_several_positions_sdpa_and_eager(family):
    eager = eager_model(family)
    sdpa = tiny.standardized(family, attn_implementation="sdpa")
    for model in (eager, sdpa):
        attr = dla_recipes.attribute(model, PROMPTS, TARGET, contrast=CONTRAST, position=[1, -1], by="source",
                                     sources=UPSTREAM)
        source = dla_recipes.attribute(model, PROMPTS, TARGET, contrast=CONTRAST, position=[1, -1], by="source")
        same_as_source(model, attr.sites, source.sites, family)
    ours = dla_recipes.attribute(sdpa, PROMPTS, TARGET, contrast=CONTRAST, by="source", sources=UPSTREAM)
    theirs = dla_recipes.attribute(eager, PROMPTS, TARGET, contrast=CONTRAST, by="source", sources=UPSTREAM)
    assert ours.labels == theirs.labels
    assert batch_ratio(ours.values, theirs.values, attribution_bound(eager, theirs, difference(eager))) <= 1


def test_intervene():
    """An MLP of block 0 zeroed: its path parts are 0, and the parts sum to the edited model's own logit."""
    model = eager_model("llama")

    def ablate(m):
        m.layers[0].mlp.output[:] = 0

    attr = dla_recipes.attribute(model, PROMPTS, TARGET, contrast=CONTRAST, by="source", sources=UPSTREAM,
                                 intervene=ablate)
    own = dla_recipes.attribute(model, PROMPTS, TARGET, contrast=CONTRAST, by="block", intervene=ablate)
    assert torch.allclose(attr.values.sum(-1) + attr.constant, own.logit, atol=1e-5)
    columns = [j for j, label in enumerate(attr.labels) if label.endswith("<-L0.mlp")]
    assert columns and bool((attr.values[:, columns] == 0).all())


@pytest.mark.server
def test_remote_equals_local(tmp_path):
    from conftest import serve_tiny, single_threaded

    with serve_tiny(tmp_path, ("llama",)) as server:
        for options in ({"upstream": "block", "top_heads": 2}, {"upstream": "head", "layers": [-1]}):
            with server.client():
                remote = dla_recipes.attribute(server.remote_model("llama"), PROMPTS, TARGET, contrast=CONTRAST,
                                               by="source", remote=True, sources=options)
            with single_threaded():
                local = dla_recipes.attribute(server.local_model("llama"), PROMPTS, TARGET, contrast=CONTRAST,
                                              by="source", sources=options)
            assert remote.labels == local.labels and any("<-" in label for label in remote.labels)
            assert torch.equal(remote.values, local.values), float((remote.values - local.values).abs().max())


@pytest.mark.server
def test_remote_ndif_like_equals_local(tmp_path):
    """As NDIF runs a request (bfloat16, sdpa, under autocast): the recipe's products stay float32 (``exact``), so
    remote equals the same local model under the same bracket bit for bit."""
    from conftest import serve_tiny, single_threaded

    with serve_tiny(tmp_path, ("llama",), ndif=True) as server:
        options = {"upstream": "block", "layers": [-1]}
        with server.client():
            remote = dla_recipes.attribute(server.remote_model("llama"), PROMPTS, TARGET, contrast=CONTRAST,
                                           by="source", remote=True, sources=options)
        with single_threaded(), server.bracket():
            local = dla_recipes.attribute(server.local_model("llama", dispatch=True), PROMPTS, TARGET,
                                          contrast=CONTRAST, by="source", sources=options)
        assert remote.labels == local.labels and any("<-" in label for label in remote.labels)
        assert torch.equal(remote.values, local.values), float((remote.values - local.values).abs().max())


@pytest.mark.real
@pytest.mark.slow  # loads SmolLM2: ~10 s of CPU
def test_real_smollm2():
    from dla_recipes import models

    model = dla_recipes.load(models.default_model_path(), attn_implementation="eager", device_map="cpu")
    prompt = "The Eiffel Tower is in the city of"
    options = {"upstream": "block", "layers": [-1]}
    attr = dla_recipes.attribute(model, prompt, " Paris", contrast=" Rome", by="source", sources=options)
    source = dla_recipes.attribute(model, prompt, " Paris", contrast=" Rome", by="source", sources={"layers": [-1]})
    ids = tuple(model.tokenizer(t)["input_ids"][0] for t in (" Paris", " Rome"))
    paris_rome = lambda b, p, z: z[p, ids[0]] - z[p, ids[1]]
    same_as_source(model, attr, source, "smollm2", paris_rome)
    encoded = model.tokenizer(prompt, return_tensors="pt")
    with torch.no_grad():
        logits = model._module(**encoded).logits[0, -1].float()
    own = float(logits[ids[0]] - logits[ids[1]])
    assert abs(float(attr.values.sum() + attr.constant[0]) - own) <= 1e-4 * max(1.0, abs(own))
    limit = float(attribution_bound(model, source, paris_rome)[0])  # both forwards' rounding (batch_bound)
    gap, size = largest_gap(attr, *reference_paths(model, prompt, ids), 0, len(model.layers) - 1)
    assert size > 1e-3 and gap <= limit, gap
    heads = dla_recipes.attribute(model, prompt, " Paris", contrast=" Rome", by="source",
                                  sources={"upstream": "head", "layers": [-1]})
    gap, size = largest_gap(heads, *reference_paths(model, prompt, ids, by_head=True), 0, len(model.layers) - 1)
    assert size > 1e-3 and gap <= limit, gap


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_low_precision(family, dtype):
    """A bfloat16 / float16 model: the self-check holds; the path parts sum to the source parts to the model's own
    rounding (the residual adds the writes' sum skips, ``path_bounds``; measured before: 3.6e-4 of max(1, the
    largest part) in bfloat16, 4.9e-5 in float16); the frozen norms within two stores in the dtype (2u of the
    largest output; measured before: 5.7e-3 and 7.6e-4)."""
    model = dla_recipes.load(tiny.build(family).to(dtype), tokenizer=tiny.tokenizer(), device_map="cpu",
                             attn_implementation="eager")
    attr = dla_recipes.attribute(model, PROMPTS, TARGET, contrast=CONTRAST, by="source", sources=UPSTREAM)
    source = dla_recipes.attribute(model, PROMPTS, TARGET, contrast=CONTRAST, by="source")
    plain, paths = source.sources().nan_to_num(), attr.sources().nan_to_num()
    limit, rebuilds = zip(*(path_bounds(model, prompt, plain.shape[-1]) for prompt in PROMPTS))
    limit = torch.stack(limit)
    beyond = limit == 0  # sources a prompt does not have: zero on both sides
    assert torch.equal(paths[beyond], plain[beyond])
    assert float(((paths - plain).abs()[~beyond] / limit[~beyond]).max()) <= 1
    # the largest of: a frozen norm's fit (2u), the writes' sum against the stream (rebuilds), the paths against
    # their source part (limit over the largest part of its block)
    u = bounds.unit_roundoff(dtype)
    parts = (limit.amax((0, 2, 3)) / plain.abs().amax((0, 2, 3)).clamp(min=1e-30)).max()
    fits = max(2 * u + u * u + bounds.gamma(model.config.hidden_size + 1), max(rebuilds), float(parts))
    assert attr.diagnostics["norm_fit_error"] <= fits


def path_bounds(model, prompt: str, sources: int) -> tuple[torch.Tensor, float]:
    """``([layers, heads, sources], rebuild)``: how far a low-precision llama's or gemma3's path parts of each head
    and source (its last token's) may sum from its source part, and the writes' sum from the stream each block reads
    (relative to its largest entry: each add rounds at most ``u`` of its result). Model: the paths read every write
    at the source in float32,
    the source part reads the model's own stream there (each of its adds stored in the model's dtype), its input
    norm's output (stored twice at most) and its values (stored once): independent roundings (``bounds.random_bound``)
    carried through the frozen norm, v_proj, the head's weight on the source, o_proj and the final norm's frozen
    direction; float32's own products over the writes (``gamma`` of their ``3 d + head_dim`` terms)."""
    hf = model._module
    dtype = next(hf.parameters()).dtype
    layers, config = hf.model.layers, hf.config
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    sandwich = hasattr(layers[0], "pre_feedforward_layernorm")
    seen = {}

    def keep(name, output=True):
        def hook(module, args, out):
            value = out if output else args[0]
            seen[name] = (value[0] if isinstance(value, tuple) else value)[0].float()
        return hook

    handles = [hf.model.norm.register_forward_hook(keep("final", output=False))]
    for i, layer in enumerate(layers):
        writes = (layer.post_attention_layernorm, layer.post_feedforward_layernorm) if sandwich else (
            layer.self_attn, layer.mlp)
        handles += [writes[0].register_forward_hook(keep(f"a{i}")), writes[1].register_forward_hook(keep(f"m{i}")),
                    layer.input_layernorm.register_forward_hook(keep(f"x{i}", output=False)),
                    layer.input_layernorm.register_forward_hook(keep(f"y{i}")),
                    layer.self_attn.v_proj.register_forward_hook(keep(f"v{i}")),
                    layer.self_attn.register_forward_hook(
                        lambda m, a, out, i=i: seen.__setitem__(f"A{i}", out[1][0].float()))]
        if sandwich:
            handles.append(layer.post_attention_layernorm.register_forward_hook(keep(f"p{i}", output=False)))
    try:
        with torch.no_grad():
            out = hf(**model.tokenizer(prompt, return_tensors="pt"), output_hidden_states=True, output_attentions=True)
    finally:
        for handle in handles:
            handle.remove()
    stream = out.hidden_states[0][0].float()
    written, results = [stream.abs()], []  # |what each add added| and each add's result, at every position
    for i in range(len(layers)):
        for name in (f"a{i}", f"m{i}"):
            written.append(seen[name].abs())
            stream = (stream.to(dtype) + seen[name].to(dtype)).float()
            results.append(stream)

    def gain(norm):
        return norm.weight.detach().float() + (1.0 if "Gemma" in type(norm).__name__ else 0.0)

    def scale(norm, x):
        eps = norm.variance_epsilon if hasattr(norm, "variance_epsilon") else norm.eps
        return torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)

    rows = hf.lm_head.weight.detach().float()
    t, c = (model.tokenizer.convert_tokens_to_ids(x) for x in (TARGET, CONTRAST))
    final = seen["final"][-1]
    direction = scale(hf.model.norm, final) * gain(hf.model.norm) * (rows[t] - rows[c])
    limits = torch.zeros(len(layers), heads, sources, dtype=torch.float64)
    length = stream.shape[0]
    for i, layer in enumerate(layers):
        carried = direction
        if sandwich:
            post = layer.post_attention_layernorm
            carried = direction * gain(post) * scale(post, seen[f"p{i}"][-1])
        w_o = layer.self_attn.o_proj.weight.detach().float()
        w_v = layer.self_attn.v_proj.weight.detach().float()
        width = w_o.shape[1] // heads
        norm = layer.input_layernorm
        r = scale(norm, seen[f"x{i}"])[:, 0]  # [pos]
        for h in range(heads):
            along = w_o[:, h * width:(h + 1) * width].T @ carried  # [width]
            along_size = w_o[:, h * width:(h + 1) * width].abs().T @ carried.abs()
            g = h // (heads // kv)
            through = w_v[g * width:(g + 1) * width].T @ along  # [d]: the value's direction on the norm's output
            through_size = w_v[g * width:(g + 1) * width].abs().T @ along_size
            for s in range(length):
                weight = float(seen[f"A{i}"][h, -1, s])
                j = gain(norm) * r[s] * through  # on the stream at source s
                stored = [j * res[s] for res in results[:2 * i]] + [through * seen[f"y{i}"][s]] * 2
                stored.append(along * seen[f"v{i}"][s, g * width:(g + 1) * width])
                ours = float((gain(norm).abs() * r[s] * through_size * sum(w[s] for w in written[:2 * i + 1])).sum())
                limits[i, h, s] = weight * (bounds.random_bound(torch.cat(stored), dtype)
                                            + bounds.gamma(3 * w_o.shape[0] + width) * ours)
    u = bounds.unit_roundoff(dtype)
    rebuild = max(float(u * sum(res.abs() for res in results[:2 * i]).max() / seen[f"x{i}"].abs().max())
                  for i in range(1, len(layers)))
    return limits, rebuild
