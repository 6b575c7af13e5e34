"""``sources=dict(upstream="head")`` on post-norm families (Gemma-2/3, OLMo-2): each upstream head's write carried
through the post-norm frozen at its real input, against a reference on a plain forward.

The reference never runs dla_recipes' recipe: a plain transformers forward of each prompt alone, eager attention,
torch forward hooks capturing the last block's attention pattern ``A`` and the stream its values read (its input
norm's input, or the block's input where the values read the stream itself: OLMo-2), and for every earlier block
its output projection's input ``z`` and its post-norm's input ``o`` (the projection's real output), its MLP's write
(the MLP post-norm's output), the last block's post-norm input and the final norm's input. Upstream head ``k`` of
block ``j`` wrote ``post_norm(o_k) * r(o) / r(o_k)`` at each source, ``o_k = z[..., k] @ W_O[:, k]^T`` its slice of
the projection and ``r`` the RMSNorm scale ``1 / sqrt(mean(x^2) + eps)``: the real post-norm module with its scale
held at the one of its real input (the norm is ``gain * x * r(x)``, so this is ``gain * o_k * r(o)``). Each path
part is then the ablation of ``tests/test_paths.py`` (the value of the last block's input norm at ``x_s`` minus at
``x_s - c_s``, its scale held at the real one), times ``A[h, s]``, through ``o_proj``'s head slice, the last block's
post-norm and the final norm (each frozen at its real input: the diagonal ``norm(1) * r(x) / r(1)``) along
lm_head's target minus contrast rows. The attribution itself runs on the padded batch.
"""

import copy

import pytest
import torch
from conftest import CONTRAST, PROMPTS, TARGET, assert_parts_are_the_models, eager_model
from test_paths import forward_with, largest_gap, rms_scale
from test_positions import attribution_bound, batch_ratio, difference

import dla_recipes
from dla_recipes import DLAError, ExactnessError
from dla_recipes.plan import build_plan
from dla_recipes.plan.sources import check_upstream
from dla_recipes.testing import tiny
from dla_recipes.trace.kinds import paths

HEADS = {"upstream": "head"}
# post-norm families: sandwich norms (gemma2, gemma3), post-norms only and no input norm (olmo2: the values
# read the stream itself)
POST_NORM = ["gemma2", "gemma3", "olmo2"]


def diagonal(norm, x: torch.Tensor) -> torch.Tensor:
    """``[..., d_model]``: an RMSNorm frozen at ``x`` as the diagonal of its map, ``norm(1) * r(x) / r(1)``."""
    ones = torch.ones_like(x)
    return norm(ones) * rms_scale(norm, x) / rms_scale(norm, ones)


