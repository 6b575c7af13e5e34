"""Verify the family survey (notes/family_survey.md) numerically, with plain PyTorch forward hooks (no nnsight).

For every family in ``dla_recipes.testing.tiny.FAMILIES`` this builds the tiny *perturbed* model, runs one
left-padded batch, records every module's inputs and outputs with forward hooks (tensors cloned at hook time,
which matters for Falcon's in-place ``mlp_output += attention_output``), and then checks the survey's claims:

  embed  : the embedding term the survey names (built from ``embed_tokens`` output + positions / scales / LN)
           equals what enters block 0 (``layers[0]`` input);
  stream : the final-norm input, rebuilt as a *sum of terms* (embedding term + every write, each write carried
           through the stream operations the survey describes: multipliers, Gemma-4 ``layer_scalar``, Doge
           residual gates, ZAYA residual scaling + biases, DeepSeek-V4 hyper-connection mixing / ``hc_head``
           collapse), equals the real final-norm input at every position;
  layer  : the same running sum equals every layer's real output (max over layers; DeepSeek-V4: the
           [b, s, hc, d] stream);
  norm   : the final norm recomputed with the stated formula (LayerNorm / RMSNorm w / RMSNorm 1+w /
           weight-only LayerNorm / parameter-free LayerNorm) equals its output;
  logits : ``lm_head`` (W x + b) + scale + soft-cap from the final-norm output equals the model's logits;
  heads  : the attention write rebuilt from per-head contributions (o_proj input split into heads, times the
           matching column block of W_O, + bias, through any post-norm scale / multiplier) equals the write;
  neur   : the MLP write rebuilt from per-neuron (or per-expert x neuron) contributions equals the write;
  attn== / mlp== : whether nnterp's ``attentions_output[i]`` / ``mlps_output[i]`` (the output of the module
           nnterp renames ``self_attn`` / ``mlp``, first element if a tuple) equals the write ("Y"), or not ("n").

  naive  : (not a check; information) the error of the naive DLA sum layers[0].input + sum_i nnterp
           attentions_output[i] + mlps_output[i] (OPT: fc2 output) against the final-norm input: large where
           the family needs special handling.

Run:  OMP_NUM_THREADS=2 .venv/bin/python notes/verify_families.py [--plain] [family ...]
      --plain: skip tiny.perturb (shows which wrong formulas a plain init lets pass).
      --heads: head order / GQA grouping: zero the value of kv head g (layer 0) and check that exactly the
               o_proj-input blocks of heads h with h // (H / kv) == g move.
      --nnterp: load each tiny model through nnterp (tiny.load_kwargs) and check that attentions_output[i] /
                mlps_output[i] / layers_input[0] / ln_final.input / logits are the modules and tensors the survey says.
Prints one line per family; every error should be <= 1e-5 (typically ~1e-7).
"""

from __future__ import annotations

import math
import sys
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
warnings.filterwarnings("ignore")

from dla_recipes.testing import tiny  # noqa: E402

TOL = 1e-5


# ----------------------------------------------------------------------------------------------------------------
# capture
# ----------------------------------------------------------------------------------------------------------------


def _clone(x):
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    if isinstance(x, (tuple, list)):
        return type(x)(_clone(v) for v in x)
    if isinstance(x, dict):
        return {k: _clone(v) for k, v in x.items()}
    return x


class Capture:
    """Every module's calls: ``calls[name] = [(args, kwargs, output), ...]``, tensors cloned at hook time."""

    def __init__(self, model):
        self.model = model
        self.calls: dict[str, list] = {}
        self.raw_out: dict[str, list] = {}  # outputs *not* cloned (to show in-place mutation)
        self.handles = []
        for name, mod in model.named_modules():
            self.handles.append(mod.register_forward_hook(self._hook(name), with_kwargs=True))

    def _hook(self, name):
        def hook(mod, args, kwargs, output):
            self.calls.setdefault(name, []).append((_clone(args), _clone(kwargs), _clone(output)))
            self.raw_out.setdefault(name, []).append(output)

        return hook

    def remove(self):
        for h in self.handles:
            h.remove()

    def out(self, name, call=0, index=0):
        o = self.calls[name][call][2]
        return o[index] if isinstance(o, (tuple, list)) else o

    def out_full(self, name, call=0):
        return self.calls[name][call][2]

    def inp(self, name, call=0, key="hidden_states", pos=0):
        args, kwargs, _ = self.calls[name][call]
        if len(args) > pos:
            return args[pos]
        if key in kwargs:
            return kwargs[key]
        return next(v for v in kwargs.values() if isinstance(v, torch.Tensor))

    def kw(self, name, key, call=0):
        return self.calls[name][call][1][key]

    def module(self, name):
        return self.model.get_submodule(name)


def err(a, b) -> float:
    a, b = torch.broadcast_tensors(a.float(), b.float())
    return float((a - b).abs().max())


# ----------------------------------------------------------------------------------------------------------------
# the stream as a sum of terms
# ----------------------------------------------------------------------------------------------------------------


class Stream:
    """The residual stream as named terms; a stream operation is applied to every term (it is linear per position)."""

    def __init__(self, embed):
        self.terms = {"embed": embed}

    def add(self, name, t):
        self.terms[name] = t

    def map(self, fn):
        self.terms = {k: fn(v) for k, v in self.terms.items()}

    def total(self):
        shape = torch.broadcast_shapes(*(t.shape for t in self.terms.values()))
        out = torch.zeros(shape, dtype=torch.float32)
        for t in self.terms.values():
            out = out + t.float()
        return out


# ----------------------------------------------------------------------------------------------------------------
# norm formulas
# ----------------------------------------------------------------------------------------------------------------


def rms(x, eps):
    return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)


def norm_formula(mod, x):
    """Recompute a norm module from its *kind* (the survey's claim), not by calling it."""
    kind = type(mod).__name__
    if isinstance(mod, torch.nn.LayerNorm):
        return F.layer_norm(x, mod.normalized_shape, mod.weight, mod.bias, mod.eps), "LayerNorm(w,b)"
    if kind == "OlmoLayerNorm":
        return F.layer_norm(x, mod.normalized_shape, None, None, 1e-5), "LayerNorm(no params)"
    if kind == "CohereLayerNorm":
        mu = x.mean(-1, keepdim=True)
        var = (x - mu).pow(2).mean(-1, keepdim=True)
        return mod.weight * (x - mu) * torch.rsqrt(var + mod.variance_epsilon), "LayerNorm(w only, no bias)"
    eps = getattr(mod, "variance_epsilon", getattr(mod, "eps", None))
    if kind in ("GemmaRMSNorm", "Gemma2RMSNorm", "Gemma3RMSNorm", "RecurrentGemmaRMSNorm"):
        return rms(x, eps) * (1.0 + mod.weight), "RMSNorm(1+w)"
    return rms(x, eps) * mod.weight, "RMSNorm(w)"


