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
   final collapse at the end.
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

from .frozen_norm import FrozenNorm, NormProbe, probe_norm
from .plan import Granularity, Plan, PlannedTerm, Stop, check_granularity, module_at
from .readers import layer_input, read_site


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
        norm_fit_error: ``[]`` the largest relative fit error of a frozen norm (final and post-norms).
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

    _SCALARS = ("constant", "logit", "output_logit", "head_error", "norm_fit_error", "scale",
                "logit_size", "head_noise", "stream_noise", "split_gap", "split_noise", "finite_head", "first_nonfinite")

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

    Returns ``(embed_direction, per_layer)`` where ``per_layer[i][k]`` is ``(direction, constant)`` for term ``k``
    of block ``i``: the term's write dotted with ``direction`` is its share of ``x @ direction``, and ``constant``
    ``[batch]`` is what a stream bias added with it (ZAYA's residual bias) contributes.
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
            if term.stream_scale is not None:
                v_before = v * _param(layer, term.stream_scale).to(v.device)
            else:
                v_before = v
            if term.stream_bias is not None:
                constant = _dot(v_before, _param(layer, term.stream_bias))
            entries.append((v, constant))
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
    probe = probe_norm(norm)
    stream = _at(read_site(norm, "input", batch), rows, positions)
    return probe.freeze(stream, _at(read_site(norm, "output", batch), rows, positions))


def read_term(layer, planned: PlannedTerm, mode: str | None, rows, positions) -> dict:
    """Read, in forward order, what scoring this term needs at the attributed positions (a few ``[batch, ...]``)."""
    term, batch = planned.term, rows.shape[0]
    data: dict = {}
    if term.hyper is not None:  # parallel streams: the mixing weights this term is written and carried with
        post, comb = module_at(layer, term.hyper).output[:2]
        data["hyper"] = (_at(post, rows, positions), _at(comb, rows, positions))
    if mode is None:
        data["value"] = _at(read_site(layer, term.output, batch), rows, positions)
        return data
    if term.router is not None:
        data.update(_read_routed(layer, term, rows, positions))
    elif mode in ("heads", "neurons"):
        data["inputs"] = _at(read_site(module_at(layer, term.projection), "input", batch), rows, positions).flatten(1)
        if term.then is None:  # the projection's own (low-precision) output: what its parts' rounding is read against
            data["own"] = _at(read_site(module_at(layer, term.projection), "output", batch), rows, positions).flatten(1)
    else:
        if term.shared is not None and term.shared_first:
            data["shared"] = _at(read_site(module_at(layer, term.shared), "input", batch), rows, positions)
        args, kwargs = module_at(layer, term.projection).inputs
        hidden, index, weights = (list(args) + [kwargs[k] for k in ("hidden_states", "top_k_index", "top_k_weights") if k in kwargs])[:3]
        tokens = (rows.to(hidden.device) * (hidden.shape[0] // batch) + positions.to(hidden.device))
        data["hidden"], data["index"], data["weights"] = hidden[tokens].float(), index[tokens], weights[tokens].float()
        if term.shared is not None and not term.shared_first:
            data["shared"] = _at(read_site(module_at(layer, term.shared), "input", batch), rows, positions)
        if term.shared_gate is not None:
            data["gate"] = torch.sigmoid(_at(read_site(module_at(layer, term.shared_gate), "output", batch), rows, positions))
    if term.post_norm is not None:
        data["post_norm"] = _frozen(module_at(layer, term.post_norm), rows, positions, batch)
    return data


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


def _expert_scores(layer, planned: PlannedTerm, mode: str, data: dict, u: torch.Tensor):
    """``(parts [batch, E or E * d_expert (+ shared)], rest)`` for a fused mixture of experts, at one token per row.

    Each routed expert's neurons are recomputed from the model's own routing (the experts module's inputs) and
    weights: ``act = act_fn(gate) * up`` of ``gate_up_proj[e] @ x``; the expert writes ``w * down_proj[e] @ act``.
    """
    term = planned.term
    experts = module_at(layer, term.projection)
    gate_up, down = experts.gate_up_proj, experts.down_proj  # [E, 2I, d], [E, d, I]
    limit = getattr(experts._module, "limit", None)  # a SwiGLU clamp (DeepSeek-V4)
    u, hidden = u.to(down.device), data["hidden"].to(down.device)
    index, weights = data["index"].to(down.device), data["weights"].to(down.device)
    routed = index < planned.experts  # index E means "no expert" (a dropped slot)
    neurons = torch.zeros(u.shape[0], planned.experts, planned.expert_width, device=down.device)
    for e in torch.unique(index[routed]).tolist():  # only the experts that fired: at most batch * top_k
        weight = (weights * ((index == e) & routed)).sum(-1)  # [batch] this expert's routing weight
        rows = weight.nonzero()[:, 0]
        gate, up = matmul_f32(hidden[rows], gate_up[e], transpose=True).chunk(2, dim=-1)
        if limit is not None:
            gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
        act = experts.act_fn(gate) * up  # [rows, I]
        written = matmul_f32(u[rows], down[e])  # each neuron's output column, read along u: [rows, I]
        neurons[rows, e] = weight[rows, None] * act * written
    neurons = neurons.to(u.device)
    parts = [neurons.sum(-1) if mode == "experts" else neurons.flatten(1)]
    rest: torch.Tensor | float = 0.0
    if term.shared is not None:
        pulled, rest = _linear_pullback(module_at(layer, term.shared), u, transposed=False)
        gate = data["gate"].to(pulled.device) if "gate" in data else 1.0
        shared = data["shared"].to(pulled.device) * pulled * gate
        rest = rest * (gate[:, 0] if "gate" in data else 1.0)
        parts.append(shared.sum(-1, keepdim=True) if mode == "experts" else shared)
    return torch.cat([p.to(u.device) for p in parts], -1), rest


def score_term(layer, planned: PlannedTerm, mode: str | None, data: dict, v: torch.Tensor, outer: FrozenNorm | None,
               outer_bias: bool) -> torch.Tensor:
    """``[batch, parts + 1]``: the term's parts (heads, neurons, experts; none at block level), then its rest."""
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
    if term.router is not None:
        parts = _routed_scores(layer, planned, mode, data, u)
        rest = rest + _dot(u, _param(layer, term.projection_bias)) if term.projection_bias else rest
    elif mode in ("heads", "neurons"):
        if term.then is not None:  # a second map after the projection: pull u back through it first
            u, then_bias = _linear_pullback(module_at(layer, term.then), u, False)
            rest = rest + then_bias
        pulled, bias = _linear_pullback(module_at(layer, term.projection), u, planned.transposed)
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
                 splits: list | None = None):
    """``(scores [batch, n], hyper)`` of each of one block's terms: all its reads first, in forward order, then the
    arithmetic. ``hyper`` is the term's ``(post, comb)`` on a family with parallel streams, else None. ``splits``
    collects each split term's ``("split", rounding gap [batch], squared noise [batch])`` (``Readout.split_gap``).

    A shared ``outer_norm`` is read right after the last term that names it (its place in the forward pass).
    """
    modes = [planned.mode(by) for planned in terms]
    last_user = {planned.term.outer_norm: k for k, planned in enumerate(terms) if planned.term.outer_norm}
    datas, outers = [], {}
    for k, planned in enumerate(terms):
        datas.append(read_term(layer, planned, modes[k], rows, positions))
        for path, last in last_user.items():
            if last == k:
                outers[path] = _frozen(module_at(layer, path), rows, positions, rows.shape[0])
                fit_errors.append(outers[path].fit_error)
    fit_errors.extend(d["post_norm"].fit_error for d in datas if "post_norm" in d)
    scores, biased = [], set()
    for k, planned in enumerate(terms):
        path = planned.term.outer_norm
        v, stream_constant = directions[k]
        score = score_term(layer, planned, modes[k], datas[k], v, outers.get(path), path is not None and path not in biased)
        biased.add(path)
        if not isinstance(stream_constant, float):  # a stream bias added with this term (ZAYA)
            score[:, -1] += stream_constant.to(score.device)
        scores.append((score, datas[k].get("hyper")))
        if splits is not None and "split" in datas[k]:
            splits.append(("split", *datas[k]["split"]))
    return scores


def final_direction(model, plan: Plan, targets: torch.Tensor, contrasts: torch.Tensor | None):
    """``(probe, direction [batch, d_model], constant [batch])`` of the final head for these target tokens."""
    probe: NormProbe = probe_norm(model.ln_final)
    weight = model.lm_head.weight
    rows = weight[targets.to(weight.device)].float()
    bias = getattr(model.lm_head, "bias", None)
    head_bias = bias[targets.to(bias.device)].float() if bias is not None else 0.0
    if contrasts is not None:
        rows = rows - weight[contrasts.to(weight.device)].float()
        if bias is not None:
            head_bias = head_bias - bias[contrasts.to(bias.device)].float()
    rows = rows.to(probe.gain.device)
    direction = plan.logit_scale * probe.center(probe.gain * rows)
    constant = plan.logit_scale * (_dot(rows, probe.bias) + torch.as_tensor(head_bias).to(rows.device))
    return probe, direction, constant


def _softcap(z: torch.Tensor, cap: float | None) -> torch.Tensor:
    return z if cap is None else cap * torch.tanh(z / cap)


def decompose(model, plan: Plan, direction: torch.Tensor, positions: torch.Tensor, by: Granularity,
              stop: Stop | None = None, splits: list | None = None) -> tuple[torch.Tensor, list[float]]:
    """``[batch, n_components]``: every term written before ``stop`` at the attributed positions, dotted with
    ``direction`` (a direction on the stream at ``stop``; None: the final norm's input), read in forward order.

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
    for i, terms in enumerate(plan.terms_before(stop)):
        for score, hyper in layer_scores(model.layers[i], terms, per_layer[i], by, rows, positions, fit_errors, splits):
            if hyper is not None:  # streams <- comb^T streams, then the term is written with weights post
                post, comb = hyper
                carried = [torch.einsum("bjk,b...j->b...k", comb, weights) for weights in carried]
                carried.append(post)
            scores.append(score.to(scores[0].device))
        if splits is not None and per_layer[i] and (stop is None or i < stop[0]):
            after = _at(read_site(model.layers[i], "output"), rows, positions)
            splits.append(("stream", len(terms) * _stream_sumsq(embed if i == 0 else before, after, per_layer[i][-1][0])))
            before = after
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
) -> Readout:
    """Attribute a logit (difference) inside a trace; see the module docstring.

    Args:
        model: the ``StandardizedTransformer`` being traced.
        plan: ``build_plan(model)``.
        positions: ``[batch]`` long, the attributed position of each prompt, an index into the padded sequence.
        targets, contrasts: ``[batch]`` long token ids (``contrasts`` optional: attribute the logit difference).
        by: ``"block"``, ``"head"``, ``"neuron"`` or ``"expert"``.
    """
    check_granularity(by)
    with torch.no_grad():
        rows = torch.arange(positions.shape[0])
        probe, direction, constant = final_direction(model, plan, targets, contrasts)
        splits: list = []
        scores, fit_errors = decompose(model, plan, direction, positions, by, splits=splits)
        stream = model.ln_final.input  # [batch, pos, d_model]
        x, y = _at(stream, rows, positions), _at(model.ln_final.output, rows, positions)
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
            **rounding_scales(x, direction, final.scale, y, head_rows * plan.logit_scale, splits, size, scores),
        )


def _binade(x: torch.Tensor) -> torch.Tensor:
    """``2^floor(log2 |x|)`` (0 at 0): a value read in a low precision is off by at most ``u`` times this."""
    mantissa, exponent = torch.frexp(x.float())
    return torch.where(x == 0, torch.zeros_like(mantissa), torch.ldexp(torch.ones_like(mantissa), exponent - 1))


def rounding_scales(stream, direction, scale, output, head, splits, size, scores, extra_adds: int = 0) -> dict:
    """The ``Readout`` fields the self-check bounds the model's own rounding with (all ``[batch]``, on the CPU).

    ``stream`` ``[batch, d_model]`` entering the frozen norm, read along ``direction`` times ``scale``; ``output``
    the norm's output read along ``head``; ``splits`` the split terms' unscaled ``(gap, squared noise)``; ``size``
    the logits' own magnitude; ``scores`` ``[batch, n_components]`` unscaled (where a non-finite number starts);
    ``extra_adds`` the adds after the last whole block (before a direction's norm), bounded with ``stream``.
    """
    def norm2(a, b):  # in float64: squares of large finite activations must not overflow
        return ((a.double() * b.to(a.device).double()) ** 2).sum(-1).sqrt().float()

    scale = scale.to(stream.device)
    zero = torch.zeros(stream.shape[0], device=stream.device)
    gap = sum((e[1].to(stream.device) for e in splits if e[0] == "split"), zero) * scale
    noise = sum((e[2].to(stream.device) for e in splits if e[0] == "split"), zero).sqrt() * scale.abs()
    adds = sum((e[1].to(stream.device) for e in splits if e[0] == "stream"), zero)
    adds = adds + extra_adds * norm2(stream, direction).to(adds.device) ** 2  # adds after the last whole block
    finite = torch.isfinite(direction).all(-1) & torch.isfinite(head.to(direction.device)).all(-1)
    return {
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
        probe = probe_norm(norm)
        v = direction.float().to(probe.gain.device).expand(positions.shape[0], -1)
        splits: list = []
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
                              len(plan.terms_before(stop)[stop[0]]) if len(plan.terms_before(stop)) > stop[0] else 0),
        )
