"""Each single head's, neuron's and routed expert's part, against a first-principles reference written here.

The sum tests (``test_families``, ``test_heads_neurons``) cannot see parts moved between heads or neurons of one
block: rolling every neuron's part by one place within its block keeps every block's sum. Here each part is checked
on its own, by label, against a reference computed in this file from torch forward hooks on a plain transformers
forward of one unpadded prompt (float32), with none of the package's code:

- the hooks capture each attention output projection's input (the heads' outputs side by side, head ``h`` the
  ``[head_dim]`` slice ``h``), each MLP down projection's input (the neurons' activations), a fused experts module's
  inputs (its rows, experts and routing weights), the input of every post-norm between a projection and the
  residual add, the final norm's input (the stream) and the lm_head's output (the logits before any soft-cap);
- the direction ``W_U[target] - W_U[contrast]`` (times the family's logit scale) is pulled back through the final
  norm frozen at the real stream, then through a sublayer's post-norm frozen at its real input and the sublayer's
  residual multiplier: the norm formulas below are written from the transformers modules' own ``forward``;
- a head's part is ``W_O[:, slice_h] @ x_h`` along that direction, a neuron's ``act_j * W_down[:, j]``, a routed
  expert's ``weight * down[e] @ (act(gate) * up)`` from the experts' own weights and routing.

The reference checks itself against the model's own tensors first (the frozen final norm and post-norms reproduce
the lm_head's output, the recomputed experts their module's output, the soft-cap the model's logits), so a wrong
reference fails here rather than passing a wrong package.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import bounds
import pytest
import torch
from conftest import CONTRAST, PROMPTS, TARGET, tiny_model
from torch import nn

import dla_recipes

PROMPT = PROMPTS[0]

# Each part is held to its own float32 rounding (part_bound, bounds.py's model) against the float64 reference on the
# same activations (measured before: 3.6e-7 of the largest part at most, gptj heads). A part moved to another head
# or neuron of its block, or negated, is off by O(the part).


@dataclass(frozen=True)
class Spec:
    """Where one family's modules sit in its transformers model (paths from the family table's entries).

    ``attn`` / ``mlp``: the output projections below each block (``mlp`` None: routed ``experts`` instead);
    ``attn_post`` / ``mlp_post``: the norm between the projection and the residual add; ``conv1d``: GPT-2's Conv1D
    (weight ``[in, out]``); ``multiplier``: config attribute each write is multiplied by before the add;
    ``logits_over``: config attribute the logits are divided by; ``softcap``: config attribute of the final cap.
    """

    layers: str
    final_norm: str
    attn: str
    mlp: str | None = None
    experts: str | None = None
    attn_post: str | None = None
    mlp_post: str | None = None
    conv1d: bool = False
    multiplier: str | None = None
    logits_over: str | None = None
    softcap: str | None = None


LLAMA = Spec("model.layers", "model.norm", "self_attn.o_proj", "mlp.down_proj")
SANDWICH = Spec("model.layers", "model.norm", "self_attn.o_proj", "mlp.down_proj",
                attn_post="post_attention_layernorm", mlp_post="post_feedforward_layernorm",
                softcap="final_logit_softcapping")
SPECS = {
    "llama": LLAMA,  # pre-norm RMSNorm
    "gpt2": Spec("transformer.h", "transformer.ln_f", "attn.c_proj", "mlp.c_proj", conv1d=True),  # LayerNorm, Conv1D
    "gemma2": SANDWICH,  # post-norms on both sublayers, (1 + w) RMSNorm, attention and final soft-caps
    "gemma3": SANDWICH,
    "olmo2": Spec("model.layers", "model.norm", "self_attn.o_proj", "mlp.down_proj",
                  attn_post="post_attention_layernorm", mlp_post="post_feedforward_layernorm"),  # post-norm only
    "gptj": Spec("transformer.h", "transformer.ln_f", "attn.out_proj", "mlp.fc_out"),  # parallel block
    "falcon": Spec("transformer.h", "transformer.ln_f", "self_attention.dense", "mlp.dense_4h_to_h"),  # parallel
    "gpt_neox": Spec("gpt_neox.layers", "gpt_neox.final_layer_norm", "attention.dense", "mlp.dense_4h_to_h"),
    "granite": Spec("model.layers", "model.norm", "self_attn.o_proj", "mlp.down_proj",
                    multiplier="residual_multiplier", logits_over="logits_scaling"),  # scaled writes and logits
    "mixtral": Spec("model.layers", "model.norm", "self_attn.o_proj", experts="mlp.experts"),  # routed experts
}
CASES = [(family, by) for family, spec in SPECS.items()
         for by in ("head", "neuron", "expert" if spec.experts else None) if by]


def module(root: nn.Module, path: str) -> nn.Module:
    for name in path.split("."):
        root = getattr(root, name)
    return root


# -- the norms, frozen at their real input: the map a direction on the output takes back to the input ------------------


def pull_through_norm(norm: nn.Module, x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """``u`` on ``norm``'s output pulled back to its input, the norm frozen at its real input ``x`` ``[d]``.

    nn.LayerNorm: ``y = (x - mean x) / sqrt(var x + eps) * g + b``, linear in ``x`` with the std fixed: ``u . y``
    takes ``center(g * u) / std`` to the input (the bias is a constant). The RMSNorms: ``y = g * x / rms(x)`` with
    ``rms = sqrt(mean x^2 + eps)``, gain ``weight`` (Llama, Mixtral, OLMo-2, Granite) or ``1 + weight`` (Gemma 2/3).
    """
    x = x.double()
    if isinstance(norm, nn.LayerNorm):
        gain = norm.weight.double() if norm.weight is not None else torch.ones_like(x)
        std = torch.sqrt(x.var(unbiased=False) + norm.eps)
        g_u = gain * u
        return (g_u - g_u.mean()) / std
    name = type(norm).__name__
    if not name.endswith("RMSNorm"):
        raise AssertionError(f"no reference formula for the norm {name}")
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    gain = norm.weight.double() + (1.0 if name.startswith("Gemma") else 0.0)
    return gain * u / torch.sqrt(x.pow(2).mean() + eps)


def norm_bias(norm: nn.Module) -> torch.Tensor | float:
    return norm.bias.double() if getattr(norm, "bias", None) is not None else 0.0


def weight_of(projection: nn.Module, conv1d: bool) -> torch.Tensor:
    """``[out, in]``: the projection's weight as ``nn.Linear`` holds it (GPT-2's Conv1D holds ``[in, out]``)."""
    return (projection.weight.T if conv1d else projection.weight).double()


# -- the reference --------------------------------------------------------------------------------------------------


def capture(model, spec: Spec):
    """Run a plain forward of ``PROMPT`` with hooks; return ``(captured, plain logits [pos, vocab])``. ``captured``:
    ``{(layer, what): tensor}`` at every position; ``what`` is ``"attn"``, ``"mlp"`` (projection inputs ``[pos,
    in]``), ``"attn_post"``, ``"mlp_post"`` (post-norm inputs), ``"experts"`` (the module's ``(hidden, index,
    weights)``, ``"experts_out"``; ``(None, "stream")`` the final norm's input, ``(None, "lm_head")`` its output."""
    hf = model._module
    captured, handles = {}, []

    def keep_input(key):
        def hook(mod, args, kwargs):
            captured[key] = (args[0] if args else next(iter(kwargs.values())))[0].detach().clone()
        return hook

    def keep_experts(key):
        def hook(mod, args, kwargs):
            values = list(args) + [kwargs[k] for k in ("hidden_states", "top_k_index", "top_k_weights") if k in kwargs]
            captured[key] = tuple(v.detach().clone() for v in values)
        return hook

    def keep_output(key):
        def hook(mod, args, output):
            captured[key] = (output[0] if isinstance(output, tuple) else output).detach().clone()
        return hook

    handles.append(module(hf, spec.final_norm).register_forward_pre_hook(keep_input((None, "stream")),
                                                                        with_kwargs=True))
    for i, layer in enumerate(module(hf, spec.layers)):
        for what in ("attn", "mlp", "attn_post", "mlp_post"):
            path = getattr(spec, what)
            if path:
                handles.append(module(layer, path).register_forward_pre_hook(keep_input((i, what)), with_kwargs=True))
        if spec.experts:
            experts = module(layer, spec.experts)
            handles.append(experts.register_forward_pre_hook(keep_experts((i, "experts")), with_kwargs=True))
            handles.append(experts.register_forward_hook(keep_output((i, "experts_out"))))
    handles.append(hf.get_output_embeddings().register_forward_hook(keep_output((None, "lm_head"))))
    ids = model.tokenizer(PROMPT, return_tensors="pt")
    try:
        with torch.no_grad():
            logits = hf(input_ids=ids["input_ids"], attention_mask=ids["attention_mask"]).logits[0]
    finally:
        for handle in handles:
            handle.remove()
    return captured, logits


