"""Attaching dictionaries to a plan: every key checked against the model, every problem in one ``InputError``.

``attach(model, plan, dictionaries, remote)`` reads ``{"L12.mlp": sae, "L16.resid": sae2, ...}`` (keys ``L<i>.<term>``
naming a term block ``i`` writes, ``L<i>.resid`` the stream entering block ``i``, or a TransformerLens hook name such
as ``"blocks.12.hook_mlp_out"``), builds each ``Dictionary`` (``features.dictionary.as_dictionary``) and checks, once
per call and before any forward pass: the key names a term or block boundary of this model, the dictionary's own
config names the same site, its widths fit (``d_out`` = ``d_in`` = ``d_model``), its weights are finite (the NaN /
inf latents named), its dtype is float32 or the model's and its device the CPU or the model's, a transcoder reads a
term whose sublayer reads the stream through a norm, no two dictionaries overlap (a term dictionary before a
residual one is inside the stream that one splits), and, remote, that its weights fit in the request
(``REQUEST_LIMIT``) and its encoder is weights (a callable cannot travel). It returns a new ``Plan`` whose
dictionary terms split by their latents (``PlannedTerm.dictionary``) and whose stream, where a residual dictionary
is given, starts at that block (``Plan.stream_dictionary``).
"""

from __future__ import annotations

import re
from dataclasses import replace

import torch

from ..errors import InputError
from ..plan.plan import Plan
from .dictionary import Dictionary, Encoder, as_dictionary, site_of_hook

REQUEST_LIMIT = 32 * 1024 * 1024  # bytes: the loopback NDIF server's request limit (testing.loopback.protocol)
_KEY = re.compile(r"^L(\d+)\.(\w+)$")


def _finite(name: str, tensor: torch.Tensor, latent_dim: int | None) -> str | None:
    """A message naming the non-finite entries of ``tensor`` (the latents, along ``latent_dim``), or None."""
    if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
        if latent_dim is None:
            return f"{name} has NaN / inf entries"
        bad = (~torch.isfinite(tensor)).flatten(0, -1).reshape(tensor.shape)
        latents = torch.nonzero(bad.any(dim=1 - latent_dim) if tensor.dim() == 2 else bad).flatten().tolist()
        shown = ", ".join(map(str, latents[:8])) + (", ..." if len(latents) > 8 else "")
        return f"{name} has NaN / inf weights at latent(s) {shown} ({len(latents)} in all)"
    return None


