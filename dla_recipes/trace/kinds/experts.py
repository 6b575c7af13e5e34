"""Term kind ``"experts"``: a fused mixture of experts, recomputed from the model's own routing and weights.

Each routed expert's neurons are recomputed, only for the experts that fired, from the experts module's inputs
(hidden rows, ``top_k_index``, ``top_k_weights``) and weights as the term's ``ExpertsLayout`` describes them (fused
or separate gate/up, ``[out, in]`` or ``[in, out]``, biases, the module's own gating function, router-scaled
inputs); expert ``e`` writes ``w * (down[e] @ act + down_bias[e])``. A dense shared expert (``Experts.shared``, maybe
gated) is a linear split of its own. No ``[batch, d_mlp, d_model]`` tensor is ever built.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...errors import FamilyTableError
from ...math.linalg import dot, linear_pullback, matmul_f32
from ...plan.build import module_at
from ...plan.plan import PlannedTerm
from ..readers import Sites, at, read_site
from . import TermAt


@dataclass
class ExpertReads:
    """What recomputing a fused mixture of experts reads, in forward order.

    Attributes:
        hidden: ``[batch, d]`` the experts' input row per attributed token (``[batch, k, d]`` when router-scaled).
        index: ``[batch, k]`` the routed experts (``E``: no expert).  weights: ``[batch, k]`` their routing weights.
        shared: ``[batch, d_shared]`` the shared expert's down projection's input (None: no shared expert).
        shared_gate: ``[batch, 1]`` ``sigmoid`` of the shared expert's gate (None: ungated).
    """

    hidden: torch.Tensor
    index: torch.Tensor
    weights: torch.Tensor
    shared: torch.Tensor | None = None
    shared_gate: torch.Tensor | None = None


def read(layer, planned: PlannedTerm, mode: str, sites: Sites) -> ExpertReads:
    """Read the routing and, before or after it as the model runs them, the shared expert and its gate."""
    moe, batch = planned.term.split, sites.batch
    shared = None
    if moe.shared is not None and moe.shared_first:
        shared = at(read_site(module_at(layer, moe.shared), "input", batch), sites)
    reads = ExpertReads(*read_routing(layer, planned, sites))
    if moe.shared is not None and not moe.shared_first:
        shared = at(read_site(module_at(layer, moe.shared), "input", batch), sites)
    reads.shared = shared
    if moe.shared_gate is not None:
        reads.shared_gate = torch.sigmoid(at(read_site(module_at(layer, moe.shared_gate), "output", batch), sites))
    return reads


def read_routing(layer, planned: PlannedTerm, sites: Sites) -> tuple:
    """The attributed tokens' expert inputs, experts and routing weights, from the experts module's own inputs.

    Returns ``(hidden, index, weights)``: ``hidden`` ``[batch, d]`` (or ``[batch, k, d]``, one row per slot, when the
    inputs are router-scaled), ``index [batch, k]`` (``E``: no expert) and ``weights [batch, k]``.
    """
    moe, batch, rows, positions = planned.term.split, sites.batch, sites.rows, sites.positions
    args, kwargs = module_at(layer, moe.projection).inputs
    names = ("hidden_states", "top_k_index", "top_k_weights")
    values = list(args) + [kwargs[k] for k in names if k in kwargs]
    hidden = values[0]
    if moe.layout.scaled_inputs:  # every expert on every token, each row pre-multiplied by its routing score
        hidden = hidden.reshape(planned.experts, -1, hidden.shape[-1])  # [E, tokens, d]
        tokens = rows.to(hidden.device) * (hidden.shape[1] // batch) + positions.to(hidden.device)
        routed = hidden[:, tokens].transpose(0, 1).float()  # [batch, E, d]
        index = torch.arange(planned.experts, device=routed.device).expand(len(sites), -1)
        index = torch.where((routed != 0).any(-1), index, planned.experts)  # a zero row: not routed
        return routed, index, torch.ones(index.shape, device=routed.device)
    if len(values) < 3:
        raise FamilyTableError(
            f"the experts module {moe.projection} was called with {len(values)} input(s), not (hidden, top_k_index, "
            "top_k_weights): its family table entry's ExpertsLayout does not describe it (router-scaled inputs?)"
        )
    hidden = hidden.reshape(-1, hidden.shape[-1])  # [tokens, d] (DBRX passes [batch, pos, d])
    index, weights = values[1], values[2]
    index, weights = index.reshape(hidden.shape[0], -1), weights.reshape(hidden.shape[0], -1)
    tokens = rows.to(hidden.device) * (hidden.shape[0] // batch) + positions.to(hidden.device)
    return hidden[tokens].float(), index[tokens], weights[tokens].float()


def expert_weight(experts, path: str, e: int, count: int) -> torch.Tensor:
    """Expert ``e``'s slice of the weight at ``path`` below the experts module (``[E, a, b]`` or ``[E * a, b]``)."""
    weight = module_at(experts, path)
    return weight.view(count, -1, weight.shape[-1])[e] if weight.dim() == 2 else weight[e]


