"""Term kind ``"routed"``: grouped experts behind a top-k router (ScatterMoE layout: JetMoE's attention and MLP).

The router's output is ``(index_sorted_experts, batch_index, batch_gates, expert_size, logits)`` and the grouped
output projection's input holds each routed slot's rows grouped by expert (``weight [E, d_model, in]``). A routed
slot's part is its gate times its row times the expert's output columns read along ``u``; slot ``s`` owns heads
``s * in / head_dim ...`` (``Routed(parts="heads")``), or the part goes to its expert (``by="expert"``) or expert neurons.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...math.linalg import dot, matmul_f32
from ...plan.build import module_at
from ...plan.plan import PlannedTerm
from ..readers import Sites, param
from . import TermAt


@dataclass
class RoutedReads:
    """The attributed tokens' routed rows: ``routed [batch, top_k, in]``, ``expert``, ``gate`` and ``slot``
    ``[batch, top_k]``."""

    routed: torch.Tensor
    expert: torch.Tensor
    gate: torch.Tensor
    slot: torch.Tensor


def read(layer, planned: PlannedTerm, mode: str, sites: Sites) -> RoutedReads:
    """The attributed tokens' rows of a grouped-experts projection's input, with their experts, gates and slots."""
    grouped_experts = planned.term.split
    router = module_at(layer, grouped_experts.router)
    sorted_experts, batch_index, gates, _, _ = router.output
    grouped, sizes = module_at(layer, grouped_experts.projection).inputs[0][:2]  # (rows grouped by expert, rows per expert)
    top_k = int(router._module.top_k)
    seq = batch_index.numel() // (sites.batch * top_k)
    tokens = sites.rows.to(batch_index.device) * seq + sites.positions.to(batch_index.device)
    order = torch.argsort(batch_index, stable=True).view(-1, top_k)[tokens]  # [batch, top_k] grouped rows
    ends = torch.cumsum(torch.as_tensor(sizes, device=order.device), 0)
    return RoutedReads(
        routed=grouped[order].float(),  # [batch, top_k, in]
        expert=torch.bucketize(order, ends, right=True),  # [batch, top_k]
        gate=gates[order].float(),
        slot=sorted_experts[order] % top_k,
    )


def parts_of(layer, planned: PlannedTerm, mode: str, reads: RoutedReads, u: torch.Tensor) -> torch.Tensor:
    """``[batch, parts]`` for grouped experts: per head of each routed slot, or per expert / expert neuron."""
    weight = module_at(layer, planned.term.split.projection).weight  # [E, d_model, in]
    batch, top_k, width = reads.routed.shape
    per_input = torch.zeros(batch, top_k, width, device=weight.device)
    u, expert = u.to(weight.device), reads.expert.to(weight.device)
    routed, gate = reads.routed.to(weight.device), reads.gate.to(weight.device)
    for e in torch.unique(expert).tolist():  # only the experts that fired: at most batch * top_k
        rows, slots = (expert == e).nonzero(as_tuple=True)
        columns = matmul_f32(u[rows], weight[e])  # [rows, in]: each input feature's output column, read along u
        per_input[rows, slots] = gate[rows, slots, None] * routed[rows, slots] * columns
    per_input = per_input.to(reads.routed.device)
    rows = torch.arange(batch)
    if mode == "heads":  # slot s owns heads s * (in / head_dim) ... in its own slot order
        heads = per_input.unflatten(-1, (-1, planned.part_width)).sum(-1)  # [batch, top_k, heads per slot]
        out = torch.zeros(batch, top_k, heads.shape[-1], device=u.device)
        out[rows[:, None], reads.slot.to(u.device)] = heads
        return out.flatten(1)
    out = torch.zeros(batch, planned.experts, width, device=u.device)
    out[rows[:, None], reads.expert.to(u.device)] = per_input
    return out.sum(-1) if mode == "experts" else out.flatten(1)


def score(term: TermAt, reads: RoutedReads, u: torch.Tensor, rest, split=None):
    """``(parts [batch, parts], rest, None)``; a bias added once after the projection goes to ``rest``."""
    layer, planned, mode = term
    parts = parts_of(layer, planned, mode, reads, u)
    bias = planned.term.split.projection_bias
    rest = rest + dot(u, param(layer, bias)) if bias else rest
    return parts, rest, None