@torch.no_grad()
def reference_parts(model, spec: Spec) -> tuple[dict[str, float], dict[str, float]]:
    """``({label: part}, {label: size})`` of every head, neuron and routed expert (and expert neuron) at the last
    position, in float64, from the hooks alone; checks the frozen norms against the model's own tensors on the way.
    A part's size is ``sum |terms|`` of the float32 products that make it (``part_bound``)."""
    hf = model._module
    config = hf.config
    captured, logits = capture(model, spec)
    vocab = model.tokenizer.convert_tokens_to_ids
    target, contrast = vocab(TARGET), vocab(CONTRAST)
    lm_head = hf.get_output_embeddings()
    scale = 1.0 / getattr(config, spec.logits_over) if spec.logits_over else 1.0
    u = (lm_head.weight[target] - lm_head.weight[contrast]).double() * scale  # on the final norm's output
    final = module(hf, spec.final_norm)
    stream = captured[None, "stream"][-1].double()
    d_stream = pull_through_norm(final, stream, u)  # on the stream (the final norm's input)

    # the frozen final norm reproduces the model's own logit difference (the lm_head's, scaled, before any cap)
    lm_out = captured[None, "lm_head"][0, -1].double()  # [vocab]
    lm_bias = (lm_head.bias[target] - lm_head.bias[contrast]).double() if lm_head.bias is not None else 0.0
    pre_cap = (lm_out[target] - lm_out[contrast]) * scale
    rebuilt = d_stream @ stream + (norm_bias(final) * u).sum() + lm_bias * scale
    y = final(captured[None, "stream"][-1:]).double()[0]  # the norm's float32 output, as lm_head read it
    magnitude = sum(float((lm_head.weight[t].double() * y).abs().sum()) for t in (target, contrast)) * abs(scale)
    # the model's own float32 norm and lm_head (bounds.read_rounding, no adds: the stream is its own) and the scale
    limit = bounds.read_rounding(stream.shape[0], 0) * magnitude + 2 * bounds.half_ulp(float(pre_cap))
    assert abs(float(rebuilt) - float(pre_cap)) <= limit
    cap = getattr(config, spec.softcap, None) if spec.softcap else None
    scaled = lm_out * scale
    capped = cap * torch.tanh(scaled / cap) if cap else scaled  # the model's logits: the lm_head's, scaled, capped
    # the model's float32 cap of the same lm_head output: a division, a tanh and a product (4u) and the store
    limit = 4 * bounds.unit_roundoff() * capped.abs() + bounds.half_ulp(capped)
    assert bool(((capped - logits[-1].double()).abs() <= limit).all()), (capped.float() - logits[-1]).abs().max()

    multiplier = getattr(config, spec.multiplier) if spec.multiplier else 1.0
    parts: dict[str, float] = {}
    sizes: dict[str, float] = {}
    for i, layer in enumerate(module(hf, spec.layers)):
        for what in ("attn", "mlp", "experts"):
            path = getattr(spec, what)
            if path is None:
                continue
            d = d_stream * multiplier  # on what the sublayer adds (before its multiplier)
            post_path = getattr(spec, f"{what}_post", None)
            if post_path is not None:  # a post-norm between the projection and the add, frozen at its real input
                post = module(layer, post_path)
                o = captured[i, f"{what}_post"][-1].double()
                own = post(captured[i, f"{what}_post"][-1:]).double()[0]  # the model's float32 post-norm
                # its float32 scale and gain (bounds.read_rounding less the dot: gamma_{d+1} / 2 + 5u)
                limit = (bounds.gamma(o.shape[0] + 1) / 2 + 5 * bounds.unit_roundoff()) * float((d * own).abs().sum())
                rebuilt = float(pull_through_norm(post, o, d) @ o + (norm_bias(post) * d).sum())
                assert abs(rebuilt - float(d @ own)) <= limit
                d = pull_through_norm(post, o, d)
            if what == "experts":
                parts.update(expert_parts(i, module(layer, path), captured, d, sizes))
                continue
            x = captured[i, what][-1].double()  # the projection's input at the last position
            w = weight_of(module(layer, path), spec.conv1d)  # [d_model, in]
            pulled = w.T @ d  # [in]: each input channel's share along d
            size = x.abs() * (w.abs().T @ d.abs())  # [in]: sum |terms| of each channel's products
            if what == "mlp":
                parts.update({f"L{i}.N{j}": float(x[j] * pulled[j]) for j in range(x.shape[0])})
                sizes.update({f"L{i}.N{j}": float(size[j]) for j in range(x.shape[0])})
            else:
                heads = config.num_attention_heads
                width = x.shape[0] // heads
                for h in range(heads):
                    head_slice = slice(h * width, (h + 1) * width)
                    parts[f"L{i}.H{h}"] = float((w[:, head_slice] @ x[head_slice]) @ d)
                    sizes[f"L{i}.H{h}"] = float(size[head_slice].sum())
    return parts, sizes