def check_weights(key: str, d: Dictionary, d_model: int, dtype: torch.dtype, device: torch.device) -> list[str]:
    """Every problem of one dictionary's weights: widths, finiteness, dtype, device."""
    problems, d_sae = [], d.width
    if d.W_dec.dim() != 2 or d.W_dec.shape[1] != d_model:
        problems.append(f"{key}: W_dec is {tuple(d.W_dec.shape)}, not [d_sae, d_model={d_model}]: the dictionary "
                        "was trained on another model or hook point")
    if tuple(d.b_dec.shape) != (d_model,):
        problems.append(f"{key}: b_dec is {tuple(d.b_dec.shape)}, not [d_model={d_model}]")
    if d.W_skip is not None and tuple(d.W_skip.shape) != (d_model, d_model):
        problems.append(f"{key}: W_skip is {tuple(d.W_skip.shape)}, not [d_out={d_model}, d_in={d_model}]")
    if isinstance(d.encoder, Encoder):
        e = d.encoder
        if tuple(e.W_enc.shape) != (d_model, d_sae):
            problems.append(f"{key}: W_enc is {tuple(e.W_enc.shape)}, not [d_in={d_model}, d_sae={d_sae}]: the "
                            "input this hook point reads is d_model wide")
        if tuple(e.b_enc.shape) != (d_sae,):
            problems.append(f"{key}: b_enc is {tuple(e.b_enc.shape)}, not [d_sae={d_sae}]")
        if e.activation not in ("relu", "jumprelu", "topk"):
            problems.append(f"{key}: activation {e.activation!r} is not 'relu', 'jumprelu' or 'topk'")
        if e.activation == "jumprelu" and (e.threshold is None or tuple(e.threshold.shape) != (d_sae,)):
            problems.append(f"{key}: a JumpReLU encoder needs threshold [d_sae={d_sae}]")
        if e.activation == "topk" and not (isinstance(e.k, int) and 0 < e.k <= d_sae):
            problems.append(f"{key}: a TopK encoder needs 0 < k <= d_sae={d_sae}, not {e.k!r}")
    elif not callable(d.encoder):
        problems.append(f"{key}: encoder is a {type(d.encoder).__name__}: give an Encoder or a callable")
    if d.keep is not None and not (isinstance(d.keep, int) and not isinstance(d.keep, bool) and d.keep > 0):
        problems.append(f"{key}: keep={d.keep!r}: give how many latents a site sends back, an int > 0 (or None)")
    latent_dims = {"W_dec": 0, "W_enc": 1, "b_enc": 0, "threshold": 0}
    other_dtype = {}  # dtype -> the tensors in it: one problem a dictionary, not one a tensor
    for name, tensor in d.tensors().items():
        found = _finite(f"{key}: {name}", tensor, latent_dims.get(name))
        if found:
            problems.append(found)
        if tensor.is_floating_point() and tensor.dtype not in (torch.float32, dtype):
            other_dtype.setdefault(tensor.dtype, []).append(name)
        if tensor.device.type != "cpu" and tensor.device != device and device.type != "meta":
            problems.append(f"{key}: {name} is on {tensor.device}, the model on {device}: move it to either")
    for found, names in other_dtype.items():
        fits = "torch.float32" if dtype == torch.float32 else f"torch.float32 or {dtype}"
        problems.append(f"{key}: {', '.join(names)} {'is' if len(names) == 1 else 'are'} {found}; the model computes "
                        f"in {dtype}: give the dictionary in {fits} (.to(torch.float32))")
    return problems


def _site(key) -> tuple[int, str] | None:
    """``(layer, term)`` of a key (``"L12.mlp"`` or a hook name), or None."""
    site = site_of_hook(key) or key
    match = _KEY.match(site) if isinstance(site, str) else None
    return None if match is None else (int(match.group(1)), match.group(2))