def expert_activations(experts, layout, e: int, count: int, x: torch.Tensor) -> torch.Tensor:
    """``[rows, I]``: expert ``e``'s neurons on its input rows ``x [rows, d]``, as ``layout`` says it computes them."""

    def project(path):
        return matmul_f32(x, expert_weight(experts, path, e, count), transpose=path not in layout.transposed)

    if layout.gate_up is None:  # separate gate and up weights
        return module_at(experts, layout.activation)(project(layout.gate)) * project(layout.up)
    fused = project(layout.gate_up)  # [rows, 2I]
    if layout.gate_up_bias is not None:
        fused = fused + module_at(experts, layout.gate_up_bias)[e].float().to(fused.device)
    if layout.gating is not None:  # the module's own gating function: its halves, clamps, scales
        return getattr(experts, layout.gating)(fused)
    gate, up = fused.chunk(2, dim=-1)
    return module_at(experts, layout.activation)(gate) * up


def score(term: TermAt, reads: ExpertReads, u: torch.Tensor, rest, split=None):
    """``(parts [batch, E or E * d_expert (+ shared)], rest, None)`` for a fused mixture of experts, one token a row.

    Each routed expert's neurons are recomputed from the model's own routing (the experts module's inputs) and
    weights, as the term's ``ExpertsLayout`` describes them; the expert writes ``w * (down[e] @ act + down_bias[e])``.
    A down bias belongs to its expert's part (``by="expert"``) or to the term's rest (``by="neuron"``).
    """
    layer, planned, mode = term
    moe = planned.term.split
    layout = moe.layout
    experts = module_at(layer, moe.projection)
    down = module_at(experts, layout.down)
    count = planned.experts
    v = u.to(down.device) * planned.routed_scale if planned.routed_scale != 1.0 else u.to(down.device)
    hidden = reads.hidden.to(down.device)
    index, weights = reads.index.to(down.device), reads.weights.to(down.device)
    routed = index < count  # index E means "no expert" (a dropped slot)
    neurons = torch.zeros(u.shape[0], count, planned.expert_width, device=down.device)
    biases = torch.zeros(u.shape[0], count, device=down.device)
    for e in torch.unique(index[routed]).tolist():  # only the experts that fired: at most batch * top_k
        # a token may route to one expert in several slots (DeepSeek-V4's hash routing: a tid2eid row that repeats
        # an expert): the model adds each slot's output, so each slot's part is added here too, never overwritten
        rows, slots = ((index == e) & routed).nonzero(as_tuple=True)
        at_e = (rows, torch.full_like(rows, e))
        weight = weights[rows, slots]  # [rows] this expert's routing weight
        x = hidden[rows, slots] if hidden.dim() == 3 else hidden[rows]
        act = expert_activations(experts, layout, e, count, x)  # [rows, I]
        w_down = expert_weight(experts, layout.down, e, count)
        written = matmul_f32(v[rows], w_down, transpose=layout.down in layout.transposed)  # [rows, I] along v
        neurons.index_put_(at_e, weight[:, None] * act.to(down.device) * written, accumulate=True)
        if layout.down_bias is not None:
            biases.index_put_(at_e, weight * dot(v[rows], module_at(experts, layout.down_bias)[e].float()),
                              accumulate=True)
    neurons, biases = neurons.to(u.device), biases.to(u.device)
    if mode == "experts":
        parts, own_rest = [neurons.sum(-1) + biases], 0.0
    else:
        parts, own_rest = [neurons.flatten(1)], biases.sum(-1)
    if moe.shared is not None:
        s = u * planned.shared_scale if planned.shared_scale != 1.0 else u
        pulled, bias = linear_pullback(module_at(layer, moe.shared), s, transposed=False)
        gate = reads.shared_gate.to(pulled.device) if reads.shared_gate is not None else 1.0
        shared = reads.shared.to(pulled.device) * pulled * gate
        own_rest = own_rest + bias * (gate[:, 0] if reads.shared_gate is not None else 1.0)
        parts.append(shared.sum(-1, keepdim=True) if mode == "experts" else shared)
    return torch.cat([p.to(u.device) for p in parts], -1), rest + own_rest, None