def norm_scale(mod, x):
    """The per-position linear map of a norm at input x: norm(x) = scale * x (+ shift); returns (scale, shift)."""
    y, _ = norm_formula(mod, x)
    kind = type(mod).__name__
    if isinstance(mod, torch.nn.LayerNorm) or kind in ("OlmoLayerNorm", "CohereLayerNorm"):
        raise NotImplementedError  # centring: not needed for the post-norm families
    w = (1.0 + mod.weight) if kind in ("GemmaRMSNorm", "Gemma2RMSNorm", "Gemma3RMSNorm") else getattr(
        mod, "weight", None
    )
    eps = getattr(mod, "variance_epsilon", getattr(mod, "eps", None))
    s = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    return (s * w) if w is not None else s


# ----------------------------------------------------------------------------------------------------------------
# per-head / per-neuron helpers
# ----------------------------------------------------------------------------------------------------------------


def heads_linear(cap, proj_name, n_heads, conv1d=False):
    """Per-head contributions of a Linear / Conv1D output projection: [b, s, H, d_model] and the bias."""
    proj = cap.module(proj_name)
    x = cap.inp(proj_name)  # [b, s, H*hd]
    b, s, hd_total = x.shape
    hd = hd_total // n_heads
    xh = x.view(b, s, n_heads, hd)
    W = proj.weight.t() if conv1d else proj.weight  # -> [d_model, H*hd]
    Wh = W.view(W.shape[0], n_heads, hd)  # [d, H, hd]
    per_head = torch.einsum("bshk,dhk->bshd", xh, Wh)
    bias = proj.bias if proj.bias is not None else torch.zeros(W.shape[0])
    return per_head, bias


def neurons_linear(cap, proj_name, conv1d=False, flat_shape=None):
    """Per-neuron contributions of a down projection: act[..., n] * W[:, n], summed here (exact) + bias."""
    proj = cap.module(proj_name)
    act = cap.inp(proj_name)  # [..., d_mlp]
    W = proj.weight.t() if conv1d else proj.weight  # [d_model, d_mlp]
    contrib = act.unsqueeze(-1) * W.t()  # [..., d_mlp, d_model]
    out = contrib.sum(-2)
    if proj.bias is not None:
        out = out + proj.bias
    if flat_shape is not None:
        out = out.view(flat_shape)
    return out


def fused_experts(cap, name, apply_gate=None):
    """Per-(token, expert) contributions of a transformers-5 fused-experts module (gate_up_proj [E, 2I, d],
    down_proj [E, d, I]), from its inputs (hidden [T, d], top_k_index [T, k], top_k_weights [T, k]).
    Returns the summed output [T, d] and the neuron activations [T, k, I]."""
    mod = cap.module(name)
    args, kwargs, _ = cap.calls[name][0]
    allargs = list(args) + [kwargs[k] for k in ("hidden_states", "top_k_index", "top_k_weights") if k in kwargs]
    h, idx, w = allargs[:3]
    T, k = idx.shape
    out = torch.zeros_like(h)
    acts = []
    for j in range(k):
        e = idx[:, j]
        gu = torch.einsum("td,tfd->tf", h, mod.gate_up_proj[e])
        if apply_gate is not None:
            a = apply_gate(gu)
        else:
            g, u = gu.chunk(2, dim=-1)
            a = mod.act_fn(g) * u
        acts.append(a)
        y = torch.einsum("tf,tdf->td", a, mod.down_proj[e])
        out = out + y * w[:, j, None]
    return out, torch.stack(acts, 1)


# ----------------------------------------------------------------------------------------------------------------
# family recipes: each returns a dict of results; `ctx` gives the capture, model, config
# ----------------------------------------------------------------------------------------------------------------


class Ctx:
    def __init__(self, family, model, cap, ids, mask, logits):
        self.family, self.model, self.cap, self.ids, self.mask, self.logits = family, model, cap, ids, mask, logits
        self.cfg = model.config
        self.layer_errs = []
        self.head_errs = []
        self.neuron_errs = []
        self.attn_eq = []
        self.mlp_eq = []
        self.notes = []
        self.naive_attn = []  # module nnterp calls layers[i].self_attn / .mlp (None: nnterp has none)
        self.naive_mlp = []

    def layer_check(self, stream, layer_name, index=0):
        self.layer_errs.append(err(stream.total(), self.cap.out(layer_name, index=index)))

    def eq(self, lst, module_name, write):
        (self.naive_attn if lst is self.attn_eq else self.naive_mlp).append(module_name)
        if module_name is None:
            lst.append(None)
            return
        try:
            o = self.cap.out(module_name)
            lst.append(o.shape == write.shape and err(o, write) <= TOL)
        except KeyError:
            lst.append(None)


def _prenorm(ctx, root, layers, attn="self_attn", mlp="mlp", attn_proj="o_proj", mlp_proj="down_proj",
             post_attn=None, post_mlp=None, mult=1.0, n_heads=None, parallel=False, conv1d=False,
             mlp_flat=False, attn_tuple_index=0, neurons=True):
    """Generic: x += mult * post(attn(.)); x += mult * post(mlp(.)).  Returns the Stream."""
    cap, cfg = ctx.cap, ctx.cfg
    n = len(ctx.model.get_submodule(layers))
    s = Stream(cap.inp(f"{layers}.0"))
    H = n_heads or cfg.num_attention_heads
    for i in range(n):
        L = f"{layers}.{i}"
        a = cap.out(f"{L}.{attn}", index=attn_tuple_index)
        if post_attn:
            a = cap.out(f"{L}.{post_attn}")
        wa = mult * a
        # heads: o_proj input split into heads, through the post-norm's per-position scale
        if attn_proj is not None:
            ph, bias = heads_linear(cap, f"{L}.{attn}.{attn_proj}", H, conv1d=conv1d)
            raw = ph.sum(2) + bias
            if post_attn:
                raw = norm_scale(cap.module(f"{L}.{post_attn}"), cap.inp(f"{L}.{post_attn}")) * raw
            ctx.head_errs.append(err(mult * raw, wa))
        ctx.eq(ctx.attn_eq, f"{L}.{attn}", wa)
        m = cap.out(f"{L}.{mlp}") if mlp else None
        if mlp_flat:
            m = m.view(a.shape)
        if post_mlp:
            m = cap.out(f"{L}.{post_mlp}")
        wm = mult * m
        if neurons and mlp_proj is not None:
            raw = neurons_linear(cap, f"{L}.{mlp}.{mlp_proj}" if mlp else f"{L}.{mlp_proj}", conv1d=conv1d)
            raw = raw.view(a.shape)
            if post_mlp:
                raw = norm_scale(cap.module(f"{L}.{post_mlp}"), cap.inp(f"{L}.{post_mlp}")) * raw
            ctx.neuron_errs.append(err(mult * raw, wm))
        ctx.eq(ctx.mlp_eq, f"{L}.{mlp}" if mlp else None, wm)
        s.add(f"L{i}.attn", wa)
        s.add(f"L{i}.mlp", wm)
        ctx.layer_check(s, L)
    return s


def std(**kw):
    def recipe(ctx):
        return _prenorm(ctx, "model", "model.layers", **kw)

    return recipe


