"""Dictionary features (``dictionaries=``): every latent's part, the decoder bias, the skip path and the error, checked
against references written here from the dictionary's own ``encode`` / ``decode`` (sae-lens's ``StandardSAE``,
``JumpReLUSAE``, ``TopKSAE``, ``Transcoder``, ``SkipTranscoder``, ``JumpReLUTranscoder`` with random weights) on
activations read with plain torch hooks on a plain transformers forward of each prompt alone (the attribution runs
on the padded batch), through the final norm frozen at the stream it really read (an RMSNorm: its own output over
its input, channel by channel; a LayerNorm: its formula at its input's variance). No package arithmetic is used.

Families, one of each group: sequential (llama), parallel (gpt_neox, LayerNorm), post-norm (gemma2: a dictionary
stands for what is written after the post-norm; olmo2: post-norms only, where a transcoder is refused), MoE MLP (qwen2_moe), hybrid with an MLP (recurrent_gemma); float32,
bfloat16, and bfloat16 under ``torch.autocast("cpu", bfloat16)`` (NDIF's bracket); ``L<i>.resid`` against the block's input.
The random dictionaries are calibrated on the activations so that about a fifth of the latents fire (never none,
never all). Bad input is refused with every problem in one ``InputError``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import types
from dataclasses import replace

import pytest
import torch
from bounds import gamma, unit_roundoff
from conftest import PROMPTS

import dla_recipes
from dla_recipes.errors import InputError
from dla_recipes.features import Dictionary, Encoder
from dla_recipes.testing import tiny


def lens():
    """sae-lens (the Makefile's test extra installs it beside the stack, --no-deps), or the test is skipped."""
    return pytest.importorskip("sae_lens")


class Plain:
    """A ReLU dictionary written here (no sae-lens, no package code): ``encode`` / ``decode`` by hand, given to
    ``attribute`` as a plain-tensor ``Dictionary``."""

    def __init__(self, d: int):
        self.W_enc, self.b_enc = torch.zeros(d, D_SAE), torch.zeros(D_SAE)
        self.W_dec, self.b_dec = torch.zeros(D_SAE, d), torch.zeros(d)
        self.cfg = types.SimpleNamespace(apply_b_dec_to_input=False)

    def encode(self, x):
        return torch.clamp(x @ self.W_enc + self.b_enc, min=0)

    def decode(self, a):
        return a @ self.W_dec + self.b_dec

    def dictionary(self) -> Dictionary:
        return Dictionary(self.W_dec, self.b_dec, Encoder(self.W_enc, self.b_enc))

TARGET, CONTRAST = "w20", "w21"
D_SAE = 48
# each family's HF modules: the term's write (its output) and a transcoder's input (the norm its sublayer reads)
SITES = {
    "llama": {"mlp": ("mlp", "post_attention_layernorm"), "attn": ("self_attn", None)},
    "gpt_neox": {"mlp": ("mlp", "post_attention_layernorm"), "attn": ("attention", None)},
    "gemma2": {"mlp": ("post_feedforward_layernorm", "pre_feedforward_layernorm"),
               "attn": ("post_attention_layernorm", None)},
    "qwen2_moe": {"mlp": ("mlp", "post_attention_layernorm")},
    "olmo2": {"mlp": ("post_feedforward_layernorm", None)},  # post-norms only: no norm in front of the MLP
    "recurrent_gemma": {"mlp": ("mlp_block", "channel_pre_norm")},
}
_MODELS: dict = {}


def model_for(family: str, dtype=torch.float32):
    if (family, dtype) not in _MODELS:
        _MODELS[(family, dtype)] = (tiny.standardized(family) if dtype == torch.float32 else
                                    dla_recipes.load(tiny.build(family).to(dtype), tokenizer=tiny.tokenizer(),
                                                     device_map="cpu"))
    return _MODELS[(family, dtype)]


def first(value):
    return value[0] if isinstance(value, tuple) else value


def read_plain(model, prompt: str, reads: dict, autocast: bool = False) -> dict:
    """A plain transformers forward of one prompt with torch hooks: each ``reads[name] = (module, "in"/"out")``
    at the last position (float64), plus the final norm's input and output there."""
    hf, got, handles = model._module, {}, []
    modules = dict(reads, final=(model.ln_final._module, "both"))
    for name, (module, side) in modules.items():
        def hook(mod, args, output, name=name, side=side):
            if side in ("in", "both"):
                got[name + ("_in" if side == "both" else "")] = first(args)[0, -1].double()
            if side in ("out", "both"):
                got[name + ("_out" if side == "both" else "")] = first(output)[0, -1].double()
        handles.append(module.register_forward_hook(hook))
    ids = model.tokenizer(prompt, return_tensors="pt")
    context = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    try:
        with torch.no_grad(), context:
            hf(input_ids=ids["input_ids"], attention_mask=ids["attention_mask"])
    finally:
        for h in handles:
            h.remove()
    return got


def token(model, text: str) -> int:
    return model.tokenizer(text, add_special_tokens=False)["input_ids"][0]


def logit_direction(model, got: dict, target: str, contrast: str) -> torch.Tensor:
    """``[d_model]`` float64: d(logit target - contrast) / d(final norm input), the norm's scale frozen at its input."""
    W = model._module.get_output_embeddings().weight.detach().double()
    w = W[token(model, target)] - W[token(model, contrast)]
    norm, x, y = model.ln_final._module, got["final_in"], got["final_out"]
    if isinstance(norm, torch.nn.LayerNorm):
        s = 1.0 / torch.sqrt(x.var(unbiased=False) + norm.eps)
        gw = norm.weight.detach().double() * w
        return s * (gw - gw.mean())
    return w * (y / x)  # RMSNorm y = g * x * s: its own ratio, channel by channel


def calibrated(sae, x: torch.Tensor, kind: str):
    """Random weights with sparse, non-trivial activations on inputs ``x`` ``[m, d]``: ~20% of latents fire."""
    g = torch.Generator().manual_seed(7)
    d = x.shape[-1]
    with torch.no_grad():
        sae.W_enc.copy_(torch.randn(d, D_SAE, generator=g) / d ** 0.5)
        sae.W_dec.copy_(torch.randn(D_SAE, sae.W_dec.shape[1], generator=g) / d ** 0.5)
        sae.b_dec.copy_(0.05 * torch.randn(sae.b_dec.shape, generator=g))
        centred = x.float() - (sae.b_dec if sae.cfg.apply_b_dec_to_input else 0)
        pre = centred @ sae.W_enc
        sae.b_enc.copy_(-pre.quantile(0.8, dim=0))
        if hasattr(sae, "threshold"):
            sae.threshold.copy_(0.2 * (pre + sae.b_enc).clamp(min=0).mean(0))
        if hasattr(sae, "W_skip"):
            sae.W_skip.copy_(0.1 * torch.randn(sae.W_skip.shape, generator=g) / d ** 0.5)
    return sae


def make(kind: str, d: int):
    """An sae-lens dictionary of architecture ``kind`` (random weights: ``calibrated`` sets them)."""
    if kind == "plain":
        return Plain(d)
    sae_lens, common = lens(), {"d_in": d, "d_sae": D_SAE}
    if kind == "relu":
        return sae_lens.StandardSAE(sae_lens.StandardSAEConfig(**common))
    if kind == "jumprelu":
        return sae_lens.JumpReLUSAE(sae_lens.JumpReLUSAEConfig(**common))
    if kind == "topk":
        return sae_lens.TopKSAE(sae_lens.TopKSAEConfig(**common, k=6))
    config = dict(common, d_out=d, apply_b_dec_to_input=False)
    if kind == "transcoder":
        return sae_lens.Transcoder(sae_lens.TranscoderConfig(**config))
    if kind == "skip":
        return sae_lens.SkipTranscoder(sae_lens.SkipTranscoderConfig(**config))
    return sae_lens.JumpReLUTranscoder(sae_lens.JumpReLUTranscoderConfig(**config))


def reference(sae, x: torch.Tensor, w: torch.Tensor, v: torch.Tensor) -> dict:
    """The parts from the dictionary's own encode / decode (float32, no autocast) on its input ``x`` and the term's
    write ``w``, along ``v``: ``F`` [d_sae], ``bias``, ``skip``, ``error``, and each one's error bound.

    Error model (each compared value is two float32 computations of the same products, plus the direction): a latent
    ``a_i`` is a ``d``-term dot (``gamma_d`` of ``sum |x W_enc[:, i]|`` each side, relu / jump 1-Lipschitz away from
    the threshold); ``W_dec[i] . v`` a ``d``-term dot (``gamma_d``); the direction ``v`` the frozen norm's scale
    and gain times the unembedding, a few roundings in the model's dtype each side (``8 u_model``) and the
    package's d-term fit (``gamma_d``); the error is a difference of sums of all of them (their bounds added, and
    the ``gamma_{d_sae + d}`` of summing the reconstruction and the write)."""
    with torch.no_grad(), torch.autocast("cpu", enabled=False):
        xf = x.float().unsqueeze(0)
        a = sae.encode(xf)[0].double()
        recon = sae.decode(sae.encode(xf))[0].double()
        skip = (xf @ sae.W_skip.T)[0].double() if hasattr(sae, "W_skip") else None
    W_dec, b_dec = sae.W_dec.detach().double(), sae.b_dec.detach().double()
    W_enc = sae.W_enc.detach().double()
    d = v.shape[0]
    x_in = x - (b_dec if getattr(sae.cfg, "apply_b_dec_to_input", False) else 0)
    enc_mag = (x_in.abs() @ W_enc.abs()) + sae.b_enc.detach().double().abs()  # [d_sae]
    dec_v = W_dec @ v
    dec_mag = W_dec.abs() @ v.abs()
    u_dir = 8 * unit_roundoff(DTYPE[0]) + 2 * gamma(d)
    F = a * dec_v
    F_tol = 2 * gamma(d) * enc_mag * dec_v.abs() + a.abs() * (2 * gamma(d) + u_dir) * dec_mag
    bias = float(b_dec @ v)
    bias_tol = (2 * gamma(d) + u_dir) * float(b_dec.abs() @ v.abs())
    out = {"F": F, "F_tol": F_tol, "bias": bias, "bias_tol": bias_tol}
    total = w @ v - recon @ v
    tol = F_tol.sum() + bias_tol + (gamma(D_SAE + d) + u_dir) * float((w.abs() @ v.abs()) + (recon.abs() @ v.abs()))
    if skip is not None:
        out["skip"] = float(skip @ v)
        skip_mag = float(x.abs() @ sae.W_skip.detach().double().abs().T @ v.abs())
        out["skip_tol"] = (2 * gamma(d) + u_dir) * skip_mag
        total = total - out["skip"]
        tol = tol + out["skip_tol"]
    out["error"], out["error_tol"] = float(total), float(tol)
    return out


ERRORS: dict = {}  # the largest |package - reference| per part kind so far (read by the report, not asserted)
DTYPE = [torch.float32]  # the dtype the model under test computes in (the reference's direction rounds in it)


def check(family: str, key: str, kind: str, dtype=torch.float32, autocast=False, by="head", prompts=PROMPTS,
          model=None, target=TARGET, contrast=CONTRAST, edit=None, sae=None):
    """Attribute the padded batch with one dictionary at ``key``; compare each prompt's columns with the reference
    (``model``: a loaded model of ``family``'s module names, else the tiny one; ``edit``: a vector added to the
    term's write, by ``intervene=`` in the attribution and by a torch hook in the reference; ``sae``: the
    dictionary, else a calibrated random one)."""
    DTYPE[0] = dtype
    model = model or model_for(family, dtype)
    layer, term = int(key.split(".")[0][1:]), key.split(".")[1]
    block = model.layers[layer]._module
    reads = {}
    if term != "resid":
        out_name, in_name = SITES[family][term]
        reads = {"w": (getattr(block, out_name), "out")}
        if kind in ("transcoder", "skip", "jumprelu_transcoder"):
            reads["x"] = (getattr(block, in_name), "out")
    got, handles = [], []
    if edit is not None:  # the edit in the reference: a torch hook on the term's module
        def add(mod, args, output):
            return (output[0] + edit, *output[1:]) if isinstance(output, tuple) else output + edit
        handles.append(getattr(block, SITES[family][term][0]).register_forward_hook(add))
    for p in prompts:
        if term == "resid":  # the block's input: a forward pre-hook
            box = {}

            def pre(mod, args, kwargs, box=box):
                box["x"] = (args[0] if args else kwargs["hidden_states"])[0, -1].double()

            h = block.register_forward_pre_hook(pre, with_kwargs=True)
            try:
                g = read_plain(model, p, {}, autocast)
            finally:
                h.remove()
            g["x"] = g["w"] = box["x"]
        else:
            g = read_plain(model, p, reads, autocast)
            g.setdefault("x", g["w"])
        got.append(g)
    for h in handles:
        h.remove()
    d = got[0]["w"].shape[0]
    sae = sae if sae is not None else calibrated(make(kind, d), torch.stack([g["x"] for g in got]), kind)
    context = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    with context:
        given = sae.dictionary() if isinstance(sae, Plain) else sae
        def intervene(m, layer=layer, term=term, edit=edit):
            sublayer = m.layers[layer].mlp if term == "mlp" else m.layers[layer].self_attn
            sublayer.output = sublayer.output + edit

        attr = dla_recipes.attribute(model, prompts, target, contrast=contrast, by=by, dictionaries={key: given},
                                     intervene=None if edit is None else intervene)
    labels = list(attr.labels)
    columns = [labels.index(f"{key}.F{i}") for i in range(D_SAE)]
    active = 0
    worst = 0.0
    for b, g in enumerate(got):
        v = logit_direction(model, g, target, contrast)
        ref = reference(sae, g["x"], g["w"], v)
        row = attr.values[b].double()
        F = row[columns]
        active += int((F != 0).sum())
        assert torch.all((F - ref["F"]).abs() <= ref["F_tol"] + 1e-300), (family, key, kind, b, (F - ref["F"]).abs().max())
        names = ["bias", "error"] + (["skip"] if "skip" in ref else [])
        for name in names:
            got_value = float(row[labels.index(f"{key}.{name}")])
            assert abs(got_value - ref[name]) <= ref[f"{name}_tol"], (family, key, kind, b, name, got_value, ref[name])
        worst = max(worst, float(((F - ref["F"]).abs() / (ref["F_tol"] + 1e-30)).max()))
        for name in ["F", *names]:
            gap = (F - ref["F"]).abs().max() if name == "F" else abs(float(row[labels.index(f"{key}.{name}")]) - ref[name])
            ERRORS[name] = max(ERRORS.get(name, 0.0), float(gap))
    assert 0 < active < D_SAE * len(prompts), f"the dictionary's activations are trivial: {active} active"
    return attr, worst


CASES = [("llama", "L1.mlp", "plain"), ("gemma2", "L1.attn", "plain"), ("llama", "L1.mlp", "relu"), ("llama", "L0.attn", "topk"), ("llama", "L2.mlp", "skip"),
         ("gpt_neox", "L1.mlp", "jumprelu"), ("gpt_neox", "L1.attn", "relu"),
         ("gemma2", "L1.mlp", "transcoder"), ("gemma2", "L0.attn", "jumprelu"),
         ("qwen2_moe", "L1.mlp", "jumprelu_transcoder"), ("olmo2", "L1.mlp", "topk"), ("recurrent_gemma", "L1.mlp", "skip"),
         ("llama", "L2.resid", "relu"), ("gemma2", "L1.resid", "topk")]


@pytest.mark.parametrize("family,key,kind", CASES, ids=[f"{f}-{k}-{v}" for f, k, v in CASES])
def test_each_latent_bias_skip_error_is_the_dictionarys_own(family, key, kind):
    attr, _ = check(family, key, kind)
    assert attr.error < 1e-4  # the self-check held the parts to the model's own logit too


@pytest.mark.parametrize("family,key,kind,dtype,autocast", [
    ("llama", "L1.mlp", "skip", torch.bfloat16, False), ("gemma2", "L1.mlp", "relu", torch.bfloat16, False),
    ("llama", "L1.mlp", "jumprelu", torch.bfloat16, True), ("gpt_neox", "L2.resid", "relu", torch.bfloat16, True)])
def test_low_precision_and_ndif_autocast(family, key, kind, dtype, autocast):
    check(family, key, kind, dtype, autocast)


REAL = ["smollm2-135m", pytest.param("gemma3-270m", marks=pytest.mark.slow)]
CITY = ["The Eiffel Tower is in the city of", "The capital of France is", "Rome is in Italy and Paris is in"]


@pytest.mark.real
@pytest.mark.parametrize("name", REAL)
def test_real_models(name):
    """SmolLM2-135M (llama: an SAE on an MLP and a skip transcoder on another) and Gemma-3-270M (post-norms: a
    JumpReLU transcoder on an MLP, an SAE on the stream), float32, against the same references."""
    from dla_recipes import models

    model = dla_recipes.load(models.REGISTRY[name](), dtype=torch.float32, device_map="cpu", dispatch=True)
    family = "llama" if name.startswith("smollm2") else "gemma2"  # Gemma-3's block has Gemma-2's module names
    first = ("L12.mlp", "relu") if family == "llama" else ("L6.mlp", "jumprelu_transcoder")
    second = ("L20.mlp", "skip") if family == "llama" else ("L9.resid", "topk")
    for key, kind in (first, second):
        attr, _ = check(family, key, kind, model=model, prompts=CITY, target=" Paris", contrast=" Rome")
        assert attr.error < 1e-4 * max(1.0, float(attr.logit.abs().max()))


def test_features_with_neurons_positions_top_frame_and_stats():
    """The other terms keep by=; position="all" rows each the sum; top / to_frame name latents; stats work."""
    model = model_for("llama")
    sae = calibrated(make("relu", 64), torch.randn(16, 64), "relu")
    dictionaries = {"L1.mlp": sae}
    attr = dla_recipes.attribute(model, PROMPTS, TARGET, contrast=CONTRAST, by="neuron", dictionaries=dictionaries)
    labels = list(attr.labels)
    assert "L0.N5" in labels and "L1.N5" not in labels and "L1.mlp.F3" in labels and "L1.mlp.error" in labels
    assert "L1.mlp.F3" in attr.to_frame().index
    blocks = dla_recipes.attribute(model, PROMPTS, TARGET, contrast=CONTRAST)
    summed = attr.blocks()  # the latents, bias, error and rest summed back into L1.mlp: the block's own part. Model:
    # the error is the write's dot (the same op on the same tensors as by="block") less the float32 sum of the
    # others, and blocks() sums the d_sae + 3 columns again: two float32 sums, gamma_{d_sae + 4} of |columns| each
    column = list(summed.labels).index("L1.mlp")
    mine = [list(attr.labels).index(x) for x in attr.labels if x.startswith("L1.mlp")]
    bound = 2 * gamma(D_SAE + 4) * attr.values[:, mine].double().abs().sum(-1)
    assert list(summed.labels) == list(blocks.labels)
    assert bool(((summed.values[:, column] - blocks.values[:, column]).double().abs() <= bound).all())
    top = attr.top(5, kind="feature")
    assert len(top) == 5 and all(c.startswith("L1.mlp.F") for c in top["component"])
    every = dla_recipes.attribute(model, PROMPTS[0], "next", position="all", by="head", dictionaries=dictionaries)
    assert every.values.shape[-1] == len(every.labels) and bool(torch.isfinite(every.values[every.mask]).all())
    stats = dla_recipes.attribute(model, PROMPTS, TARGET, contrast=CONTRAST, by="head", reduce="stats",
                                  dictionaries=dictionaries)
    assert "L1.mlp.F3" in list(stats.labels)


class OwnTopK:
    """A TopK dictionary known only by its own ``encode``, its k in ``cfg.k`` and no sae-lens architecture: read from
    its weights as a ReLU, every one of its 48 latents would fire (``b_enc`` lifts every pre-activation above 0);
    its own encode fires 4 a site."""

    def __init__(self, d: int):
        g = torch.Generator().manual_seed(11)
        self.W_enc, self.b_enc = torch.randn(d, D_SAE, generator=g) / d ** 0.5, torch.full((D_SAE,), 100.0)
        self.W_dec, self.b_dec = torch.randn(D_SAE, d, generator=g) / d ** 0.5, 0.05 * torch.randn(d, generator=g)
        self.cfg = types.SimpleNamespace(apply_b_dec_to_input=False, k=4)

    def encode(self, x):
        pre = torch.relu(x @ self.W_enc + self.b_enc)
        top = pre.topk(self.cfg.k, dim=-1)
        return torch.zeros_like(pre).scatter(-1, top.indices, top.values)

    def decode(self, a):
        return a @ self.W_dec + self.b_dec


def test_an_unknown_architecture_runs_its_own_encode():
    attr, _ = check("llama", "L1.mlp", "plain", sae=OwnTopK(64))  # every latent the reference's, from its own encode
    latents = [i for i, label in enumerate(attr.labels) if label.startswith("L1.mlp.F")]
    assert int((attr.values[:, latents] != 0).sum(-1).max()) == 4


def test_an_edit_is_attributed_through_the_dictionary():
    """Clamping a latent through the write (``intervene=``: ``5 W_dec[i]`` added to block 2's MLP output) is an edit
    the SAE reads: every latent's part, the bias and the error equal the references on a plain forward with the same
    edit made by a torch hook."""
    sae = calibrated(make("relu", 64), torch.randn(16, 64), "relu")
    boost = (5.0 * sae.W_dec[3]).detach().clone()
    attr, _ = check("llama", "L2.mlp", "relu", edit=boost, sae=sae)
    assert attr.error < 1e-4


def test_bad_dictionaries_are_all_named_at_once():
    model = model_for("llama")
    d = 64
    bad = Dictionary(torch.randn(D_SAE, d + 1), torch.zeros(d), Encoder(torch.randn(d, D_SAE), torch.zeros(D_SAE)))
    nan_w = torch.randn(D_SAE, d)
    nan_w[5, 3] = float("nan")
    nan = Dictionary(nan_w, torch.zeros(d), Encoder(torch.randn(d, D_SAE), torch.zeros(D_SAE)))
    half = Dictionary(torch.randn(D_SAE, d, dtype=torch.float16), torch.zeros(d),
                      Encoder(torch.randn(d, D_SAE), torch.zeros(D_SAE)))
    with pytest.raises(InputError) as raised:
        dla_recipes.attribute(model, PROMPTS, TARGET, dictionaries={
            "L1.mlp": bad, "L9.mlp": nan, "L1.attn": nan, "L2.mlp": half, "L0.mixer": nan})
    message = str(raised.value)
    for needle in ("W_dec is (48, 65)", "'L9.mlp'", "latent(s) 5", "float16", "no 'mixer' term"):
        assert needle in message, (needle, message)
    sae_lens = lens()
    config = sae_lens.StandardSAEConfig(d_in=d, d_sae=D_SAE)
    config.metadata.hook_name = "blocks.2.hook_mlp_out"
    with pytest.raises(InputError, match="names hook 'blocks.2.hook_mlp_out'"):
        dla_recipes.attribute(model, PROMPTS, TARGET, dictionaries={"L1.mlp": sae_lens.StandardSAE(config)})
    z_config = sae_lens.StandardSAEConfig(d_in=d, d_sae=D_SAE, reshape_activations="hook_z")
    with pytest.raises(InputError, match="hook_z"):
        dla_recipes.attribute(model, PROMPTS, TARGET, dictionaries={"L1.attn": sae_lens.StandardSAE(z_config)})
    with pytest.raises(InputError, match="reads the stream without one"):  # OLMo-2: no norm in front of its MLP
        dla_recipes.attribute(model_for("olmo2"), PROMPTS, TARGET, dictionaries={"L1.mlp": make("transcoder", d)})
    good = calibrated(make("relu", d), torch.randn(16, d), "relu")
    by_hook = dla_recipes.attribute(model, PROMPTS, TARGET, dictionaries={"blocks.1.hook_mlp_out": good})
    assert "L1.mlp.F0" in list(by_hook.labels)  # a TransformerLens hook name is a key too
    with pytest.raises(InputError, match="inside|write"):
        dla_recipes.attribute(model, PROMPTS, TARGET, dictionaries={"L0.mlp": good, "L2.resid": good})


def test_two_keys_naming_one_site_are_refused():
    """A key and a TransformerLens hook name for the same site (the stream entering block 2 is
    ``blocks.1.hook_resid_post``): one dictionary would silently replace the other, so both keys are named."""
    model = model_for("llama")
    good = calibrated(make("relu", 64), torch.randn(16, 64), "relu")
    for first, second in (("L2.mlp", "blocks.2.hook_mlp_out"), ("L2.resid", "blocks.1.hook_resid_post")):
        with pytest.raises(InputError) as raised:
            dla_recipes.attribute(model, PROMPTS, TARGET, dictionaries={first: good, second: good})
        assert f"'{first}' and '{second}' both name {first}" in str(raised.value), str(raised.value)


def test_a_dataset_reduced_to_stats_over_latents():
    """``attribute_dataset(..., dictionaries=, reduce="stats")``: per-latent statistics over the rows, chunk by chunk
    (the chunks merged exactly: the mean of each latent's column equals the mean of the rows' parts)."""
    model = model_for("llama")
    sae = Plain(64)
    sae = calibrated(sae, torch.randn(16, 64), "plain").dictionary()
    rows = [{"prompt": p, "target": TARGET, "contrast": CONTRAST} for p in PROMPTS * 2]
    stats = dla_recipes.attribute_dataset(model, rows, target="target", contrast="contrast", by="head",
                                          reduce="stats", batch_size=2, dictionaries={"L1.mlp": sae})
    whole = dla_recipes.attribute(model, [r["prompt"] for r in rows], TARGET, contrast=CONTRAST, by="head",
                                  dictionaries={"L1.mlp": sae})
    summary = stats.summary()
    column = list(whole.labels).index("L1.mlp.F3")
    mean = float(summary.loc["L1.mlp.F3", "mean"]) if "L1.mlp.F3" in summary.index else None
    assert mean is not None and abs(mean - float(whole.values[:, column].double().mean())) <= 1e-6 * (
        1 + float(whole.values[:, column].abs().max()))


def test_no_wait_for_the_device_with_dictionaries():
    """The features split neither waits for the device nor uploads from the host while the forward runs (the
    dictionaries are placed on the device before it starts), counted on the CPU as a GPU would see it
    (``test_syncs``' counter), on a bfloat16 model with an SAE, a skip transcoder and a residual dictionary."""
    from test_syncs import bf16_model, counted, waits

    model = bf16_model("llama")
    d = int(model.lm_head.weight.shape[-1])
    skip = calibrated(make("skip", d), torch.randn(16, d), "skip") if importlib.util.find_spec("sae_lens") else None
    dictionaries = {"L1.resid": Plain(d).dictionary(), "L2.attn": Plain(d).dictionary()}
    if skip is not None:
        dictionaries["L2.mlp"] = skip
    counted(model, by="head", dictionaries=dictionaries)
    _, traces = counted(model, by="head", dictionaries=dictionaries)
    assert traces and all(waits(counts) == [] for counts in traces), [waits(c) for c in traces]


def test_only_the_largest_parts_leave_the_trace_and_dropped_sums_the_rest():
    """The wire (``trace.sparse``): with ``keep`` at least every site's active count the kept parts are the dense
    columns bit for bit; with ``keep`` below it each site keeps its ``keep`` largest |parts| exactly, every other
    latent reads 0, ``L1.mlp.dropped`` is the sum of the others, and the columns still sum to the model's logit."""
    model = model_for("llama")
    d = int(model.lm_head.weight.shape[-1])
    x = torch.randn(16, d, generator=torch.Generator().manual_seed(11))  # seeded: the same latents in any test order
    sae = calibrated(make("plain", d), x, "relu").dictionary()
    call = {"contrast": CONTRAST, "by": "head"}

    def run(keep):
        return dla_recipes.attribute(model, PROMPTS, TARGET, dictionaries={"L1.mlp": replace(sae, keep=keep)}, **call)

    every = run(D_SAE)  # every latent sent: the trace's own dense columns
    labels = list(every.labels)
    F, dropped = [j for j, x in enumerate(labels) if x.startswith("L1.mlp.F")], labels.index("L1.mlp.dropped")
    parts = every.values[:, F]
    active = (parts != 0).sum(-1)
    assert bool((every.values[:, dropped] == 0).all()) and int(active.min()) > 1, active
    tight = run(int(active.max()))  # the least keep holding every active latent: the same numbers, bit for bit
    assert torch.equal(tight.values, every.values)
    capped = run(1)
    assert list(capped.labels) == labels
    others = [j for j in range(len(labels)) if j not in F and j != dropped]
    assert torch.equal(capped.values[:, others], every.values[:, others])
    top = parts.abs().topk(1, dim=-1).indices
    kept = torch.zeros_like(parts).scatter(-1, top, parts.gather(-1, top))
    assert torch.equal(capped.values[:, F], kept)
    rest = (parts - kept).double()
    # the dropped column is a float32 sum of the D_SAE - 1 others (exact zeros where kept): gamma_{D_SAE} of |rest|
    bound = gamma(D_SAE) * rest.abs().sum(-1)
    assert bool(((capped.values[:, dropped].double() - rest.sum(-1)).abs() <= bound).all())
    assert bool((capped.values[:, dropped] != 0).all())
    assert capped.error < 1e-4  # the self-check held the columns' sum to the model's own logit
    # and to the dense columns' sum: the same float32 numbers but the dropped column's sum (bound above), in float64
    gap = (capped.values.double().sum(-1) - every.values.double().sum(-1)).abs()
    assert bool((gap <= bound + gamma(len(labels)) * every.values.double().abs().sum(-1)).all())


def test_a_bad_keep_is_refused():
    """``Dictionary.keep`` must be an int > 0: a clear error naming it, before the forward pass."""
    model = model_for("llama")
    sae = Plain(int(model.lm_head.weight.shape[-1])).dictionary()
    for keep in (0, 2.5):
        with pytest.raises(InputError, match=f"keep={keep!r}: give how many latents a site sends back"):
            dla_recipes.attribute(model, PROMPTS, TARGET, dictionaries={"L1.mlp": replace(sae, keep=keep)})
