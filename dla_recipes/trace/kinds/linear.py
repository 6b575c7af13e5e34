"""Term kind ``"linear"``: heads or neurons through one output projection (``nn.Linear`` or GPT-2's ``Conv1D``).

The term writes ``projection(inputs)`` (then maybe a second map, ``then``; maybe gated channel by channel,
``Neurons.output_gate``), so its part along a direction ``u`` on its write splits exactly: pull ``u`` back through the
projection onto its input, ``W^T u`` ``[batch, heads * head_dim]`` or ``[batch, d_mlp]``, and multiply by the inputs
the model fed it; a head's part is the sum over its ``head_dim`` slice. The projection's bias goes to the term's rest.
(What the term really wrote, read where it is added, is compared with its parts in ``trace.terms``: its rounding in
low precision, an edit after the projection.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...families import Neurons
from ...math.linalg import linear_pullback, on
from ...plan.build import module_at
from ...plan.plan import PlannedTerm
from ..readers import Sites, at, read_site
from . import TermAt


@dataclass
class LinearReads:
    """What a linear split reads at the attributed positions, in forward order.

    Attributes:
        inputs: ``[batch, in_features]`` the projection's input (heads flattened), in the model's dtype.
        output_gate: ``[batch, out_features]`` ``sigmoid(gate)`` multiplying the output (``Neurons.output_gate``).
    """

    inputs: torch.Tensor
    output_gate: torch.Tensor | None = None


def read(layer, planned: PlannedTerm, mode: str, sites: Sites) -> LinearReads:
    """Read the projection's input (then the output gate) at the sites."""
    split, batch = planned.term.split, sites.batch
    projection = module_at(layer, split.projection)
    # in the model's dtype: the product with the float32 pull-back reads it in float32 (type promotion), so no
    # float32 copy of [n, in_features] is made first (bit for bit the same parts)
    reads = LinearReads(at(read_site(projection, "input", batch), sites, keep=True).flatten(1))
    gate = split.output_gate if isinstance(split, Neurons) else None
    if gate is not None:  # sigmoid(gate) multiplies the projection's output channel by channel
        reads.output_gate = torch.sigmoid(at(read_site(module_at(layer, gate), "output", batch), sites))
    return reads


def pull_back(layer, planned: PlannedTerm, u: torch.Tensor, rest, output_gate: torch.Tensor | None = None):
    """``(pulled [batch, in_features], rest, bias)``: ``u`` on the term's write pulled back through the split's ``then``
    (its bias added to ``rest``), the output gate and the projection (its bias returned)."""
    split = planned.term.split
    if split.then is not None:  # a second map after the projection: pull u back through it first
        u, then_bias = linear_pullback(module_at(layer, split.then), u, False)
        rest = rest + then_bias
    if output_gate is not None:
        u = u * output_gate.to(u.device)
    pulled, bias = linear_pullback(module_at(layer, split.projection), u, planned.transposed)
    return pulled, rest, bias


def static(layer, planned: PlannedTerm, mode: str, u: torch.Tensor, rest):
    """``(pulled [batch, in_features], rest)``: what ``score`` needs that depends only on the weights and ``u`` (the
    pull-back through ``then`` and the projection, their biases added to ``rest``); None where an output gate,
    read in the forward pass, stands between (``Neurons.output_gate``)."""
    if getattr(planned.term.split, "output_gate", None) is not None:
        return None
    pulled, rest, bias = pull_back(layer, planned, u, rest)
    return pulled, rest + bias


def score(term: TermAt, reads: LinearReads, u: torch.Tensor, rest, split=None, pulled: tuple | None = None):
    """``(parts [batch, parts], rest, None)``: each head's or neuron's part along ``u`` (``pulled``: ``static``'s,
    made already: ``u`` and ``rest`` are then not read)."""
    layer, planned, mode = term
    if pulled is None:
        pulled = static(layer, planned, mode, u, rest)
    if pulled is None:  # the output gate multiplies u channel by channel before the projection
        back, rest, bias = pull_back(layer, planned, u, rest, reads.output_gate)
        pulled = back, rest + bias
    parts = reads.inputs * on(pulled[0], reads.inputs.device)  # [n, in]: one part per input when parts are 1 wide
    if planned.part_width != 1:
        parts = parts.unflatten(-1, (planned.parts, planned.part_width)).sum(-1)
    return parts, pulled[1], None