def part_bound(model, size: float) -> float:
    """Model: a part is a chain of float32 products over the stream's ``d`` channels and a projection's input (at
    most ``d + d_mlp`` terms a product: ``gamma`` of that times ``size``), read along a direction whose entries are
    rounded (the unembedding rows' difference, a gain: ``3u``) through at most two frozen norms' scales (each a mean
    of ``d`` squares and a root: ``gamma_{d+1} / 2 + 2u``), times a multiplier or logit scale (``u``)."""
    config = model._module.config
    d, width = config.hidden_size, getattr(config, "intermediate_size", None) or 4 * config.hidden_size
    u = bounds.unit_roundoff()
    return (bounds.gamma(d + width) + bounds.gamma(d + 1) + 8 * u) * size


def expert_parts(i: int, experts: nn.Module, captured, d: torch.Tensor, sizes: dict) -> dict[str, float]:
    """Mixtral's fused experts (``MixtralExperts.forward``): expert ``e`` on row ``h`` writes
    ``w * down[e] @ (act(gate) * up)`` with ``gate, up = (gate_up[e] @ h).chunk(2)``; checked against the module's
    own output at the last position, then split along ``d`` (experts not routed there: zero). ``sizes`` gets each
    part's ``sum |terms|``, the recomputed activations' own float32 rounding carried in (``act_rounding``)."""
    hidden, index, weights = captured[i, "experts"]
    hidden = hidden.reshape(-1, hidden.shape[-1])  # [tokens, d_model]: one prompt, so the token is the position
    h = hidden[-1].double()
    index, weights = index.reshape(hidden.shape[0], -1)[-1], weights.reshape(hidden.shape[0], -1)[-1].double()
    count, width = experts.down_proj.shape[0], experts.down_proj.shape[-1]
    parts = {f"L{i}.E{e}": 0.0 for e in range(count)}
    parts.update({f"L{i}.E{e}.N{j}": 0.0 for e in range(count) for j in range(width)})
    sizes.update(dict.fromkeys(parts, 0.0))
    written = torch.zeros_like(h)
    written_size = torch.zeros_like(h)
    for slot in range(index.shape[0]):
        e, weight = int(index[slot]), weights[slot]
        gate, up = (experts.gate_up_proj[e].double() @ h).chunk(2)
        act = experts.act_fn(gate) * up  # [I]
        size = act.abs() + act_rounding(experts, e, h, gate, up) / bounds.gamma(h.shape[0] + width)
        down = experts.down_proj[e].double()  # [d_model, I]
        written += weight * (down @ act)
        written_size += abs(weight) * (down.abs() @ size)
        parts[f"L{i}.E{e}"] += float(weight * (down @ act) @ d)
        sizes[f"L{i}.E{e}"] += float(abs(weight) * size @ (down.abs().T @ d.abs()))
        shares, share_sizes = weight * act * (down.T @ d), abs(weight) * size * (down.abs().T @ d.abs())
        for j, (share, share_size) in enumerate(zip(shares.tolist(), share_sizes.tolist(), strict=True)):
            parts[f"L{i}.E{e}.N{j}"] += share
            sizes[f"L{i}.E{e}.N{j}"] += share_size
    own = captured[i, "experts_out"].reshape(-1, h.shape[0])[-1].double()
    # the module's own float32 recomputation of the same experts (their products' chains, act_rounding)
    limit = bounds.gamma(h.shape[0] + width) * written_size + bounds.half_ulp(own)
    assert bool(((written - own).abs() <= limit).all()), (written - own).abs().max()
    return parts