@torch.no_grad()
def reference_head_paths(model, prompt: str, ids: tuple | None = None) -> tuple[dict, torch.Tensor]:
    """``({label: [heads, length] part}, rest [heads, length])`` of the last block's heads at the prompt's last
    token, each upstream attention split into its heads (see the module docstring); ``ids``: the target's and the
    contrast's token ids (default TARGET's and CONTRAST's). A low-precision model's activations are read as it
    stored them and the arithmetic is float32's, on a float32 copy of its modules."""
    hf = model._module
    blocks = hf.model.layers
    last = blocks[-1]
    in_norm = getattr(last, "input_layernorm", None)  # None: the values read the stream itself
    seen: dict = {}

    def keep(name, output=True):
        def hook(module, args, out):
            seen[name] = (out[0] if isinstance(out, tuple) else out) if output else args[0]
        return hook

    hooks = [blocks[0].register_forward_pre_hook(lambda m, a, k: seen.__setitem__("embed", (a or (k["hidden_states"],))[0]),
                                                 with_kwargs=True),
             last.self_attn.register_forward_hook(lambda m, a, out: seen.__setitem__("A", out[1])),
             last.post_attention_layernorm.register_forward_hook(keep("p_last", output=False)),
             hf.model.norm.register_forward_hook(keep("final", output=False))]
    if in_norm is not None:
        hooks.append(in_norm.register_forward_hook(keep("x", output=False)))
    else:
        hooks.append(last.register_forward_pre_hook(lambda m, a, k: seen.__setitem__("x", (a or (k["hidden_states"],))[0]),
                                                    with_kwargs=True))
    for j, block in enumerate(blocks[:-1]):
        hooks += [block.self_attn.o_proj.register_forward_hook(keep(f"z{j}", output=False)),
                  block.post_attention_layernorm.register_forward_hook(keep(f"o{j}", output=False)),
                  block.post_feedforward_layernorm.register_forward_hook(keep(f"L{j}.mlp"))]
    forward_with(model, prompt, hooks)
    if next(hf.parameters()).dtype != torch.float32:  # the arithmetic on float32 copies of the same weights
        hf = copy.deepcopy(hf).float()
        blocks = hf.model.layers
        last = blocks[-1]
        in_norm = getattr(last, "input_layernorm", None)
    A = seen["A"][0, :, -1].float()  # [heads, keys] at the last token
    heads, keys = A.shape
    v_proj, o_proj = last.self_attn.v_proj, last.self_attn.o_proj
    x = seen["x"][0].float()  # [keys, d_model]
    head_dim = o_proj.weight.shape[1] // heads
    ids = ids or tuple(model.tokenizer.convert_tokens_to_ids(t) for t in (TARGET, CONTRAST))
    unembed = hf.get_output_embeddings().weight.float()
    d = (unembed[ids[0]] - unembed[ids[1]]) * diagonal(hf.model.norm, seen["final"][0, -1].float())
    d = d * diagonal(last.post_attention_layernorm, seen["p_last"][0, -1].float())  # the last block's post-norm
    along = torch.einsum("Dhd,D->hd", o_proj.weight.float().view(-1, heads, head_dim), d)  # [heads, head_dim]

    def read(values: torch.Tensor) -> torch.Tensor:  # [keys, kv * head_dim] values -> [heads, keys] parts
        v = values.view(keys, -1, head_dim).repeat_interleave(heads // (values.shape[-1] // head_dim), dim=1)
        return A * torch.einsum("shd,hd->hs", v, along)

    def normed(stream: torch.Tensor) -> torch.Tensor:  # the values' input at the real scale of x
        if in_norm is None:
            return stream
        return in_norm(stream) * rms_scale(in_norm, x) / rms_scale(in_norm, stream)

    writes = {"embed": seen["embed"][0].float()}
    for j, block in enumerate(blocks[:-1]):
        weight, post = block.self_attn.o_proj.weight.float(), block.post_attention_layernorm
        o = seen[f"o{j}"][0].float()  # [keys, d_model] the post-norm's real input
        upstream_heads = weight.shape[1] // head_dim
        for k in range(upstream_heads):
            cut = slice(k * head_dim, (k + 1) * head_dim)
            o_k = seen[f"z{j}"][0][..., cut].float() @ weight[:, cut].T
            writes[f"L{j}.H{k}"] = post(o_k) * rms_scale(post, o) / rms_scale(post, o_k)
        writes[f"L{j}.mlp"] = seen[f"L{j}.mlp"][0].float()
    real = v_proj(x if in_norm is None else in_norm(x))
    parts = {label: read(real - v_proj(normed(x - c))) for label, c in writes.items()}
    return parts, read(v_proj(torch.zeros_like(x)))


def check_against_reference(model, attr, prompts, limit, ids=None) -> tuple[float, float]:
    """``(worst gap over its bound, largest reference part)`` of the last block's path parts, each row against its
    prompt's reference; the run's upstream labels are exactly the reference's (no column missing, none extra)."""
    last = len(model.layers) - 1
    worst, largest = 0.0, 0.0
    for b, prompt in enumerate(prompts):
        parts, rest = reference_head_paths(model, prompt, ids)
        prefix = f"L{last}.H0.S0<-"
        assert {label[len(prefix):] for label in attr.labels if label.startswith(prefix)} == set(parts)
        gap, size = largest_gap(attr, parts, rest, b, last)
        worst, largest = max(worst, gap / float(limit[b])), max(largest, size)
    return worst, largest


@pytest.mark.parametrize("family", POST_NORM)
def test_upstream_heads_through_the_post_norm_match_the_plain_forward(family):
    """Float32, the padded batch: every path part by upstream head within both forwards' rounding of the row's
    logit (``attribution_bound``: the parts are terms of the stream that logit reads), and the parts sum to the
    model's own logit."""
    model = eager_model(family)
    attr = dla_recipes.attribute(model, PROMPTS, TARGET, contrast=CONTRAST, by="source", sources=HEADS)
    assert_parts_are_the_models(model, attr, PROMPTS, f"{family} by=source upstream=head")
    limit = attribution_bound(model, attr, difference(model))
    worst, largest = check_against_reference(model, attr, PROMPTS, limit)
    assert largest > 1e-3  # the reference is not trivially zero
    assert worst <= 1, f"{family}: {worst:.3g} bounds"


def test_a_planted_fault_is_caught():
    """The heads not carried through their post-norm (its frozen scale and gain dropped): the reference comparison
    fails, or the attribution refuses itself."""
    model = eager_model("gemma2")
    original = paths.Paths.head_columns

    def dropped(self, write, *args):
        return original(self, paths.HeadsWrite(write.z, write.projection, write.planned), *args)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(paths.Paths, "head_columns", dropped)
        try:
            attr = dla_recipes.attribute(model, PROMPTS, TARGET, contrast=CONTRAST, by="source", sources=HEADS)
        except ExactnessError:
            return
    worst, _ = check_against_reference(model, attr, PROMPTS, attribution_bound(model, attr, difference(model)))
    assert worst > 1, worst


def low_precision(family: str, dtype: torch.dtype):
    return dla_recipes.load(tiny.build(family).to(dtype), tokenizer=tiny.tokenizer(), device_map="cpu",
                            attn_implementation="eager")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", POST_NORM)
def test_padded_batch_equals_each_prompt_alone(family, dtype):
    """Each row of the padded batch is its prompt's attribution alone, within both forwards' rounding of its logit
    in the model's dtype (``attribution_bound``, from ``bounds.logit_rounding``); the sources a shorter prompt does
    not have are zero; the self-check holds both ways (bf16 included)."""
    model = eager_model(family) if dtype == torch.float32 else low_precision(family, dtype)
    batch = dla_recipes.attribute(model, PROMPTS, TARGET, contrast=CONTRAST, by="source", sources=HEADS)
    assert any("<-L0.H1" in label for label in batch.labels)
    for b, prompt in enumerate(PROMPTS):
        alone = dla_recipes.attribute(model, prompt, TARGET, contrast=CONTRAST, by="source", sources=HEADS)
        index = [batch.labels.index(label) for label in alone.labels]
        limit = attribution_bound(model, alone, difference(model))
        assert batch_ratio(batch.values[b, index][None], alone.values, limit) <= 1, (family, dtype, b)
        rest = sorted(set(range(len(batch.labels))) - set(index))
        assert bool((batch.values[b, rest] == 0).all())


@pytest.mark.parametrize("family", ["gemma2", "olmo2"])
def test_bfloat16_against_the_reference_on_its_own_activations(family):
    """A bfloat16 model: the path parts by upstream head against the reference computed in float32 from the bf16
    model's own stored activations (z, the post-norms' inputs, the stream, the pattern). Both are float32 arithmetic
    on the same stored values, so they agree within float32's rounding of the row's logit (``attribution_bound`` of
    the float32 model, the same weights before their bf16 rounding), not bfloat16's."""
    model = low_precision(family, torch.bfloat16)
    attr = dla_recipes.attribute(model, PROMPTS, TARGET, contrast=CONTRAST, by="source", sources=HEADS)
    limit = attribution_bound(eager_model(family), attr, difference(model))
    worst, largest = check_against_reference(model, attr, PROMPTS, limit)
    assert largest > 1e-3 and worst <= 1, (family, worst)


def test_still_refused_names_what_stands_after_the_projection():
    """The refusal is kept for a map ``upstream="head"`` cannot carry each head through (here a scale on the
    projection's input, planted in gemma2's plan): its message names it; the post-norm alone is no reason."""
    from dataclasses import replace

    model = eager_model("gemma2")
    plan = build_plan(model)
    check_upstream(model, plan, [len(plan.layers) - 1], "head")  # the post-norm alone: accepted
    first = tuple(replace(p, projection_multiplier=2.0) if p.term.name == "attn" else p for p in plan.layers[0])
    planted = replace(plan, layers=(first, *plan.layers[1:]))
    with pytest.raises(DLAError, match=r"upstream='head': block 0's heads are not written by their output projection "
                                       r"alone \(then a multiplier on the projection's input\)"):
        check_upstream(model, planted, [len(plan.layers) - 1], "head")


@pytest.mark.real
@pytest.mark.slow  # loads Gemma-3-270M: ~15 s of CPU
def test_real_gemma3():
    """Gemma-3-270M, float32, eager, one prompt: the last block's path parts by upstream head against the
    reference, within both forwards' rounding of the logit, and the parts sum to the plain forward's logit."""
    from dla_recipes import models

    model = dla_recipes.load(models.gemma3_270m_path(), attn_implementation="eager", device_map="cpu")
    prompt = "The Eiffel Tower is in the city of"
    attr = dla_recipes.attribute(model, prompt, " Paris", contrast=" Rome", by="source",
                                 sources={"upstream": "head", "layers": [-1]})
    ids = tuple(model.tokenizer(t, add_special_tokens=False)["input_ids"][0] for t in (" Paris", " Rome"))
    paris_rome = lambda b, p, z: z[p, ids[0]] - z[p, ids[1]]
    limit = attribution_bound(model, attr, paris_rome)
    worst, largest = check_against_reference(model, attr, [prompt], limit, ids)
    assert largest > 1e-3 and worst <= 1, (worst, largest)
    source = dla_recipes.attribute(model, prompt, " Paris", contrast=" Rome", by="source", sources={"layers": [-1]})
    assert batch_ratio(attr.sources().nan_to_num(), source.sources().nan_to_num(), limit) <= 1
