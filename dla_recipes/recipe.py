"""The in-trace DLA recipe: per-component contributions computed inside the trace, on any family.

``direct_logit_attribution(model, plan, positions, targets, contrasts, by)`` runs inside ``with model.trace(...)``
(locally, or server side on NDIF) and returns a ``Readout`` of a few small tensors; ``direction_attribution`` does
the same for a direction read by any block's norm. The math, for every family:

1. The logit is ``logit_scale * (lm_head.weight[t] @ norm(x) + lm_head.bias[t])`` at the attributed position, where
   ``x`` is the final norm's input. Freezing the norm (``FrozenNorm``) makes it ``gain * center(x) * s + bias``, so
   ``logit = s * (x @ d) + constant`` with the direction ``d = logit_scale * center(gain * W[t])`` (minus the same
   for a contrast token). ``d`` is known before the forward pass; the scale ``s`` only at its end.
2. ``x`` is the sum of the terms the blocks wrote (the embedding, then each block's terms, ``families.py``), each
   carried by what later acts on the stream. Static maps (Doge's gates, ZAYA's residual scaling, Gemma-4's
   ``layer_scalar``) are pulled back into each term's direction before the forward pass reads it; input-dependent
   stream mixing (DeepSeek-V4's hyper-connections) is carried forward as per-stream weights and read along the
   final collapse at the end. A norm applied to the stream itself (MiniMax, RWKV, OpenAI GPT's post-norm blocks) is
   frozen at its real input: its static part (gain, centering) is pulled back before the forward pass, and its
   scale, read in the trace, multiplies everything written before it.
3. Each block's values are read in forward order, then reduced to a few numbers (``layer_scores``): a block term
   to one (its value at the position, dotted with its direction); a split term to one per head, neuron or expert:
   the direction is pulled back through the term's multiplier, outer and post norms (frozen at their real inputs)
   and output projection onto the projection's input, then multiplied by the heads' outputs or the neurons'
   activations; a fused mixture of experts is recomputed from the model's own routing and weights, only for the
   experts that fired. No ``[batch, pos, d_model]`` activation is kept, and no ``[batch, d_mlp, d_model]`` tensor
   is ever built.
4. At the end the final norm's scale ``s`` is fitted at the real stream, every number is multiplied by it, and the
   model's own logit is read from ``lm_head``'s output (times ``logit_scale``), so the caller can check
   ``values.sum(-1) + constant == logit``.

Everything runs under ``torch.no_grad()`` in float32, whatever the model's dtype. In a remote trace, call these
functions by name (``from dla_recipes import direct_logit_attribution``): the module object itself cannot travel.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .errors import DLAError, FamilyTableError
from .frozen_norm import FrozenNorm, NormProbe, identity_probe, probe_norm
from .plan import Granularity, Plan, PlannedTerm, Sources, Stop, check_granularity, module_at
from .readers import layer_input, layer_output, read_site


@dataclass
class Readout:
    """What a DLA trace returns: a few tensors, whatever the model's width or the prompt's length.

    Attributes:
        values: ``[batch, n_components]`` float32, the components' contributions, in ``plan.labels(by)`` order.
        constant: ``[batch]`` the final norm's bias and ``lm_head``'s bias through the head (no component's).
        logit: ``[batch]`` the model's own logit (difference) before any soft-cap: ``lm_head``'s output times the
            family's logit scale, read in the same trace.
        output_logit: ``[batch]`` the model's output logit (difference), after any soft-cap.
        head_error: ``[]`` max |head(lm_head output) - output logits| at the attributed tokens: checks the family
            table's final head (logit scale, soft-cap).
        norm_fit_error: ``[]`` the largest relative fit error of a frozen norm (final and post-norms), and with
            ``by="source"`` of a head output rebuilt from the attention pattern and values.
        scale: ``[batch]`` the frozen scale of the norm the values were read through (the final norm for a logit).

    What the self-check (``check.py``) needs to bound the model's own rounding, all ``[batch]`` in logit units:
        logit_size: ``b(z_target) + b(z_contrast)``, ``b(z) = 2^floor(log2 |z|)``: each logit is rounded at its own
            size (by at most ``u * b(z)``), not at the size of their difference.
        head_noise: ``sqrt(sum_i (y_i w_i)^2)``, ``y`` the final norm's output and ``w`` the head direction: the
            scale of that output's rounding, carried to the logit.
        stream_noise: ``s * sqrt(sum over adds, channels (x_i d_i)^2)``, ``x`` the stream around each residual add
            and ``d`` the direction it is read in: the scale of the adds' rounding, carried to the logit.
        split_gap: over the split terms (heads, neurons), the projection's own output read along the term's
            direction minus its parts and bias: the rounding of the projection's low-precision output.
        split_noise: ``sqrt(sum over split terms, channels (o_i u_i)^2)`` of those outputs ``o``: its scale.
        finite_head: 1 where the head direction (final norm gain, ``lm_head`` rows) is finite, else 0.
        first_nonfinite: the first component (a column of ``values``) whose unscaled score is not finite, else -1.
        unit_roundoff: ``u`` of the dtype the model computed in, read where it ran (server side on NDIF, where the
            client's model has no weights and may not know it); 0 when unknown.
    """

    values: torch.Tensor
    constant: torch.Tensor
    logit: torch.Tensor
    output_logit: torch.Tensor
    head_error: torch.Tensor
    norm_fit_error: torch.Tensor
    scale: torch.Tensor
    logit_size: torch.Tensor = field(default_factory=lambda: torch.zeros(()))
    head_noise: torch.Tensor = field(default_factory=lambda: torch.zeros(()))
    stream_noise: torch.Tensor = field(default_factory=lambda: torch.zeros(()))
    split_gap: torch.Tensor = field(default_factory=lambda: torch.zeros(()))
    split_noise: torch.Tensor = field(default_factory=lambda: torch.zeros(()))
    finite_head: torch.Tensor = field(default_factory=lambda: torch.ones(()))
    first_nonfinite: torch.Tensor = field(default_factory=lambda: -torch.ones(()))
    unit_roundoff: torch.Tensor = field(default_factory=lambda: torch.zeros(()))

    _SCALARS = ("constant", "logit", "output_logit", "head_error", "norm_fit_error", "scale",
                "logit_size", "head_noise", "stream_noise", "split_gap", "split_noise", "finite_head", "first_nonfinite",
                "unit_roundoff")

    def pack(self) -> torch.Tensor:
        """``[batch, n_components + 13]`` float32: everything in one tensor, the cheapest thing to send back."""
        batch = self.values.shape[0]
        extra = [getattr(self, name).float().reshape(-1).expand(batch) for name in self._SCALARS]
        return torch.cat([self.values.float(), torch.stack(extra, -1)], -1)

    @classmethod
    def unpack(cls, packed: torch.Tensor) -> "Readout":
        """The inverse of ``pack``."""
        k = len(cls._SCALARS)
        values, extra = packed[:, :-k], packed[:, -k:]
        scalars = dict(zip(cls._SCALARS, extra.unbind(-1)))
        scalars["head_error"] = scalars["head_error"].max()
        scalars["norm_fit_error"] = scalars["norm_fit_error"].max()
        return cls(values=values, **scalars)


def _dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a * b.to(a.device)).sum(-1)


def _param(layer, path: str) -> torch.Tensor:
    return module_at(layer, path).float()


def term_directions(model, plan: Plan, direction: torch.Tensor, stop: Stop | None = None):
    """Pull ``direction`` ``[batch, d_model]`` on the stream at ``stop`` (None: the final norm's input) back to
    every term written before it.

    Returns ``(embed_direction, per_layer)`` where ``per_layer[i][k]`` is ``(direction, constant, after)`` for term
    ``k`` of block ``i``: the term's write dotted with ``direction`` is its share of ``x @ direction``, ``constant``
    ``[batch]`` is what a stream bias or a stream norm's bias added with it (ZAYA, MiniMax) contributes, and
    ``after`` what the bias of a norm right after it contributes (not scaled by that norm).
    """
    v = direction
    blocks = plan.terms_before(stop)
    per_layer: list[list[tuple[torch.Tensor, torch.Tensor | float]]] = [[] for _ in blocks]
    for i in reversed(range(len(blocks))):
        layer = model.layers[i]
        whole = len(blocks[i]) == len(plan.layers[i]) and (stop is None or i < stop[0])
        if plan.family.layer_scale is not None and whole:
            v = v * _param(layer, plan.family.layer_scale).to(v.device)
        entries = []
        for planned in reversed(blocks[i]):
            term = planned.term
            constant: torch.Tensor | float = 0.0
            after: torch.Tensor | float = 0.0  # a norm right after the add: its bias, then its static part
            if term.stream_norm_after is not None:
                probe = probe_norm(module_at(layer, term.stream_norm_after), v.shape[-1]).to(v.device)
                after = _dot(v, probe.bias.to(v.device))
                v = probe.center(probe.gain.to(v.device) * v)
            if term.stream_scale is not None:
                v_before = v * _param(layer, term.stream_scale).to(v.device)
            else:
                v_before = v
            if planned.stream_multiplier != 1.0:
                v_before = v_before * planned.stream_multiplier
            if term.stream_bias is not None:
                constant = _dot(v_before, _param(layer, term.stream_bias))
            if term.stream_norm is not None:  # its static part; its scale is read in the trace (decompose)
                probe = probe_norm(module_at(layer, term.stream_norm), v.shape[-1]).to(v.device)
                constant = constant + _dot(v_before, probe.bias.to(v_before.device))
                v_before = probe.center(probe.gain.to(v_before.device) * v_before)
            entries.append((v, constant, after))
            v = v_before
        per_layer[i] = entries[::-1]
    return v, per_layer


def _write_direction(layer, planned: PlannedTerm, v: torch.Tensor):
    """Pull ``v`` back through the term's multiplier and affine merge: ``(direction on read(output), constant)``."""
    term = planned.term
    u = v * planned.multiplier if planned.multiplier != 1.0 else v
    if term.scale is not None:
        u = u * _param(layer, term.scale).to(u.device)
    constant = _dot(u, _param(layer, term.bias)) if term.bias is not None else 0.0
    return u, constant


CHUNK_ELEMENTS = 1 << 24  # float32 elements of a weight converted at once (64 MB): bounds memory in bf16 / fp16


def matmul_f32(x: torch.Tensor, weight: torch.Tensor, transpose: bool = False) -> torch.Tensor:
    """``x @ weight`` (or ``x @ weight.T``) in float32, ``x`` ``[rows, k]`` float32, whatever ``weight``'s dtype.

    A float32 weight is used as is. A low-precision one (a bfloat16 model on NDIF) is converted a slice of rows at
    a time, so no float32 copy of a whole ``[d_mlp, d_model]`` matrix is ever held: the memory stays bounded and
    the products are accumulated in float32.
    """
    x = x.to(weight.device)
    if weight.dtype == torch.float32:
        return x @ weight.T if transpose else x @ weight
    step = max(1, CHUNK_ELEMENTS // weight.shape[1])
    if transpose:  # weight [n, k]: each slice of rows gives a slice of the output's columns
        return torch.cat([x @ weight[i:i + step].float().T for i in range(0, weight.shape[0], step)], -1)
    out = torch.zeros(x.shape[0], weight.shape[1], device=weight.device)
    for i in range(0, weight.shape[0], step):  # weight [k, n]: each slice of rows adds its share of the sum
        out += x[:, i:i + step] @ weight[i:i + step].float()
    return out


def _at(value: torch.Tensor, rows, positions) -> torch.Tensor:
    """``value[rows, positions]`` in float32 (advanced indexing copies, so later in-place edits cannot reach it)."""
    return value[rows.to(value.device), positions.to(value.device)].float()


def _frozen(norm, rows, positions, batch: int) -> FrozenNorm:
    """A norm envoy frozen at its real input at the attributed positions (reads its input, then its output)."""
    stream = _at(read_site(norm, "input", batch), rows, positions)
    probe = probe_norm(norm, stream.shape[-1])
    return probe.freeze(stream, _at(read_site(norm, "output", batch), rows, positions))


def read_term(layer, planned: PlannedTerm, mode: str | None, rows, positions, own: bool = True) -> dict:
    """Read, in forward order, what scoring this term needs at the attributed positions (a few ``[batch, ...]``)."""
    term, batch = planned.term, rows.shape[0]
    data: dict = {}
    if term.stream_norm is not None:  # the norm on the stream runs before this term's sublayer
        data["stream_norm"] = _frozen(module_at(layer, term.stream_norm), rows, positions, batch)
    data.update(_read_value(layer, planned, mode, rows, positions, own))
    if term.stream_norm_after is not None:  # ... and a norm right after the add, after it
        data["stream_norm_after"] = _frozen(module_at(layer, term.stream_norm_after), rows, positions, batch)
    return data


def _read_value(layer, planned: PlannedTerm, mode: str | None, rows, positions, own: bool = True) -> dict:
    """The term's own reads (its value, or what its split needs), in forward order."""
    term, batch = planned.term, rows.shape[0]
    data: dict = {}
    if term.hyper is not None:  # parallel streams: the mixing weights this term is written and carried with
        post, comb = module_at(layer, term.hyper).output[:2]  # comb: [b, s, n, n]; HY-V4 has none (its 2nd is [b, s, d])
        comb = _at(comb, rows, positions) if comb.dim() == post.dim() + 1 else None  # None: the streams are not mixed
        data["hyper"] = (_at(post, rows, positions), comb)
    if mode is None:
        data["value"] = _at(read_site(layer, term.output, batch), rows, positions)
        return data
    if term.router is not None:
        data.update(_read_routed(layer, term, rows, positions))
    elif mode in ("heads", "neurons") and term.position_conv is not None:
        data.update(_read_lags(layer, term, rows, positions))
    elif mode == "sources":
        data.update(_read_sources(layer, planned, rows, positions))
    elif mode in ("heads", "neurons"):
        data["inputs"] = _at(read_site(module_at(layer, term.projection), "input", batch), rows, positions).flatten(1)
        if own and term.then is None:  # the projection's own (low-precision) output: its parts' rounding
            data["own"] = _at(read_site(module_at(layer, term.projection), "output", batch), rows, positions).flatten(1)
        if term.output_gate is not None:  # sigmoid(gate) multiplies the projection's output channel by channel
            data["output_gate"] = torch.sigmoid(_at(read_site(module_at(layer, term.output_gate), "output", batch),
                                                    rows, positions))
    else:
        if term.shared is not None and term.shared_first:
            data["shared"] = _at(read_site(module_at(layer, term.shared), "input", batch), rows, positions)
        data.update(_read_experts(layer, planned, rows, positions))
        if term.shared is not None and not term.shared_first:
            data["shared"] = _at(read_site(module_at(layer, term.shared), "input", batch), rows, positions)
        if term.shared_gate is not None:
            data["gate"] = torch.sigmoid(_at(read_site(module_at(layer, term.shared_gate), "output", batch), rows, positions))
    if term.post_norm is not None:
        data["post_norm"] = _frozen(module_at(layer, term.post_norm), rows, positions, batch)
    return data


def _read_experts(layer, planned: PlannedTerm, rows, positions) -> dict:
    """The attributed tokens' expert inputs, experts and routing weights, from the experts module's own inputs.

    Returns ``hidden`` (``[batch, d]``, or ``[batch, k, d]`` one row per slot when the inputs are router-scaled),
    ``index [batch, k]`` (``E``: no expert) and ``weights [batch, k]``.
    """
    term, batch = planned.term, rows.shape[0]
    args, kwargs = module_at(layer, term.projection).inputs
    names = ("hidden_states", "top_k_index", "top_k_weights")
    values = list(args) + [kwargs[k] for k in names if k in kwargs]
    hidden = values[0]
    if term.layout.scaled_inputs:  # every expert on every token, each row pre-multiplied by its routing score
        hidden = hidden.reshape(planned.experts, -1, hidden.shape[-1])  # [E, tokens, d]
        tokens = rows.to(hidden.device) * (hidden.shape[1] // batch) + positions.to(hidden.device)
        routed = hidden[:, tokens].transpose(0, 1).float()  # [batch, E, d]
        index = torch.arange(planned.experts, device=routed.device).expand(batch, -1)
        index = torch.where((routed != 0).any(-1), index, planned.experts)  # a zero row: not routed
        return {"hidden": routed, "index": index, "weights": torch.ones(index.shape, device=routed.device)}
    if len(values) < 3:
        raise FamilyTableError(
            f"the experts module {term.projection} was called with {len(values)} input(s), not (hidden, top_k_index, "
            "top_k_weights): its family table entry's ExpertsLayout does not describe it (router-scaled inputs?)"
        )
    hidden = hidden.reshape(-1, hidden.shape[-1])  # [tokens, d] (DBRX passes [batch, pos, d])
    index, weights = values[1], values[2]
    index, weights = index.reshape(hidden.shape[0], -1), weights.reshape(hidden.shape[0], -1)
    tokens = rows.to(hidden.device) * (hidden.shape[0] // batch) + positions.to(hidden.device)
    return {"hidden": hidden[tokens].float(), "index": index[tokens], "weights": weights[tokens].float()}


def _read_lags(layer, term, rows, positions) -> dict:
    """A position convolution's reads: the projection's inputs at the ``K`` positions ``p, p - 1, ... p - K + 1``
    (``lag_inputs [batch, K, in]``), whether each exists (``lag_valid [batch, K]``) and the conv's padding mask
    there (``lag_mask [batch, K]``, 0 at pads and before the sequence)."""
    full = read_site(module_at(layer, term.projection), "input", rows.shape[0])  # [batch, pos, ...]
    conv = module_at(layer, term.position_conv)
    width = int(conv.conv1d.weight.shape[-1])
    lags = positions.to(full.device)[:, None] - torch.arange(width, device=full.device)[None, :]  # [batch, K]
    valid, q = lags >= 0, lags.clamp(min=0)
    inputs = full[rows.to(full.device)[:, None], q].float().flatten(2)
    mask = conv.inputs[1].get("conv_mask")
    mask = mask[rows.to(mask.device)[:, None], q.to(mask.device)].float() if mask is not None else torch.ones(q.shape)
    return {"lag_inputs": inputs, "lag_valid": valid.float(), "lag_mask": mask.to(valid.device) * valid.float()}


def _conv_scores(layer, planned: PlannedTerm, data: dict, u: torch.Tensor):
    """``(parts [batch, parts], bias constant)`` of a split term under a position convolution: the direction at
    lag ``l`` is ``u * (1[l = 0] + w[:, K - 1 - l] * mask_l)``, pulled back through the projection and read along
    the projection's input at ``p - l``."""
    conv = module_at(layer, planned.term.position_conv)
    weight = conv.conv1d.weight.float().squeeze(1).to(u.device)  # [d, K]
    batch, width = data["lag_mask"].shape
    coefficients = weight.flip(-1).T[None] * data["lag_mask"].to(u.device)[..., None]  # [batch, K, d]
    coefficients[:, 0] += 1.0  # the convolution's input is added too (its residual)
    lagged = u[:, None] * coefficients * data["lag_valid"].to(u.device)[..., None]
    pulled, bias = _linear_pullback(module_at(layer, planned.term.projection), lagged.flatten(0, 1), planned.transposed)
    inputs = data["lag_inputs"]
    per_input = (inputs * pulled.view(batch, width, -1).to(inputs.device)).sum(1)
    parts = per_input.unflatten(-1, (planned.parts, planned.part_width)).sum(-1)
    constant = bias.view(batch, width).sum(1) if isinstance(bias, torch.Tensor) else 0.0
    return parts, constant


def _read_sources(layer, planned: PlannedTerm, rows, positions) -> dict:
    """What splitting heads by source position needs, read in forward order: the values of every position of the
    attributed rows ``[batch, pos, kv_heads, head_dim]``, the heads as the output projection reads them at the
    attributed positions ``[batch, heads * head_dim]``, and the attention pattern the model computed there
    ``[batch, heads, pos]`` (the attention module's second output under eager attention). ``pattern_error`` is
    ``max |sum_s A v - heads| / max |heads|``: the pattern and values must rebuild the model's own head outputs."""
    term, batch = planned.term, rows.shape[0]
    values = read_site(layer, term.values, batch)
    values = values[rows.to(values.device)].float()  # every position of the attributed rows
    inputs = _at(read_site(module_at(layer, term.projection), "input", batch), rows, positions).flatten(1)
    attention = module_at(layer, term.projection.rsplit(".", 1)[0]).output
    weights = attention[1] if isinstance(attention, tuple) and len(attention) > 1 else None
    if weights is None:
        raise DLAError(
            f"by='source' needs the attention pattern, and this model's attention ({planned.term.projection}'s module) "
            "returns none: its attention implementation is not eager. Load the model with "
            "dla_recipes.load(..., attn_implementation='eager')"
        )
    pattern = weights[rows.to(weights.device), :, positions.to(weights.device)].float()  # [batch, heads, keys]
    values = _values_of(values, term.values_layout, planned.parts, planned.part_width)
    rebuilt = _grouped_sum(pattern, values.to(pattern.device)).flatten(1)
    scale = inputs.abs().max().clamp(min=1e-30)
    return {"values": values, "inputs": inputs, "pattern": pattern,
            "pattern_error": float(((rebuilt - inputs.to(rebuilt.device)).abs().max() / scale))}


def _values_of(fused: torch.Tensor, layout: str | None, heads: int, head_dim: int) -> torch.Tensor:
    """``[batch, pos, kv_heads, head_dim]``: the values in a value tensor or a fused projection's output
    (``Term.values_layout``)."""
    batch, pos = fused.shape[:2]
    fused = fused.reshape(batch, pos, -1)
    if layout == "qkv":  # [queries | keys | values], keys and values of equal width
        fused = fused[..., heads * head_dim + (fused.shape[-1] - heads * head_dim) // 2:]
    elif layout == "per_head_qkv":  # [heads, (query, key, value)]
        fused = fused.view(batch, pos, heads, 3 * head_dim)[..., 2 * head_dim:]
    return fused.reshape(batch, pos, -1, head_dim)


def _grouped_sum(pattern: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``[batch, heads, head_dim]``: ``sum_s A[h, s] v[s, group(h)]`` for each query head (GQA / MQA groups)."""
    batch, heads, keys = pattern.shape
    kv = values.shape[2]
    grouped = pattern.view(batch, kv, heads // kv, keys)
    return torch.einsum("bvgk,bkvd->bvgd", grouped, values[:, :keys]).reshape(batch, heads, -1)


def _source_scores(planned: PlannedTerm, data: dict, pulled: torch.Tensor, split: tuple, offsets: torch.Tensor,
                   count: int) -> torch.Tensor:
    """``[batch, parts]``: each split head's part per own source position (``count`` of them), the others whole.

    Head ``h`` writes ``sum_s A[h, s] v[s]`` through the output projection, so its part read along the pulled-back
    direction ``pulled`` ``[batch, heads * head_dim]`` splits exactly into ``A[h, s] * (v[s] . pulled_h)``. Source
    ``s`` of a prompt is padded position ``offsets[b] + s``; a source past the padded length is zero.
    """
    heads, width = planned.parts, planned.part_width
    pattern, values = data["pattern"], data["values"].to(data["pattern"].device)
    u = pulled.to(pattern.device).view(-1, heads, width)
    whole = (data["inputs"].to(u.device).view(-1, heads, width) * u).sum(-1)  # [batch, heads]
    batch, _, keys = pattern.shape
    kv = values.shape[2]
    along = torch.einsum("bkvd,bvgd->bvgk", values[:, :keys], u.view(batch, kv, heads // kv, width))
    per_source = pattern * along.reshape(batch, heads, keys)  # [batch, heads, padded keys]
    index = offsets.to(u.device)[:, None] + torch.arange(count, device=u.device)[None]  # [batch, count]
    inside = index < keys
    own = per_source.gather(-1, index.clamp(max=keys - 1)[:, None].expand(-1, heads, -1)) * inside[:, None]
    pieces = [own[:, h] if split[h] else whole[:, h:h + 1] for h in range(heads)]
    return torch.cat(pieces, -1)


def _read_routed(layer, term, rows, positions) -> dict:
    """The attributed tokens' rows of a grouped-experts projection's input, with their experts, gates and slots."""
    router = module_at(layer, term.router)
    sorted_experts, batch_index, gates, expert_size, _ = router.output
    grouped, sizes = module_at(layer, term.projection).inputs[0][:2]  # (rows grouped by expert, rows per expert)
    top_k = int(router._module.top_k)
    seq = batch_index.numel() // (rows.shape[0] * top_k)
    tokens = rows.to(batch_index.device) * seq + positions.to(batch_index.device)
    order = torch.argsort(batch_index, stable=True).view(-1, top_k)[tokens]  # [batch, top_k] grouped rows
    ends = torch.cumsum(torch.as_tensor(sizes, device=order.device), 0)
    return {
        "routed": grouped[order].float(),  # [batch, top_k, in]
        "expert": torch.bucketize(order, ends, right=True),  # [batch, top_k]
        "gate": gates[order].float(),
        "slot": sorted_experts[order] % top_k,
    }


def _routed_scores(layer, planned: PlannedTerm, mode: str, data: dict, u: torch.Tensor) -> torch.Tensor:
    """``[batch, parts]`` for grouped experts: per head of each routed slot, or per expert / expert neuron."""
    weight = module_at(layer, planned.term.projection).weight  # [E, d_model, in]
    batch, top_k, width = data["routed"].shape
    per_input = torch.zeros(batch, top_k, width, device=weight.device)
    u, expert = u.to(weight.device), data["expert"].to(weight.device)
    routed, gate = data["routed"].to(weight.device), data["gate"].to(weight.device)
    for e in torch.unique(expert).tolist():  # only the experts that fired: at most batch * top_k
        rows, slots = (expert == e).nonzero(as_tuple=True)
        columns = matmul_f32(u[rows], weight[e])  # [rows, in]: each input feature's output column, read along u
        per_input[rows, slots] = gate[rows, slots, None] * routed[rows, slots] * columns
    per_input = per_input.to(data["routed"].device)
    rows = torch.arange(batch)
    if mode == "heads":  # slot s owns heads s * (in / head_dim) ... in its own slot order
        heads = per_input.unflatten(-1, (-1, planned.part_width)).sum(-1)  # [batch, top_k, heads per slot]
        out = torch.zeros(batch, top_k, heads.shape[-1], device=u.device)
        out[rows[:, None], data["slot"].to(u.device)] = heads
        return out.flatten(1)
    out = torch.zeros(batch, planned.experts, width, device=u.device)
    out[rows[:, None], data["expert"].to(u.device)] = per_input
    return out.sum(-1) if mode == "experts" else out.flatten(1)


def _linear_pullback(module, u: torch.Tensor, transposed: bool):
    """``(W^T u [batch, in_features], bias . u [batch] or 0.0)`` for an ``nn.Linear`` (or ``Conv1D`` if transposed).

    A grouped projection (``n_groups`` blocks on the diagonal, each ``[out / G, in]``) pulls each group's slice of
    ``u`` back through its own block: ``[batch, G * in]``.
    """
    weight = module.weight
    u = u.to(weight.device)
    bias = getattr(module, "bias", None)
    constant = _dot(u, bias.float()) if bias is not None else 0.0
    groups = getattr(module._module, "n_groups", None) if hasattr(module, "_module") else None
    if groups:
        blocks = weight.view(groups, -1, weight.shape[-1])  # [G, out / G, in]
        parts = u.view(u.shape[0], groups, -1)
        return torch.cat([matmul_f32(parts[:, g], blocks[g]) for g in range(groups)], -1), constant
    return matmul_f32(u, weight, transpose=transposed), constant


def _expert_weight(experts, path: str, e: int, count: int) -> torch.Tensor:
    """Expert ``e``'s slice of the weight at ``path`` below the experts module (``[E, a, b]`` or ``[E * a, b]``)."""
    weight = module_at(experts, path)
    return weight.view(count, -1, weight.shape[-1])[e] if weight.dim() == 2 else weight[e]


def _expert_activations(experts, layout, e: int, count: int, x: torch.Tensor) -> torch.Tensor:
    """``[rows, I]``: expert ``e``'s neurons on its input rows ``x [rows, d]``, as ``layout`` says it computes them."""

    def project(path):
        return matmul_f32(x, _expert_weight(experts, path, e, count), transpose=path not in layout.transposed)

    if layout.gate_up is None:  # separate gate and up weights
        return module_at(experts, layout.activation)(project(layout.gate)) * project(layout.up)
    fused = project(layout.gate_up)  # [rows, 2I]
    if layout.gate_up_bias is not None:
        fused = fused + module_at(experts, layout.gate_up_bias)[e].float().to(fused.device)
    if layout.gating is not None:  # the module's own gating function: its halves, clamps, scales
        return getattr(experts, layout.gating)(fused)
    gate, up = fused.chunk(2, dim=-1)
    return module_at(experts, layout.activation)(gate) * up


def _expert_scores(layer, planned: PlannedTerm, mode: str, data: dict, u: torch.Tensor):
    """``(parts [batch, E or E * d_expert (+ shared)], rest)`` for a fused mixture of experts, at one token per row.

    Each routed expert's neurons are recomputed from the model's own routing (the experts module's inputs) and
    weights, as the term's ``ExpertsLayout`` describes them; the expert writes ``w * (down[e] @ act + down_bias[e])``.
    A down bias belongs to its expert's part (``by="expert"``) or to the term's rest (``by="neuron"``).
    """
    term, layout = planned.term, planned.term.layout
    experts = module_at(layer, term.projection)
    down = module_at(experts, layout.down)
    count = planned.experts
    v = u.to(down.device) * planned.routed_scale if planned.routed_scale != 1.0 else u.to(down.device)
    hidden = data["hidden"].to(down.device)
    index, weights = data["index"].to(down.device), data["weights"].to(down.device)
    routed = index < count  # index E means "no expert" (a dropped slot)
    neurons = torch.zeros(u.shape[0], count, planned.expert_width, device=down.device)
    biases = torch.zeros(u.shape[0], count, device=down.device)
    for e in torch.unique(index[routed]).tolist():  # only the experts that fired: at most batch * top_k
        rows, slots = ((index == e) & routed).nonzero(as_tuple=True)  # a token routes to an expert at most once
        weight = weights[rows, slots]  # [rows] this expert's routing weight
        x = hidden[rows, slots] if hidden.dim() == 3 else hidden[rows]
        act = _expert_activations(experts, layout, e, count, x)  # [rows, I]
        w_down = _expert_weight(experts, layout.down, e, count)
        written = matmul_f32(v[rows], w_down, transpose=layout.down in layout.transposed)  # [rows, I] along v
        neurons[rows, e] = weight[:, None] * act.to(down.device) * written
        if layout.down_bias is not None:
            biases[rows, e] = weight * _dot(v[rows], module_at(experts, layout.down_bias)[e].float())
    neurons, biases = neurons.to(u.device), biases.to(u.device)
    if mode == "experts":
        parts, rest = [neurons.sum(-1) + biases], 0.0
    else:
        parts, rest = [neurons.flatten(1)], biases.sum(-1)
    if term.shared is not None:
        s = u * planned.shared_scale if planned.shared_scale != 1.0 else u
        pulled, bias = _linear_pullback(module_at(layer, term.shared), s, transposed=False)
        gate = data["gate"].to(pulled.device) if "gate" in data else 1.0
        shared = data["shared"].to(pulled.device) * pulled * gate
        rest = rest + bias * (gate[:, 0] if "gate" in data else 1.0)
        parts.append(shared.sum(-1, keepdim=True) if mode == "experts" else shared)
    return torch.cat([p.to(u.device) for p in parts], -1), rest


def score_term(layer, planned: PlannedTerm, mode: str | None, data: dict, v: torch.Tensor, outer: FrozenNorm | None,
               outer_bias: bool, split=None) -> torch.Tensor:
    """``[batch, parts + 1]``: the term's parts (heads, neurons, experts, head sources; none at block level), then
    its rest. ``split``: for ``mode="sources"``, ``(heads split, offsets [batch], count)`` (``_source_scores``)."""
    term = planned.term
    u, rest = _write_direction(layer, planned, v)
    if outer is not None:
        if outer_bias:
            rest = rest + _dot(u, outer.bias)
        u = outer.transpose(u)
    if mode is None:
        return (_dot(data["value"], u) + rest).unsqueeze(-1)
    if "post_norm" in data:
        rest = rest + _dot(u, data["post_norm"].bias)
        u = data["post_norm"].transpose(u)
    if planned.projection_multiplier != 1.0:
        u = u * planned.projection_multiplier
    if term.projection_scale is not None:
        u = u * _param(layer, term.projection_scale).to(u.device)
    if term.router is not None:
        parts = _routed_scores(layer, planned, mode, data, u)
        rest = rest + _dot(u, _param(layer, term.projection_bias)) if term.projection_bias else rest
    elif mode in ("heads", "neurons") and "lag_inputs" in data:
        parts, bias = _conv_scores(layer, planned, data, u)
        rest = rest + bias
    elif mode in ("heads", "neurons", "sources"):
        if term.then is not None:  # a second map after the projection: pull u back through it first
            u, then_bias = _linear_pullback(module_at(layer, term.then), u, False)
            rest = rest + then_bias
        if "output_gate" in data:
            u = u * data["output_gate"].to(u.device)
        pulled, bias = _linear_pullback(module_at(layer, term.projection), u, planned.transposed)
        if mode == "sources":
            parts = _source_scores(planned, data, pulled, *split)
        else:
            parts = (data["inputs"] * pulled.to(data["inputs"].device)).unflatten(-1, (planned.parts, planned.part_width)).sum(-1)
        rest = rest + bias
        if "own" in data:  # the projection's rounding: its own output along u, minus its parts and bias
            own = data["own"] * u.to(data["own"].device)
            data["split"] = (own.sum(-1) - parts.sum(-1) - torch.as_tensor(bias).to(own.device), (own * own).sum(-1))
    else:
        parts, bias = _expert_scores(layer, planned, mode, data, u)
        rest = rest + bias
    rest = torch.as_tensor(rest, dtype=parts.dtype, device=parts.device).expand(parts.shape[0])
    return torch.cat([parts, rest.unsqueeze(-1)], -1)


def layer_scores(layer, terms: tuple[PlannedTerm, ...], directions, by: Granularity, rows, positions, fit_errors: list,
                 split=None, splits: list | None = None):
    """``(scores [batch, n], hyper, before, after)`` of each of one block's terms: all its reads first, in forward
    order, then the arithmetic. ``hyper`` is the term's ``(post, comb)`` on a family with parallel streams, else
    None; ``before`` ``[batch]`` the frozen scale of a norm applied to the stream before the term, ``after``
    ``(scale [batch], bias constant [batch])`` of a norm right after it (else None). ``split`` (``by="source"``):
    ``(heads -> which heads are split, offsets [batch], source count)``. ``splits`` collects each split term's
    ``("split", rounding gap [batch], squared noise [batch])`` (``Readout.split_gap``).

    A shared ``outer_norm`` is read right after the last term that names it (its place in the forward pass).
    """
    modes = [planned.mode(by) for planned in terms]
    modes = ["heads" if m == "sources" and (split is None or not any(split[0](p.parts))) else m
             for m, p in zip(modes, terms)]  # a block none of whose heads is split reads them whole
    last_user = {planned.term.outer_norm: k for k, planned in enumerate(terms) if planned.term.outer_norm}
    datas, outers = [], {}
    for k, planned in enumerate(terms):
        datas.append(read_term(layer, planned, modes[k], rows, positions, own=splits is not None))
        for path, last in last_user.items():
            if last == k:
                outers[path] = _frozen(module_at(layer, path), rows, positions, rows.shape[0])
                fit_errors.append(outers[path].fit_error)
    fit_errors.extend(d[key].fit_error for d in datas for key in ("post_norm", "stream_norm", "stream_norm_after")
                      if key in d)
    fit_errors.extend(d["pattern_error"] for d in datas if "pattern_error" in d)
    scores, biased = [], set()
    for k, planned in enumerate(terms):
        path = planned.term.outer_norm
        v, stream_constant, after_constant = directions[k]
        score = score_term(layer, planned, modes[k], datas[k], v, outers.get(path), path is not None and path not in biased,
                           None if split is None else (split[0](planned.parts),) + split[1:])
        biased.add(path)
        if not isinstance(stream_constant, float):  # a stream bias added with this term (ZAYA)
            score[:, -1] += stream_constant.to(score.device)
        before, after = datas[k].get("stream_norm"), datas[k].get("stream_norm_after")
        scores.append((score, datas[k].get("hyper"), before.scale if before is not None else None,
                       (after.scale, after_constant) if after is not None else None))
        if splits is not None and "split" in datas[k]:
            splits.append(("split", *datas[k]["split"]))
    return scores


def final_direction(model, plan: Plan, targets: torch.Tensor, contrasts: torch.Tensor | None):
    """``(probe, direction [batch, d_model], constant [batch])`` of the final head for these target tokens."""
    width = model.lm_head.weight.shape[-1]
    probe: NormProbe = identity_probe(width) if plan.family.final_norm == "none" else probe_norm(model.ln_final, width)
    weight = model.lm_head.weight
    probe = probe.to(weight.device)  # a norm without parameters (OLMo, nanochat) is probed on the CPU
    rows = weight[targets.to(weight.device)].float()
    bias = getattr(model.lm_head, "bias", None)
    head_bias = bias[targets.to(bias.device)].float() if bias is not None else 0.0
    if contrasts is not None:
        rows = rows - weight[contrasts.to(weight.device)].float()
        if bias is not None:
            head_bias = head_bias - bias[contrasts.to(bias.device)].float()
    rows = rows.to(probe.gain.device)
    rows = rows * plan.head_input_scale  # lm_head reads the final norm's output times it (MiniCPM)
    direction = plan.logit_scale * probe.center(probe.gain * rows)
    constant = plan.logit_scale * (_dot(rows, probe.bias) + torch.as_tensor(head_bias).to(rows.device))
    return probe, direction, constant


def _softcap(z: torch.Tensor, cap: float | None) -> torch.Tensor:
    return z if cap is None else cap * torch.tanh(z / cap)


def _scaled(scores: list, scale: torch.Tensor) -> list:
    """Every score group ``[batch, ...]`` times a per-prompt ``scale`` ``[batch]`` (a frozen stream norm's)."""
    return [s * scale.to(s.device).reshape(-1, *([1] * (s.dim() - 1))) for s in scores]


def decompose(model, plan: Plan, direction: torch.Tensor, positions: torch.Tensor, by: Granularity,
              stop: Stop | None = None, sources: Sources | None = None,
              offsets: torch.Tensor | None = None, splits: list | None = None) -> tuple[torch.Tensor, list[float]]:
    """``[batch, n_components]``: every term written before ``stop`` at the attributed positions, dotted with
    ``direction`` (a direction on the stream at ``stop``; None: the final norm's input), read in forward order.
    ``by="source"``: ``sources`` says which heads split into how many sources; ``offsets`` ``[batch]`` is where
    each prompt's own tokens start in the padded sequence.

    Returns the unscaled scores (multiply by the frozen norm's scale at ``stop``) and the post-norms' fit errors;
    ``splits`` (a list) collects what the model's own rounding is bounded with, unscaled: the split terms'
    ``("split", gap, squared noise)`` (see ``layer_scores``) and, after each whole block, ``("stream", squared
    noise)``: the stream around the block's adds, ``max(|before|, |after|)`` per channel, read along the direction
    there, squared, times the number of adds.
    """
    rows = torch.arange(positions.shape[0])
    embed_direction, per_layer = term_directions(model, plan, direction, stop)
    fit_errors: list[float] = []
    embed = _at(layer_input(model, 0), rows, positions)  # [batch, d_model], or [batch, streams, d_model]
    scores = [(embed * embed_direction.to(embed.device).unsqueeze(-2)).sum(-1) if embed.dim() == 3 else
              _dot(embed, embed_direction).unsqueeze(-1)]
    carried = [None]  # parallel streams: each score group's weight on every stream [batch, streams]
    if embed.dim() == 3:
        carried = [torch.eye(embed.shape[1], device=embed.device).expand(embed.shape[0], -1, -1)]
    previous = embed  # the stream before the block (its rounding bound, ``splits``)
    for i, terms in enumerate(plan.terms_before(stop)):
        split = None
        if by == "source":
            split = (lambda heads, i=i: sources.split(i, heads), offsets, sources.count)
        for score, hyper, before, after in layer_scores(model.layers[i], terms, per_layer[i], by, rows, positions,
                                                        fit_errors, split, splits):
            if before is not None:  # a norm on the stream scales everything written before it
                scores = _scaled(scores, before)
            if hyper is not None:  # streams <- comb^T streams, then the term is written with weights post
                post, comb = hyper
                if comb is not None:
                    carried = [torch.einsum("bjk,b...j->b...k", comb, weights) for weights in carried]
                carried.append(post)
            scores.append(score.to(scores[0].device))
            if after is not None:  # a norm right after the add scales it too; its bias joins the term's rest
                scores = _scaled(scores, after[0])
                scores[-1][:, -1] += torch.as_tensor(after[1]).to(scores[-1].device)
        if splits is not None and per_layer[i] and (stop is None or i < stop[0]):
            stream_after = _at(read_site(model.layers[i], "output"), rows, positions)
            splits.append(("stream", len(terms) * _stream_sumsq(previous, stream_after, per_layer[i][-1][0])))
            previous = stream_after
    if carried[0] is not None:  # the final collapse: each group's stream weights read along the collapse weights
        head = module_at(model, plan.family.collapse)
        collapse = plan.family.collapse_weights(head, _at(head.input, rows, positions))  # [batch, streams]
        weights = [torch.einsum("b...k,bk->b...", w, collapse) for w in carried]
        scores = [(scores[0] * weights[0]).sum(-1, keepdim=True)] + [s * w[:, None] for s, w in zip(scores[1:], weights[1:])]
    return torch.cat(scores, -1), fit_errors


def _stream_sumsq(before: torch.Tensor, after: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``[batch]``: ``sum((max(|before|, |after|) * v)^2)`` in float64 (streams ``[batch, (streams,) d_model]``)."""
    size = torch.maximum(before.abs(), after.to(before.device).abs()).double()
    v = v.to(size.device).double()
    return ((size * (v.unsqueeze(-2) if size.dim() == 3 else v)) ** 2).flatten(1).sum(-1).float()


def direct_logit_attribution(
    model,
    plan: Plan,
    positions: torch.Tensor,
    targets: torch.Tensor,
    contrasts: torch.Tensor | None = None,
    by: Granularity = "block",
    sources: Sources | None = None,
    offsets: torch.Tensor | None = None,
) -> Readout:
    """Attribute a logit (difference) inside a trace; see the module docstring.

    Args:
        model: the ``StandardizedTransformer`` being traced.
        plan: ``build_plan(model)``.
        positions: ``[batch]`` long, the attributed position of each prompt, an index into the padded sequence.
        targets, contrasts: ``[batch]`` long token ids (``contrasts`` optional: attribute the logit difference).
        by: ``"block"``, ``"head"``, ``"neuron"``, ``"expert"`` or ``"source"``.
        sources, offsets: ``by="source"``: the heads split and into how many sources (``plan.Sources``), and
            ``[batch]`` long, where each prompt's own tokens start in the padded sequence.
    """
    check_granularity(by)
    with torch.no_grad():
        rows = torch.arange(positions.shape[0])
        probe, direction, constant = final_direction(model, plan, targets, contrasts)
        # the rounding the self-check bounds is read only for a low-precision model (in float32 and float64 it is
        # far below the float32 floor of the check, and the reads cost time on small models)
        splits: list | None = [] if model.lm_head.weight.dtype in (torch.bfloat16, torch.float16) else None
        scores, fit_errors = decompose(model, plan, direction, positions, by, None, sources, offsets, splits=splits)
        if plan.family.final_norm != "module":  # no final norm, or it also ran before the blocks: read around it
            stream, normed = layer_output(model, len(model.layers) - 1), model.lm_head.input  # normed: [b, kept, d]
        else:
            stream, normed = model.ln_final.input, model.ln_final.output  # [batch, pos, d_model]
        x = _at(stream, rows, positions)
        y = _at(normed, rows, positions - (stream.shape[1] - normed.shape[1]))
        final: FrozenNorm = probe.freeze(x, y)
        fit_errors.append(final.fit_error)
        values = scores * final.scale.to(scores.device).unsqueeze(-1)
        head_out = model.lm_head.output  # [batch, kept, vocab]: the last `kept` positions (logits_to_keep)
        at_head = positions - (stream.shape[1] - head_out.shape[1])
        head_out = _at(head_out, rows, at_head)  # [batch, vocab]
        logits = _at(model.output.logits, rows, at_head)
        picked, out = head_out.gather(-1, targets.to(head_out.device)[:, None])[:, 0], logits.gather(-1, targets.to(logits.device)[:, None])[:, 0]
        head_error = (_softcap(picked * plan.logit_scale, plan.softcap) - out.to(picked.device)).abs().max()
        logit = picked * plan.logit_scale
        if contrasts is not None:
            picked_contrast = head_out.gather(-1, contrasts.to(head_out.device)[:, None])[:, 0]
            out_contrast = logits.gather(-1, contrasts.to(logits.device)[:, None])[:, 0]
            head_error = torch.maximum(
                head_error,
                (_softcap(picked_contrast * plan.logit_scale, plan.softcap) - out_contrast.to(picked.device)).abs().max(),
            )
            logit = logit - picked_contrast * plan.logit_scale
            out = out - out_contrast
        head_rows = model.lm_head.weight[targets.to(model.lm_head.weight.device)].float()
        if contrasts is not None:
            head_rows = head_rows - model.lm_head.weight[contrasts.to(model.lm_head.weight.device)].float()
        size = (_binade(picked) + (_binade(picked_contrast) if contrasts is not None else 0.0)) * abs(plan.logit_scale)
        return Readout(
            values=values.cpu(),
            constant=constant.cpu(),
            logit=logit.cpu(),
            output_logit=out.cpu(),
            head_error=head_error.cpu(),
            norm_fit_error=torch.tensor(max(fit_errors)),
            scale=final.scale.cpu(),
            **rounding_scales(x, direction, final.scale, y, head_rows * plan.logit_scale, splits, size, scores,
                              computed_in=model.lm_head.weight.dtype),
        )


def _binade(x: torch.Tensor) -> torch.Tensor:
    """``2^floor(log2 |x|)`` (0 at 0): a value read in a low precision is off by at most ``u`` times this."""
    mantissa, exponent = torch.frexp(x.float())
    return torch.where(x == 0, torch.zeros_like(mantissa), torch.ldexp(torch.ones_like(mantissa), exponent - 1))


def rounding_scales(stream, direction, scale, output, head, splits, size, scores, extra_adds: int = 0,
                    computed_in: torch.dtype = torch.float32) -> dict:
    """The ``Readout`` fields the self-check bounds the model's own rounding with (all ``[batch]``, on the CPU).

    ``stream`` ``[batch, d_model]`` entering the frozen norm, read along ``direction`` times ``scale``; ``output``
    the norm's output read along ``head``; ``splits`` the split terms' unscaled ``(gap, squared noise)``; ``size``
    the logits' own magnitude; ``scores`` ``[batch, n_components]`` unscaled (where a non-finite number starts);
    ``extra_adds`` the adds after the last whole block (before a direction's norm), bounded with ``stream``;
    ``computed_in`` the dtype the model computed in (``unit_roundoff``).
    """
    def norm2(a, b):  # in float64: squares of large finite activations must not overflow
        return ((a.double() * b.to(a.device).double()) ** 2).sum(-1).sqrt().float()

    scale = scale.to(stream.device)
    zero = torch.zeros(stream.shape[0], device=stream.device)
    splits = splits or []
    gap = sum((e[1].to(stream.device) for e in splits if e[0] == "split"), zero) * scale
    noise = sum((e[2].to(stream.device) for e in splits if e[0] == "split"), zero).sqrt() * scale.abs()
    adds = sum((e[1].to(stream.device) for e in splits if e[0] == "stream"), zero)
    adds = adds + extra_adds * norm2(stream, direction).to(adds.device) ** 2  # adds after the last whole block
    finite = torch.isfinite(direction).all(-1) & torch.isfinite(head.to(direction.device)).all(-1)
    return {
        "unit_roundoff": torch.full((stream.shape[0],), torch.finfo(computed_in).eps / 2),
        "logit_size": torch.as_tensor(size, dtype=torch.float32).expand(stream.shape[0]).cpu(),
        "head_noise": norm2(output, head).cpu(),
        "stream_noise": (adds.sqrt() * scale.abs()).cpu(),
        "split_gap": gap.cpu(),
        "split_noise": noise.cpu(),
        "finite_head": finite.float().cpu(),
        "first_nonfinite": _first_nonfinite(scores).cpu(),
    }


def _first_nonfinite(scores: torch.Tensor) -> torch.Tensor:
    """``[batch]`` float: the first column of ``scores`` that is not finite, or -1."""
    bad = ~torch.isfinite(scores)
    first = torch.argmax(bad.to(torch.uint8), -1).float()  # argmax returns the first maximum
    return torch.where(bad.any(-1), first, torch.full_like(first, -1.0))


def direction_attribution(
    model,
    plan: Plan,
    positions: torch.Tensor,
    direction: torch.Tensor,
    stop: Stop,
    reads: str,
    by: Granularity = "block",
) -> Readout:
    """Attribute ``norm(stream) @ direction`` inside a trace, where ``norm`` (the module at ``reads`` in block
    ``stop[0]``) reads the stream at ``stop``: the terms written before it, through the norm frozen at its input.

    Args:
        direction: ``[batch, d_model]`` (or ``[d_model]``), a direction on the norm's output (a probe, a query).
        stop: ``plan.stop_before(layer, sublayer)``; reads: that sublayer's ``Term.reads``.
    """
    check_granularity(by)
    with torch.no_grad():
        rows = torch.arange(positions.shape[0])
        norm = module_at(model.layers[stop[0]], reads)
        probe = probe_norm(norm, direction.shape[-1]).to(model.lm_head.weight.device)
        v = direction.float().to(probe.gain.device).expand(positions.shape[0], -1)
        # the rounding the self-check bounds is read only for a low-precision model (in float32 and float64 it is
        # far below the float32 floor of the check, and the reads cost time on small models)
        splits: list | None = [] if model.lm_head.weight.dtype in (torch.bfloat16, torch.float16) else None
        pulled = probe.center(probe.gain * v)
        scores, fit_errors = decompose(model, plan, pulled, positions, by, stop, splits=splits)
        stream = _at(read_site(norm, "input", positions.shape[0]), rows, positions)
        output = _at(read_site(norm, "output", positions.shape[0]), rows, positions)
        frozen = probe.freeze(stream, output)
        fit_errors.append(frozen.fit_error)
        own = _dot(output, v)  # the model's own normed stream, read along the direction
        return Readout(
            values=(scores * frozen.scale.to(scores.device).unsqueeze(-1)).cpu(),
            constant=_dot(v, probe.bias).cpu(),
            logit=own.cpu(),
            output_logit=own.cpu(),
            head_error=torch.zeros(()),
            norm_fit_error=torch.tensor(max(fit_errors)),
            scale=frozen.scale.cpu(),
            **rounding_scales(stream, pulled, frozen.scale, output, v, splits, 0.0, scores,
                              len(plan.terms_before(stop)[stop[0]]) if len(plan.terms_before(stop)) > stop[0] else 0,
                              computed_in=model.lm_head.weight.dtype),
        )