def r_gpt2(ctx):
    cap = ctx.cap
    ctx.embed = cap.out("transformer.wte") + cap.out("transformer.wpe")
    return _prenorm(ctx, "transformer", "transformer.h", attn="attn", attn_proj="c_proj", mlp_proj="c_proj",
                    n_heads=ctx.cfg.n_head, conv1d=True)


def r_gptj(ctx):
    return _prenorm(ctx, "transformer", "transformer.h", attn="attn", attn_proj="out_proj", mlp_proj="fc_out",
                    n_heads=ctx.cfg.n_head)


def r_neox(ctx):
    return _prenorm(ctx, "gpt_neox", "gpt_neox.layers", attn="attention", attn_proj="dense",
                    mlp_proj="dense_4h_to_h")


def r_falcon(ctx):
    cap = ctx.cap
    s = _prenorm(ctx, "transformer", "transformer.h", attn="self_attention", attn_proj="dense",
                 mlp_proj="dense_4h_to_h")
    # in-place pitfall: the *uncloned* MLP output object now holds mlp + attn
    raw = cap.raw_out["transformer.h.0.mlp"][0]
    ctx.notes.append(
        "uncloned mlp.output after forward == mlp+attn: "
        f"{err(raw, cap.out('transformer.h.0.mlp') + cap.out('transformer.h.0.self_attention')) <= TOL}"
    )
    return s


def r_bloom(ctx):
    cap, cfg = ctx.cap, ctx.cfg
    ctx.embed = cap.out("transformer.word_embeddings_layernorm")
    n = cfg.n_layer
    s = Stream(cap.inp("transformer.h.0"))
    for i in range(n):
        L = f"transformer.h.{i}"
        a = cap.out(f"{L}.self_attention.dense")
        m = cap.out(f"{L}.mlp.dense_4h_to_h")
        ph, bias = heads_linear(cap, f"{L}.self_attention.dense", cfg.n_head)
        ctx.head_errs.append(err(ph.sum(2) + bias, a))
        ctx.neuron_errs.append(err(neurons_linear(cap, f"{L}.mlp.dense_4h_to_h"), m))
        ctx.eq(ctx.attn_eq, f"{L}.self_attention", a)
        ctx.eq(ctx.mlp_eq, f"{L}.mlp", m)
        s.add(f"L{i}.attn", a)
        s.add(f"L{i}.mlp", m)
        ctx.layer_check(s, L)
    return s


def r_opt(ctx):
    cap = ctx.cap
    # OPT positions come from attention_mask.cumsum (left padding: first real token gets position 0), offset 2
    ctx.embed = cap.out("model.decoder.embed_tokens") + cap.out("model.decoder.embed_positions")
    return _opt(ctx)


def _opt(ctx):
    cap, cfg = ctx.cap, ctx.cfg
    s = Stream(cap.inp("model.decoder.layers.0"))
    for i in range(cfg.num_hidden_layers):
        L = f"model.decoder.layers.{i}"
        a = cap.out(f"{L}.self_attn")
        m = cap.out(f"{L}.fc2").view(a.shape)  # fc2 runs on [b*s, ffn]: reshape
        ph, bias = heads_linear(cap, f"{L}.self_attn.out_proj", cfg.num_attention_heads)
        ctx.head_errs.append(err(ph.sum(2) + bias, a))
        ctx.neuron_errs.append(err(neurons_linear(cap, f"{L}.fc2").view(a.shape), m))
        ctx.eq(ctx.attn_eq, f"{L}.self_attn", a)
        ctx.eq(ctx.mlp_eq, None, m)
        ctx.naive_mlp[-1] = f"{L}.fc2"  # nnterp: "use layers.fc1 and layers.fc2 instead"
        s.add(f"L{i}.attn", a)
        s.add(f"L{i}.mlp", m)
        ctx.layer_check(s, L)
    return s


def r_phi(ctx):
    return _prenorm(ctx, "model", "model.layers", attn_proj="dense", mlp_proj="fc2")


def r_granite(ctx):
    ctx.embed = ctx.cap.out("model.embed_tokens") * ctx.cfg.embedding_multiplier
    return _prenorm(ctx, "model", "model.layers", mult=ctx.cfg.residual_multiplier)


def r_recurrent_gemma(ctx):
    cap, cfg, model = ctx.cap, ctx.cfg, ctx.model
    ctx.embed = cap.out("model.embed_tokens") * model.model.normalizer.to(torch.float32)
    s = Stream(cap.inp("model.layers.0"))
    for i in range(cfg.num_hidden_layers):
        L = f"model.layers.{i}"
        a = cap.out(f"{L}.temporal_block")
        m = cap.out(f"{L}.mlp_block")
        tb = cap.module(f"{L}.temporal_block")
        if type(tb).__name__ == "RecurrentGemmaAttention":
            ph, bias = heads_linear(cap, f"{L}.temporal_block.o_proj", cfg.num_attention_heads)
            ctx.head_errs.append(err(ph.sum(2) + bias, a))
        else:  # RG-LRU block: linear_out(x_branch * y_branch), 'neurons' of width lru_width
            ctx.head_errs.append(err(neurons_linear(cap, f"{L}.temporal_block.linear_out"), a))
        ctx.neuron_errs.append(err(neurons_linear(cap, f"{L}.mlp_block.down_proj"), m))
        ctx.eq(ctx.attn_eq, f"{L}.temporal_block", a)
        ctx.eq(ctx.mlp_eq, f"{L}.mlp_block", m)
        s.add(f"L{i}.attn", a)
        s.add(f"L{i}.mlp", m)
        ctx.layer_check(s, L)
    return s


def _moe_split(ctx, L, kind):
    """MoE: rebuild the mlp output from per-expert contributions computed from the weights."""
    cap = ctx.cap
    m = cap.out(f"{L}.mlp")
    shape = m.shape
    if kind == "mixtral" or kind == "olmoe":
        routed, _ = fused_experts(cap, f"{L}.mlp.experts")
        rebuilt = routed.view(shape)
    elif kind == "qwen2_moe":
        routed, _ = fused_experts(cap, f"{L}.mlp.experts")
        x = cap.inp(f"{L}.mlp.shared_expert")
        g = torch.sigmoid(cap.out(f"{L}.mlp.shared_expert_gate"))
        shared = neurons_linear(cap, f"{L}.mlp.shared_expert.down_proj")
        rebuilt = (routed + g * shared).view(shape)
    elif kind == "deepseek_v3":
        if f"{L}.mlp.experts" not in cap.calls:  # dense layer (first_k_dense_replace)
            return err(neurons_linear(cap, f"{L}.mlp.down_proj"), m)
        routed, _ = fused_experts(cap, f"{L}.mlp.experts")
        shared = neurons_linear(cap, f"{L}.mlp.shared_experts.down_proj")
        rebuilt = routed.view(shape) + shared
    else:
        raise KeyError(kind)
    return err(rebuilt, m)