def attach(model, plan: Plan, dictionaries: dict, remote=False) -> Plan:
    """A copy of ``plan`` splitting the keyed terms (and the stream) by the given dictionaries; see the module
    docstring. Raises ``InputError`` listing every problem of every dictionary."""
    if not isinstance(dictionaries, dict) or not dictionaries:
        raise InputError(f"dictionaries={type(dictionaries).__name__}: give a dict {{'L12.mlp': sae, "
                         "'L16.resid': sae2, ...} (keys: 'L<block>.<term>' or 'L<block>.resid')")
    d_model = int(model.lm_head.weight.shape[-1])
    dtype, device = model.lm_head.weight.dtype, model.lm_head.weight.device
    problems, terms, streams, named = [], {}, {}, {}
    for key, obj in dictionaries.items():
        site = _site(key)
        if site is None or not 0 <= site[0] < len(plan.layers) + (site[1] == "resid"):
            problems.append(f"{key!r}: not a site of this {len(plan.layers)}-block model: use 'L<block>.<term>' "
                            f"(terms: {', '.join(p.term.name for p in plan.layers[0])}) or 'L<block>.resid' "
                            f"(the stream entering block 0 .. {len(plan.layers) - 1})")
            continue
        if site in named:  # 'L10.resid' and 'blocks.9.hook_resid_post', say: one would silently replace the other
            problems.append(f"{named[site]!r} and {key!r} both name L{site[0]}.{site[1]}: give one dictionary a site")
            continue
        named[site] = key
        layer, name = site
        d, found = as_dictionary(obj, key)
        problems += found
        if d is None:
            continue
        label = f"L{layer}.{name}"
        own = site_of_hook(d.hook)
        if own is not None and own != label:
            where = "no term's write or block boundary" if own.startswith("?") else own
            problems.append(f"{key}: the dictionary's own config names hook {d.hook!r} ({where}), not {label}: "
                            "give it under its own key")
        problems += check_weights(key, d, d_model, dtype, device)
        if remote and not isinstance(d.encoder, Encoder):
            problems.append(f"{key}: its encode is a function, which cannot travel to a remote server: give the "
                            "encoder's weights (an Encoder, or an sae-lens object with W_enc / b_enc)")
        if remote and d.nbytes() > REQUEST_LIMIT:
            problems.append(f"{key}: its weights are {d.nbytes():,} bytes, over the server's request limit of "
                            f"{REQUEST_LIMIT:,} bytes: use a smaller dictionary, or run locally")
        if name == "resid":
            if d.reads == "input" or d.W_skip is not None:
                problems.append(f"{key}: a transcoder replaces a sublayer; at the stream use an SAE")
            streams[layer] = d
            continue
        names = [p.term.name for p in plan.layers[layer]]
        if name not in names:
            problems.append(f"{key}: block {layer} writes no {name!r} term (it writes {', '.join(names)})")
            continue
        planned = plan.layers[layer][names.index(name)]
        if d.reads == "input" and planned.term.reads is None:
            problems.append(f"{key}: a transcoder reads what the sublayer reads through its norm; block {layer}'s "
                            f"{name} reads the stream without one ({plan.family.name})")
        terms[(layer, names.index(name))] = d
    total = sum(d.nbytes() for d in [*terms.values(), *streams.values()])
    if remote and len(terms) + len(streams) > 1 and total > REQUEST_LIMIT:
        problems.append(f"together the dictionaries are {total:,} bytes, over the server's request limit of "
                        f"{REQUEST_LIMIT:,} bytes: attribute them in separate calls")
    problems += _overlaps(plan, terms, streams)
    if problems:
        raise InputError("dictionaries: " + "; ".join(problems))
    layers = [tuple(replace(p, dictionary=terms[(i, k)]) if (i, k) in terms else p for k, p in enumerate(block))
              for i, block in enumerate(plan.layers)]
    stream = next(iter(streams.items())) if streams else None
    return replace(plan, layers=tuple(layers), stream_dictionary=stream)


def _overlaps(plan: Plan, terms: dict, streams: dict) -> list[str]:
    """Dictionaries whose splits overlap (two streams; a term inside a stream split), and streams this family's
    stream cannot be split at (something acts on the stream after the block: see ``stream_blockers``)."""
    problems = []
    if len(streams) > 1:
        problems.append(f"{', '.join(f'L{i}.resid' for i in sorted(streams))}: one residual-stream dictionary a "
                        "call (a later stream holds the earlier one)")
    for layer in streams:
        inside = sorted(f"L{i}.{plan.layers[i][k].term.name}" for i, k in terms if i < layer)
        if inside:
            problems.append(f"{', '.join(inside)} write(s) into the stream L{layer}.resid splits: attribute them in "
                            "a call of their own")
        blockers = stream_blockers(plan, layer)
        if blockers:
            problems.append(f"L{layer}.resid: this {plan.family.name} model acts on the stream after block "
                            f"{layer} ({blockers}), so its stream is not one vector carried to the logit; use term "
                            "dictionaries (L<i>.mlp / L<i>.attn)")
    return problems


def stream_blockers(plan: Plan, layer: int) -> str:
    """What acts on the stream at or after block ``layer`` besides the terms added to it (empty: nothing)."""
    found = ["a per-block scale"] if plan.family.layer_scale is not None else []
    for block in plan.layers[layer:]:
        for p in block:
            stream = p.term.stream
            if p.term.hyper is not None:
                found.append("parallel residual streams")
            if any(x is not None for x in (stream.scale, stream.bias, stream.norm, stream.norm_after)) or \
                    p.stream_multiplier != 1.0:
                found.append(f"a stream map at {p.term.name}")
    return ", ".join(dict.fromkeys(found))
