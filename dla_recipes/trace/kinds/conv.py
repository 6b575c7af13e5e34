"""Term kind ``"conv"``: heads or neurons whose sublayer output then passes through a causal position convolution.

The module at ``position_conv`` (``Heads`` / ``Neurons``) computes ``x + causal_depthwise_conv(mask * x)`` over positions (Inkling's short
convolutions), so the term at position ``p`` is made of the projection's inputs at ``p - K + 1 ... p``: the direction
at lag ``l`` is ``u * (1[l = 0] + w[:, K - 1 - l] * mask_l)``, pulled back through the projection and read along the
projection's input at ``p - l``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...math.linalg import linear_pullback
from ...plan.build import module_at
from ...plan.plan import PlannedTerm
from ..readers import Sites, read_site
from . import TermAt


@dataclass
class ConvReads:
    """The projection's inputs at the ``K`` lags ``p, p - 1, ... p - K + 1``.

    Attributes:
        inputs: ``[batch, K, in_features]``.
        valid: ``[batch, K]`` 1 where the lag is inside the sequence.
        mask: ``[batch, K]`` the convolution's padding mask there (0 at pads and before the sequence).
    """

    inputs: torch.Tensor
    valid: torch.Tensor
    mask: torch.Tensor


def read(layer, planned: PlannedTerm, mode: str, sites: Sites) -> ConvReads:
    """Read the projection's inputs at every lag of the attributed sites, and the convolution's mask."""
    split, rows, positions = planned.term.split, sites.rows, sites.positions
    full = read_site(module_at(layer, split.projection), "input", sites.batch)  # [batch, pos, ...]
    conv = module_at(layer, split.position_conv)
    width = int(conv.conv1d.weight.shape[-1])
    lags = positions.to(full.device)[:, None] - torch.arange(width, device=full.device)[None, :]  # [batch, K]
    valid, q = lags >= 0, lags.clamp(min=0)
    inputs = full[rows.to(full.device)[:, None], q].float().flatten(2)
    mask = conv.inputs[1].get("conv_mask")
    mask = mask[rows.to(mask.device)[:, None], q.to(mask.device)].float() if mask is not None else torch.ones(q.shape)
    return ConvReads(inputs, valid.float(), mask.to(valid.device) * valid.float())


def score(term: TermAt, reads: ConvReads, u: torch.Tensor, rest, split=None):
    """``(parts [batch, parts], rest, None)``: each head's or neuron's part along ``u`` over its lags; the
    projection's bias (at every lag) goes to ``rest``."""
    layer, planned, _ = term
    conv = module_at(layer, planned.term.split.position_conv)
    weight = conv.conv1d.weight.float().squeeze(1).to(u.device)  # [d, K]
    batch, width = reads.mask.shape
    coefficients = weight.flip(-1).T[None] * reads.mask.to(u.device)[..., None]  # [batch, K, d]
    coefficients[:, 0] += 1.0  # the convolution's input is added too (its residual)
    lagged = u[:, None] * coefficients * reads.valid.to(u.device)[..., None]
    pulled, bias = linear_pullback(module_at(layer, planned.term.split.projection), lagged.flatten(0, 1), planned.transposed)
    per_input = (reads.inputs * pulled.view(batch, width, -1).to(reads.inputs.device)).sum(1)
    parts = per_input.unflatten(-1, (planned.parts, planned.part_width)).sum(-1)
    constant = bias.view(batch, width).sum(1) if isinstance(bias, torch.Tensor) else 0.0
    return parts, rest + constant, None