def moe(kind):
    def recipe(ctx):
        s = _prenorm(ctx, "model", "model.layers", neurons=False)
        for i in range(ctx.cfg.num_hidden_layers):
            ctx.neuron_errs.append(_moe_split(ctx, f"model.layers.{i}", kind))
        return s

    return recipe


def r_deepseek_v3(ctx):
    s = _prenorm(ctx, "model", "model.layers", neurons=False)  # o_proj input is [b, s, H * v_head_dim]
    for i in range(ctx.cfg.num_hidden_layers):
        ctx.neuron_errs.append(_moe_split(ctx, f"model.layers.{i}", "deepseek_v3"))
    return s


def r_gemma_like(ctx):
    return _prenorm(ctx, "model", "model.layers", post_attn="post_attention_layernorm",
                    post_mlp="post_feedforward_layernorm")


def r_glm4(ctx):
    return _prenorm(ctx, "model", "model.layers", post_attn="post_self_attn_layernorm", post_mlp="post_mlp_layernorm",
                    mlp_proj="down_proj")


def r_doge(ctx):
    cap, cfg = ctx.cap, ctx.cfg
    s = Stream(cap.inp("model.layers.0"))
    for i in range(cfg.num_hidden_layers):
        L = f"model.layers.{i}"
        layer = cap.module(L)
        a = cap.out(f"{L}.self_attn")
        ph, bias = heads_linear(cap, f"{L}.self_attn.o_proj", cfg.num_attention_heads)
        ctx.head_errs.append(err(ph.sum(2) + bias, a))
        ctx.eq(ctx.attn_eq, f"{L}.self_attn", a)
        s.map(lambda t, g=layer.input_residual: g * t)  # mid = input_residual * x + attn
        s.add(f"L{i}.attn", a)
        m = cap.out(f"{L}.mlp")
        ctx.neuron_errs.append(err(neurons_linear(cap, f"{L}.mlp.down_proj"), m))
        ctx.eq(ctx.mlp_eq, f"{L}.mlp", m)
        s.map(lambda t, g=layer.post_attention_residual: g * t)  # out = post_attention_residual * mid + mlp
        s.add(f"L{i}.mlp", m)
        ctx.layer_check(s, L)
    return s


def r_zaya(ctx):
    cap, cfg, model = ctx.cap, ctx.cfg, ctx.model
    mm = model.model
    ctx.embed = (cap.out("model.embed_tokens") + mm.input_hidden_states_bias) * mm.input_hidden_states_scale
    s = Stream(cap.inp("model.layers.0"))
    for i in range(cfg.num_hidden_layers):
        L = f"model.layers.{i}"
        pa = cap.module(f"{L}.post_attention_residual_scale")
        pm = cap.module(f"{L}.post_mlp_residual_scale")
        a = cap.out(f"{L}.self_attn")
        ph, bias = heads_linear(cap, f"{L}.self_attn.o_proj", cfg.num_attention_heads)
        ctx.head_errs.append(err(ph.sum(2) + bias, a))
        ctx.eq(ctx.attn_eq, f"{L}.self_attn", pa.hidden_states_scale * a)
        # r1 = (attn + hb) * hs + (x + rb) * rs
        s.map(lambda t, g=pa.residual_scale: g * t)
        s.add(f"L{i}.attn", pa.hidden_states_scale * a)
        s.add(f"L{i}.attn_const", pa.hidden_states_bias * pa.hidden_states_scale + pa.residual_bias * pa.residual_scale)
        m = cap.out(f"{L}.mlp")
        routed, _ = fused_experts(cap, f"{L}.mlp.experts")
        ctx.neuron_errs.append(err(routed.view(m.shape), m))
        ctx.eq(ctx.mlp_eq, f"{L}.mlp", pm.hidden_states_scale * m)
        s.map(lambda t, g=pm.residual_scale: g * t)
        s.add(f"L{i}.mlp", pm.hidden_states_scale * m)
        s.add(f"L{i}.mlp_const", pm.hidden_states_bias * pm.hidden_states_scale + pm.residual_bias * pm.residual_scale)
        ctx.layer_check(s, L)
    return s


def r_gemma4(ctx):
    cap, cfg, model = ctx.cap, ctx.cfg, ctx.model
    s = Stream(cap.inp("model.layers.0"))
    for i in range(cfg.num_hidden_layers):
        L = f"model.layers.{i}"
        layer = cap.module(L)
        a = cap.out(f"{L}.post_attention_layernorm")
        H = cfg.num_attention_heads
        ph, bias = heads_linear(cap, f"{L}.self_attn.o_proj", H)  # head_dim differs on full-attention layers
        pn = cap.module(f"{L}.post_attention_layernorm")
        ctx.head_errs.append(err(norm_scale(pn, cap.inp(f"{L}.post_attention_layernorm")) * (ph.sum(2) + bias), a))
        ctx.eq(ctx.attn_eq, f"{L}.self_attn", a)
        s.add(f"L{i}.attn", a)
        m = cap.out(f"{L}.post_feedforward_layernorm")
        ctx.eq(ctx.mlp_eq, f"{L}.mlp", m)
        pf = cap.module(f"{L}.post_feedforward_layernorm")
        scale = norm_scale(pf, cap.inp(f"{L}.post_feedforward_layernorm"))
        dense = neurons_linear(cap, f"{L}.mlp.down_proj")
        if layer.enable_moe_block:
            # h = pfl1(mlp) + pfl2(experts(pfl2_in(x))) ; write = pfl(h): exact split with pfl's scale
            h1 = norm_scale(cap.module(f"{L}.post_feedforward_layernorm_1"),
                            cap.inp(f"{L}.post_feedforward_layernorm_1")) * dense
            routed, _ = fused_experts(cap, f"{L}.experts")
            routed = routed.view(m.shape)
            h2 = norm_scale(cap.module(f"{L}.post_feedforward_layernorm_2"),
                            cap.inp(f"{L}.post_feedforward_layernorm_2")) * routed
            ctx.neuron_errs.append(err(scale * h1 + scale * h2, m))
            s.add(f"L{i}.mlp", scale * h1)
            s.add(f"L{i}.experts", scale * h2)
        else:
            ctx.neuron_errs.append(err(scale * dense, m))
            s.add(f"L{i}.mlp", m)
        if layer.hidden_size_per_layer_input:
            s.add(f"L{i}.per_layer_input", cap.out(f"{L}.post_per_layer_input_norm"))
        s.map(lambda t, g=layer.layer_scalar: g * t)  # hidden_states *= layer_scalar (whole stream)
        ctx.layer_check(s, L)
    return s