def act_rounding(experts: nn.Module, e: int, h: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``[I]``: how far a float32 recomputation of expert ``e``'s activations ``act(gate) * up`` may be off. Model:
    ``gate`` and ``up`` are ``d_model``-term dots (``gamma_d`` of ``|W| |h|``), carried through ``act`` by its slope
    (silu's is at most 1.1) and the product; ``act`` and the product round ``4u`` of the result."""
    gate_up = experts.gate_up_proj[e].double().abs() @ h.abs()
    gate_error, up_error = (bounds.gamma(h.shape[0]) * gate_up).chunk(2)
    act = experts.act_fn(gate)
    return 1.1 * gate_error * up.abs() + act.abs() * up_error + 4 * bounds.unit_roundoff() * (act * up).abs()


# -- the tests ------------------------------------------------------------------------------------------------------

KIND = {"head": r"L\d+\.H\d+", "neuron": r"L\d+\.(E\d+\.)?N\d+", "expert": r"L\d+\.E\d+"}
REFERENCE: dict[str, dict[str, float]] = {}


def reference(family: str) -> tuple[dict[str, float], dict[str, float]]:
    if family not in REFERENCE:
        REFERENCE[family] = reference_parts(tiny_model(family), SPECS[family])
    return REFERENCE[family]


def test_the_specs_name_the_families_the_tiny_models_are():
    for family in SPECS:
        assert dla_recipes.families.family_of(tiny_model(family)).name == family


@pytest.mark.parametrize("family,by", CASES)
def test_each_part_is_the_first_principles_part(family, by):
    """Every head's / neuron's / expert's part, by label, equals its reference part (no part moved within a block,
    none negated, none read at another position or through another layer's norm)."""
    model = tiny_model(family)
    attr = dla_recipes.attribute(model, PROMPT, TARGET, contrast=CONTRAST, by=by)
    pattern = re.compile(KIND[by] + "$")
    got = {label: float(value) for label, value in zip(attr.labels, attr.values[0]) if pattern.match(label)}
    values, sizes = reference(family)
    expected = {label: value for label, value in values.items() if pattern.match(label)}
    assert sorted(got) == sorted(expected), f"{family} by={by}: labels differ"
    scale = max(abs(v) for v in expected.values())
    assert scale > 0, f"{family} by={by}: every reference part is zero (nothing to check)"
    # each part within its own float32 rounding (part_bound) of the float64 reference
    ratios = {label: abs(got[label] - expected[label]) / part_bound(model, sizes[label]) for label in expected
              if sizes[label] > 0}
    assert all(got[label] == 0 for label in expected if sizes[label] == 0), f"{family} by={by}: a part from nothing"
    worst = max(ratios, key=ratios.get)
    wrong = sum(ratio > 1 for ratio in ratios.values())
    assert ratios[worst] <= 1, (
        f"{family} by={by}: {wrong} of {len(ratios)} parts off; worst {worst}: package {got[worst]:.6g}, reference "
        f"{expected[worst]:.6g} ({ratios[worst]:.3g} of its bound; the largest part {scale:.3g})")