def r_jetmoe(ctx):
    cap, cfg = ctx.cap, ctx.cfg
    s = Stream(cap.inp("model.layers.0"))
    k = cfg.num_experts_per_tok
    for i in range(cfg.num_hidden_layers):
        L = f"model.layers.{i}"
        a = cap.out(f"{L}.self_attention")
        # mixture of attention: reduce() gets attn [b, s, k, kv_heads*hd]; head (slot j, h) writes with
        # output_linear.weight[expert(t, j)][:, h*hd:(h+1)*hd] * gate(t, j); + experts.bias once
        moa = cap.module(f"{L}.self_attention.experts")
        rt_logits = cap.out(f"{L}.self_attention.experts.router.layer").float()  # [T, E]
        topv, topi = rt_logits.topk(k, dim=1)
        gates = torch.softmax(topv, dim=1)
        x = cap.inp(f"{L}.self_attention.experts.output_linear")  # grouped by expert; rebuild from attn instead
        attn_heads = _jetmoe_attn_heads(cap, L, cfg)  # [b, s, k, kv*hd]
        b_, s_ = a.shape[:2]
        ah = attn_heads.reshape(b_ * s_, k, -1)
        W = moa.output_linear.weight[topi]  # [T, k, d, kv*hd]
        per_slot = torch.einsum("tjf,tjdf->tjd", ah, W) * gates[..., None]
        valid = ctx.mask.bool()  # padded query rows see no key at all: their softmax is undefined, skip them
        ctx.head_errs.append(err((per_slot.sum(1).view(a.shape) + moa.bias)[valid], a[valid]))
        ctx.eq(ctx.attn_eq, f"{L}.self_attention", a)
        m = cap.out(f"{L}.mlp")
        ctx.neuron_errs.append(err(_jetmoe_mlp(cap, f"{L}.mlp", cfg).view(m.shape), m))
        ctx.eq(ctx.mlp_eq, f"{L}.mlp", m)
        s.add(f"L{i}.attn", a)
        s.add(f"L{i}.mlp", m)
        ctx.layer_check(s, L)
    return s


def _jetmoe_attn_heads(cap, L, cfg):
    """Recompute the attention-probability-weighted values (the input of MoA.reduce) with eager attention."""
    att = cap.module(f"{L}.self_attention")
    x = cap.inp(f"{L}.self_attention")
    b, s, _ = x.shape
    k, hd, kvh = cfg.num_experts_per_tok, cfg.kv_channels, cfg.num_key_value_heads
    q, _, topo = att.experts.map(x)
    kv = att.kv_proj(x)
    kst, vst = kv.chunk(2, dim=-1)
    q = q.view(b, s, -1, hd).transpose(1, 2)
    kst = kst.view(b, s, -1, hd).transpose(1, 2)
    vst = vst.view(b, s, -1, hd).transpose(1, 2)
    cos, sin = cap.kw(f"{L}.self_attention", "position_embeddings")
    from transformers.models.jetmoe.modeling_jetmoe import apply_rotary_pos_emb

    q, kst = apply_rotary_pos_emb(q, kst, cos, sin)
    kst = kst.repeat(1, k, 1, 1)
    vst = vst.repeat(1, k, 1, 1)
    mask = cap.kw(f"{L}.self_attention", "attention_mask")
    scores = q @ kst.transpose(-1, -2) * hd**-0.5
    if mask is not None:
        if mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask, float("-inf"))
        else:
            scores = scores + mask
    else:
        causal = torch.ones(s, s, dtype=torch.bool).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
    p = torch.softmax(scores.float(), -1)
    o = (p @ vst).transpose(1, 2)  # [b, s, k*kvh, hd]
    return o.reshape(b, s, k, kvh * hd)


def _jetmoe_mlp(cap, name, cfg):
    mod = cap.module(name)
    x = cap.inp(name)
    b, s, d = x.shape
    xf = x.reshape(-1, d)
    logits = mod.router.layer(xf).float()
    topv, topi = logits.topk(cfg.num_experts_per_tok, dim=1)
    gates = torch.softmax(topv, dim=1)
    out = torch.zeros_like(xf)
    for j in range(topi.shape[1]):
        Win = mod.input_linear.weight[topi[:, j]]  # [T, 2I, d]
        h = torch.einsum("td,tfd->tf", xf, Win)
        g, u = h.chunk(2, dim=-1)
        a = mod.activation(g) * u
        Wout = mod.output_linear.weight[topi[:, j]]  # [T, d, I]
        out = out + torch.einsum("tf,tdf->td", a, Wout) * gates[:, j, None]
    return out + mod.bias


def r_zamba2(ctx):
    cap, cfg = ctx.cap, ctx.cfg
    s = Stream(cap.inp("model.layers.0"))
    for i, kind in enumerate(cfg.layers_block_type):
        L = f"model.layers.{i}"
        mixer = f"{L}.mamba" if kind != "hybrid" else f"{L}.mamba_decoder.mamba"
        w = cap.out(mixer)
        ctx.head_errs.append(err(neurons_linear(cap, f"{mixer}.out_proj"), w))
        ctx.eq(ctx.attn_eq, mixer, w)  # nnterp self_attn := the Mamba mixer (load_kwargs rename)
        ctx.mlp_eq.append(None)
        s.add(f"L{i}.mamba", w)
        ctx.layer_check(s, L)
    return s


def _hc_pre(hc_mod, x):
    """DeepseekV4HyperHead's collapse weights (recomputed from its input)."""
    flat = x.flatten(2).float()
    flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + hc_mod.input_norm.eps)
    mixes = F.linear(flat, hc_mod.hc_fn.float())
    return torch.sigmoid(mixes * hc_mod.hc_scale.float() + hc_mod.hc_base.float()) + hc_mod.eps  # [b, s, hc]


def r_deepseek_v4(ctx):
    cap, cfg = ctx.cap, ctx.cfg
    hc = cfg.hc_mult
    e = cap.out("model.embed_tokens")
    ctx.embed = e.unsqueeze(2).expand(-1, -1, hc, -1)  # every stream starts as the embedding
    s = Stream(cap.inp("model.layers.0"))  # [b, s, hc, d]
    for i in range(cfg.num_hidden_layers):
        L = f"model.layers.{i}"
        post, comb, _ = cap.out_full(f"{L}.attn_hc")
        a = cap.out(f"{L}.self_attn")
        # heads: o_a_proj is block-diagonal over o_groups groups of heads, then o_b_proj mixes
        att = cap.module(f"{L}.self_attn")
        xg = cap.inp(f"{L}.self_attn.o_a_proj")  # [b, s, G, H/G*hd]
        G, H, hd = cfg.o_groups, cfg.num_attention_heads, cfg.head_dim
        Wa = att.o_a_proj.weight.view(G, -1, xg.shape[-1])  # [G, r, H/G*hd]
        Wb = att.o_b_proj.weight.view(cfg.hidden_size, G, -1)  # [d, G, r]
        xh = xg.view(*xg.shape[:2], G, H // G, hd)
        Wah = Wa.view(G, Wa.shape[1], H // G, hd)
        per_head = torch.einsum("bsghk,grhk,dgr->bsghd", xh, Wah, Wb)  # exact: W_O(head) = Wb[:, g] @ Wa[g][:, h]
        ctx.head_errs.append(err(per_head.sum((2, 3)), a))
        ctx.eq(ctx.attn_eq, f"{L}.self_attn", a)
        # X' = post (x) attn + comb^T X   (comb [b, s, hc_in, hc_out], consumed transposed)
        s.map(lambda t, c=comb: torch.matmul(c.transpose(-1, -2), t))
        s.add(f"L{i}.attn", post.unsqueeze(-1) * a.unsqueeze(-2))
        post, comb, _ = cap.out_full(f"{L}.ffn_hc")
        m = cap.out(f"{L}.mlp")
        mods = cap.module(f"{L}.mlp")
        lim = cfg.swiglu_limit

        def gate_fn(gu, act=mods.experts.act_fn):
            g, u = gu.chunk(2, dim=-1)
            return act(g.clamp(max=lim)) * u.clamp(min=-lim, max=lim)

        routed, _ = fused_experts(cap, f"{L}.mlp.experts", apply_gate=gate_fn)
        shared = neurons_linear(cap, f"{L}.mlp.shared_experts.down_proj")
        ctx.neuron_errs.append(err(routed.view(m.shape) + shared, m))
        ctx.eq(ctx.mlp_eq, f"{L}.mlp", m)
        s.map(lambda t, c=comb: torch.matmul(c.transpose(-1, -2), t))
        s.add(f"L{i}.mlp", post.unsqueeze(-1) * m.unsqueeze(-2))
        ctx.layer_check(s, L)
    # final collapse: norm input = sum_k pre_k X_k  (pre from hc_head's input)
    pre = _hc_pre(cap.module("model.hc_head"), cap.inp("model.hc_head"))
    s.map(lambda t: (pre.unsqueeze(-1) * t).sum(2))
    return s


# ----------------------------------------------------------------------------------------------------------------
# family table: recipe, final norm, lm_head, logits post-processing
# ----------------------------------------------------------------------------------------------------------------


def softcap(c):
    return lambda x: c * torch.tanh(x / c)


FAMILY = {
    "gpt2": (r_gpt2, "transformer.ln_f"),
    "llama": (std(), "model.norm"),
    "mistral": (std(), "model.norm"),
    "qwen2": (std(), "model.norm"),
    "qwen3": (std(), "model.norm"),
    "gemma": (std(), "model.norm"),
    "olmo": (std(), "model.norm"),
    "phi3": (std(), "model.norm"),
    "smollm3": (std(), "model.norm"),
    "apertus": (std(), "model.norm"),
    "gptj": (r_gptj, "transformer.ln_f"),
    "gpt_neox": (r_neox, "gpt_neox.final_layer_norm"),
    "gpt_neox_sequential": (r_neox, "gpt_neox.final_layer_norm"),
    "mixtral": (moe("mixtral"), "model.norm"),
    "qwen2_moe": (moe("qwen2_moe"), "model.norm"),
    "olmoe": (moe("olmoe"), "model.norm"),
    "deepseek_v3": (r_deepseek_v3, "model.norm"),
    "gemma2": (r_gemma_like, "model.norm"),
    "gemma3": (r_gemma_like, "model.norm"),
    "glm4": (r_glm4, "model.norm"),
    "olmo2": (r_gemma_like, "model.norm"),
    "olmo3": (r_gemma_like, "model.norm"),
    "exaone4": (r_gemma_like, "model.norm"),
    "granite": (r_granite, "model.norm"),
    "cohere": (std(), "model.norm"),
    "recurrent_gemma": (r_recurrent_gemma, "model.final_norm"),
    "falcon": (r_falcon, "transformer.ln_f"),
    "falcon_new_arch": (r_falcon, "transformer.ln_f"),
    "bloom": (r_bloom, "transformer.ln_f"),
    "opt": (r_opt, "model.decoder.final_layer_norm"),
    "phi": (r_phi, "model.final_layernorm"),
    "gemma4": (r_gemma4, "model.norm"),
    "gemma4_moe": (r_gemma4, "model.norm"),
    "doge": (r_doge, "model.norm"),
    "zaya": (r_zaya, "model.norm"),
    "deepseek_v4": (r_deepseek_v4, "model.norm"),
    "zamba2": (r_zamba2, "model.final_layernorm"),
    "jetmoe": (r_jetmoe, "model.norm"),
}


def logits_post(family, cfg):
    if family == "granite":
        return lambda x: x / cfg.logits_scaling, f"divide by logits_scaling ({cfg.logits_scaling})"
    if family == "cohere":
        return lambda x: x * cfg.logit_scale, f"* logit_scale ({cfg.logit_scale})"
    if family == "recurrent_gemma":
        return softcap(cfg.logits_soft_cap), f"softcap {cfg.logits_soft_cap}"
    cap_ = getattr(cfg, "final_logit_softcapping", None)
    if cap_ is not None:
        return softcap(cap_), f"softcap {cap_}"
    return (lambda x: x), "none"


def default_embed(ctx, family):
    """The embedding term for the families without a special one: embed_tokens output (scale inside for Gemma)."""
    for name in ("model.embed_tokens", "transformer.wte", "gpt_neox.embed_in", "transformer.word_embeddings"):
        if name in ctx.cap.calls:
            return ctx.cap.out(name)
    raise KeyError("embed_tokens")


def nnsight_positions(mask):
    """nnsight 0.8 ``modeling.processing.positions``: a left-padded row counts from its first real token."""
    mask = mask.long()
    counted = (mask.cumsum(-1) - 1).clamp(min=0)
    plain = torch.arange(mask.shape[-1]).expand_as(mask)
    left_padded = (mask.diff(dim=-1) >= 0).all(-1, keepdim=True)
    return torch.where(left_padded, counted, plain)


def _layer0(cap):
    for name in ("model.layers.0", "transformer.h.0", "gpt_neox.layers.0", "model.decoder.layers.0"):
        if name in cap.calls:
            return name
    raise KeyError("layer 0")


def run(family, seed=0, perturbed=True):
    torch.manual_seed(1234)
    model = tiny.build(family, seed, perturbed=perturbed)
    tok = tiny.tokenizer(model.config.vocab_size)
    batch = tok(["w3 w17 w5 w99 w42 w8 w23 w61 w7", "w10 w11 w12 w13"], return_tensors="pt", padding=True)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    # what nnsight's LanguageModel feeds a left-padded batch: position_ids counted from each row's first token
    pos = nnsight_positions(mask)
    cap = Capture(model)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, position_ids=pos)
    cap.remove()
    ctx = Ctx(family, model, cap, ids, mask, out.logits)
    recipe, final_norm = FAMILY[family]
    with torch.no_grad():
        stream = recipe(ctx)
        embed = getattr(ctx, "embed", None)
        if embed is None:
            embed = default_embed(ctx, family)
        embed_err = err(embed, cap.inp(_layer0(cap)))
        x_final = cap.inp(final_norm)
        stream_err = err(stream.total(), x_final)
        # naive DLA: layers[0].input + sum of nnterp attentions_output[i] + mlps_output[i]
        base = cap.inp(_layer0(cap))
        if base.dim() == 4:
            base = default_embed(ctx, family)
        naive = base.clone().float()
        for name in ctx.naive_attn + ctx.naive_mlp:
            if name is not None:
                naive = naive + cap.out(name).reshape(naive.shape)
        naive_err = err(naive, x_final)
        nmod = cap.module(final_norm)
        y_formula, norm_kind = norm_formula(nmod, x_final)
        norm_err = err(y_formula, cap.out(final_norm))
        post, post_desc = logits_post(family, model.config)
        head = model.lm_head
        normed = cap.out(final_norm)
        lm = F.linear(normed, head.weight, head.bias)
        logits_err = err(post(lm), out.logits)
    return dict(
        family=family,
        embed=embed_err,
        stream=stream_err,
        layer=max(ctx.layer_errs) if ctx.layer_errs else float("nan"),
        norm=norm_err,
        logits=logits_err,
        heads=max(ctx.head_errs) if ctx.head_errs else float("nan"),
        neur=max(ctx.neuron_errs) if ctx.neuron_errs else float("nan"),
        naive=naive_err,
        n_terms=len(stream.terms),
        norm_kind=norm_kind,
        post=post_desc,
        lm_bias=head.bias is not None,
        attn_eq=_yn(ctx.attn_eq),
        mlp_eq=_yn(ctx.mlp_eq),
        notes="; ".join(ctx.notes),
    )


def nnterp_check(family, seed=0):
    """Load the same tiny model through nnterp and compare its accessors with the plain-hook writes.

    Returns a short string: ``attn=<Y/n per layer> mlp=<...> l0=<layers_input[0] == block-0 input>
    lnf=<ln_final.input == final-norm input> logits=<...> tuple=<layers_output returns a tuple>``.
    """
    import logging

    logging.getLogger("nnterp").setLevel(logging.ERROR)
    logging.getLogger("torch._subclasses.fake_tensor").setLevel(logging.CRITICAL)
    model = tiny.build(family, seed)
    tok = tiny.tokenizer(model.config.vocab_size)
    texts = ["w3 w17 w5 w99 w42 w8 w23 w61 w7", "w10 w11 w12 w13"]
    batch = tok(texts, return_tensors="pt", padding=True)
    batch["position_ids"] = nnsight_positions(batch["attention_mask"])
    cap = Capture(model)
    with torch.no_grad():
        model(**batch)
    cap.remove()
    ctx = Ctx(family, model, cap, batch["input_ids"], batch["attention_mask"], None)
    with torch.no_grad():
        FAMILY[family][0](ctx)  # fills ctx.naive_attn / naive_mlp (module nnterp should map) and the writes
    from nnterp import StandardizedTransformer

    kw = tiny.load_kwargs(family)
    std_model = StandardizedTransformer(model, tokenizer=tok, device_map="cpu", **kw)
    n = std_model.num_layers
    has_mlp = any(m is not None for m in ctx.naive_mlp) and family != "opt"
    atts, mlps = [], []  # created outside the trace: nnsight 0.8 only pushes back saved values
    with std_model.trace(texts):
        l0 = std_model.layers_input[0].clone().save()
        for i in range(n):
            atts.append(std_model.attentions_output[i].clone().save())
            if has_mlp:
                mlps.append(std_model.mlps_output[i].clone().save())
            std_model.layers_output[i]  # noqa: B018  (detects the layer's tuple-ness)
        lnf_in = std_model.ln_final.input.clone().save()
        logits = std_model.logits.save()
    yn = lambda ok: "Y" if ok else "n"  # noqa: E731
    attn_map = "".join(yn(err(a, cap.out(m)) <= TOL) for a, m in zip(atts, ctx.naive_attn))
    mlp_map = "".join(yn(err(a, cap.out(m)) <= TOL) for a, m in zip(mlps, ctx.naive_mlp)) if has_mlp else "-"
    layer0 = _layer0(cap)
    lnf = FAMILY[family][1]
    return (
        f"attentions_output=module:{attn_map} mlps_output=module:{mlp_map} "
        f"layers_input[0]:{yn(err(l0, cap.inp(layer0)) <= TOL)} ln_final.input:{yn(err(lnf_in, cap.inp(lnf)) <= TOL)} "
        f"logits:{yn(err(logits, model(**batch).logits) <= TOL)} "
        f"layer_tuple:{std_model.layers_output.returns_tuple} attn_tuple:{std_model.attentions_output.returns_tuple}"
    )


# ---- head order / GQA grouping: zero the value of kv head g in layer 0, see which o_proj input blocks move ----

def _v_sep(n_kv_attr="num_key_value_heads"):
    return lambda cfg, g, hd: slice(g * hd, (g + 1) * hd)


HEAD_ORDER = {
    # family: (value-producing module of layer 0, o_proj of layer 0, n_heads, n_kv, head_dim, value slice of kv head g)
    "gpt2": ("transformer.h.0.attn.c_attn", "transformer.h.0.attn.c_proj", lambda c: (c.n_head, c.n_head, c.n_embd // c.n_head),
             lambda c, g, hd: slice(2 * c.n_embd + g * hd, 2 * c.n_embd + (g + 1) * hd)),
    "gptj": ("transformer.h.0.attn.v_proj", "transformer.h.0.attn.out_proj", lambda c: (c.n_head, c.n_head, c.n_embd // c.n_head), None),
    "gpt_neox": ("gpt_neox.layers.0.attention.query_key_value", "gpt_neox.layers.0.attention.dense", None,
                 lambda c, g, hd: slice(g * 3 * hd + 2 * hd, (g + 1) * 3 * hd)),
    "gpt_neox_sequential": ("gpt_neox.layers.0.attention.query_key_value", "gpt_neox.layers.0.attention.dense", None,
                            lambda c, g, hd: slice(g * 3 * hd + 2 * hd, (g + 1) * 3 * hd)),
    "falcon": ("transformer.h.0.self_attention.query_key_value", "transformer.h.0.self_attention.dense",
               lambda c: (c.num_attention_heads, 1, c.hidden_size // c.num_attention_heads),
               lambda c, g, hd: slice((c.num_attention_heads + 1) * hd, (c.num_attention_heads + 2) * hd)),
    "falcon_new_arch": ("transformer.h.0.self_attention.query_key_value", "transformer.h.0.self_attention.dense",
                        lambda c: (c.num_attention_heads, c.num_kv_heads, c.hidden_size // c.num_attention_heads),
                        lambda c, g, hd: slice(g * (c.num_attention_heads // c.num_kv_heads + 2) * hd
                                               + (c.num_attention_heads // c.num_kv_heads + 1) * hd,
                                               (g + 1) * (c.num_attention_heads // c.num_kv_heads + 2) * hd)),
    "bloom": ("transformer.h.0.self_attention.query_key_value", "transformer.h.0.self_attention.dense",
              lambda c: (c.n_head, c.n_head, c.hidden_size // c.n_head),
              lambda c, g, hd: slice(g * 3 * hd + 2 * hd, (g + 1) * 3 * hd)),
    "opt": ("model.decoder.layers.0.self_attn.v_proj", "model.decoder.layers.0.self_attn.out_proj", None, None),
    "phi": ("model.layers.0.self_attn.v_proj", "model.layers.0.self_attn.dense", None, None),
    "phi3": ("model.layers.0.self_attn.qkv_proj", "model.layers.0.self_attn.o_proj", None,
             lambda c, g, hd: slice((c.num_attention_heads + c.num_key_value_heads + g) * hd,
                                    (c.num_attention_heads + c.num_key_value_heads + g + 1) * hd)),
    "deepseek_v3": ("model.layers.0.self_attn.kv_b_proj", "model.layers.0.self_attn.o_proj",
                    lambda c: (c.num_attention_heads, c.num_attention_heads, c.v_head_dim),
                    lambda c, g, hd: slice(g * (c.qk_nope_head_dim + c.v_head_dim) + c.qk_nope_head_dim,
                                           (g + 1) * (c.qk_nope_head_dim + c.v_head_dim))),
    "recurrent_gemma": ("model.layers.1.temporal_block.v_proj", "model.layers.1.temporal_block.o_proj", None, None),
    # gemma4 layer 0 is a full-attention layer with head_dim = global_head_dim; gemma4_moe layer 0 is sliding
    "gemma4": ("model.layers.0.self_attn.v_proj", "model.layers.0.self_attn.o_proj",
               lambda c: (c.num_attention_heads, c.per_layer_config[0].num_key_value_heads,
                          c.per_layer_config[0].head_dim), None),
    "gemma4_moe": ("model.layers.0.self_attn.v_proj", "model.layers.0.self_attn.o_proj",
                   lambda c: (c.num_attention_heads, c.per_layer_config[0].num_key_value_heads,
                              c.per_layer_config[0].head_dim), None),
    # Doge's dynamic mask (dt_proj) reads *all* value heads, so zeroing a value head moves every head: zero a
    # query head instead (each "group" is then one head)
    "doge": ("model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.o_proj",
             lambda c: (c.num_attention_heads, c.num_attention_heads, c.hidden_size // c.num_attention_heads), None),
}
NO_HEAD_ORDER = {"deepseek_v4": "single shared K=V head (MQA): zeroing it moves every head",
                 "jetmoe": "heads are routed attention experts; covered by the `heads` column",
                 "zamba2": "no attention write (Mamba mixers)",
                 "zaya": "CCA value = cat(current, delayed) halves; layout checked by the `heads` column only"}


def head_order_check(family, seed=0):
    """'ok' when zeroing kv head g's value moves exactly the o_proj input blocks of heads h with h // rep == g."""
    if family in NO_HEAD_ORDER:
        return "skip (" + NO_HEAD_ORDER[family] + ")"
    model = tiny.build(family, seed)
    cfg = model.config
    vmod, omod, dims, vslice = HEAD_ORDER.get(
        family, ("model.layers.0.self_attn.v_proj", "model.layers.0.self_attn.o_proj", None, None))
    if dims is None:
        H = cfg.num_attention_heads
        kv = getattr(cfg, "num_key_value_heads", None) or H
        hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // H
    else:
        H, kv, hd = dims(cfg)
    vslice = vslice or (lambda c, g, d: slice(g * d, (g + 1) * d))
    tok = tiny.tokenizer(cfg.vocab_size)
    batch = tok(["w3 w17 w5 w99 w42 w8 w23 w61 w7"], return_tensors="pt")
    store = {}

    def grab(mod, args):
        store["x"] = args[0].detach().clone()

    def run_once(g=None):
        hs = [model.get_submodule(omod).register_forward_pre_hook(grab)]
        if g is not None:
            def zero(mod, args, out, g=g):
                out = out.clone()
                out[..., vslice(cfg, g, hd)] = 0
                return out
            hs.append(model.get_submodule(vmod).register_forward_hook(zero))
        with torch.no_grad():
            model(**batch)
        for h in hs:
            h.remove()
        return store["x"]

    base = run_once()
    rep = H // kv
    for g in range(kv):
        moved = (run_once(g) - base).abs().amax(dim=(0, 1)).view(H, -1).amax(-1) > 1e-7
        want = torch.tensor([h // rep == g for h in range(H)])
        if not torch.equal(moved, want):
            return f"FAIL g={g}: moved heads {moved.nonzero().flatten().tolist()}, want {want.nonzero().flatten().tolist()}"
    return f"ok (H={H}, kv={kv}, head_dim={hd}; o_proj input = [b, s, H*head_dim], head h = cols h*hd:(h+1)*hd)"


def _yn(lst):
    return "".join("-" if v is None else ("Y" if v else "n") for v in lst)


def main(argv):
    perturbed = "--plain" not in argv
    if "--heads" in argv:
        fams = [a for a in argv if not a.startswith("--")] or list(tiny.FAMILIES)
        for f in fams:
            try:
                print(f"{f:20s} {head_order_check(f)}", flush=True)
            except Exception as e:  # noqa: BLE001
                print(f"{f:20s} ERROR {type(e).__name__}: {str(e)[:300]}", flush=True)
        return 0
    if "--nnterp" in argv:
        fams = [a for a in argv if not a.startswith("--")] or list(tiny.FAMILIES)
        for f in fams:
            try:
                print(f"{f:20s} {nnterp_check(f)}", flush=True)
            except Exception as e:  # noqa: BLE001
                print(f"{f:20s} ERROR {type(e).__name__}: {str(e)[:300]}", flush=True)
        return 0
    argv = [a for a in argv if not a.startswith("--")]
    fams = argv or list(tiny.FAMILIES)
    if not perturbed:
        print("** plain transformers init (no perturbation): formulas that ignore gains / biases may pass by accident **")
    hdr = (f"{'family':20s} {'embed':>8s} {'stream':>8s} {'layer':>8s} {'norm':>8s} {'logits':>8s} {'heads':>8s} "
           f"{'neur':>8s} {'naive':>8s} {'terms':>5s} {'attn==':>6s} {'mlp==':>6s}  final norm / lm_head bias / logits post")
    print(hdr)
    bad = []
    for f in fams:
        try:
            r = run(f, perturbed=perturbed)
        except Exception as e:  # noqa: BLE001
            import traceback

            traceback.print_exc()
            print(f"{f:20s} ERROR {type(e).__name__}: {e}")
            bad.append(f)
            continue
        errs = [r[k] for k in ("embed", "stream", "layer", "norm", "logits", "heads", "neur")]
        ok = all(math.isnan(v) or v <= TOL for v in errs[5:]) and all(v <= TOL for v in errs[:5])
        if not ok:
            bad.append(f)
        print(
            f"{f:20s} " + " ".join("       -" if math.isnan(v) else f"{v:8.1e}" for v in errs)
            + f" {r['naive']:8.1e} {r['n_terms']:5d} {r['attn_eq']:>6s} {r['mlp_eq']:>6s}  {r['norm_kind']} / bias={r['lm_bias']} / "
            f"{r['post']}" + ("" if ok else "   <-- FAIL") + (f"   [{r['notes']}]" if r["notes"] else ""),
            flush=True,
        )
    print(f"\n{len(fams) - len(bad)}/{len(fams)} families within {TOL:g}" + (f"; failing: {bad}" if bad else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
