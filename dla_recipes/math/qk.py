"""The arithmetic of ``attribute_scores``: components carried through frozen norms and rotary, and their score matrix.

Tensors in, tensors out. A frozen norm is linear, ``L(x) = gain * center(x) * scale`` (plus its bias once); rotary
embeddings at a fixed position are linear too (the model's own function applied to each vector). So with the query
``q = sum_i q_i + q_0`` and the key ``k = sum_j k_j + k_0`` (``q_0`` / ``k_0`` what no component wrote: the norms' and
projections' biases carried along), the score ``q . k * scaling`` is exactly

    sum_ij (q_i . k_j) * scaling                                   the [components x components] matrix
    + (q_0 . sum_j k_j + sum_i q_i . k_0 + q_0 . k_0) * scaling    the terms of no pair (the constant)
"""

from __future__ import annotations

import torch

from .linalg import exact


def frozen_linear(gain: torch.Tensor, centers: bool, scale: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``gain * center(x) * scale[..., None]`` on ``x`` ``[..., width]`` (``scale`` broadcastable to ``x[..., 0]``):
    a norm frozen at its real input, without its bias."""
    with exact():
        x = x.float()
        if centers:
            x = x - x.mean(-1, keepdim=True)
        return gain.to(x.device) * x * scale.to(x.device).unsqueeze(-1)


def project(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` in float32: ``x`` ``[..., in]``, ``weight`` ``[out, in]`` (an ``nn.Linear``'s)."""
    with exact():
        return x.float() @ weight.float().to(x.device).T


def rotate(rotary, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, width: int | None = None) -> torch.Tensor:
    """``[n, m, head_dim]``: each of the ``m`` vectors of site ``s`` rotated as the model rotates a query at that
    site's position (``cos`` / ``sin`` ``[n, rotary_dim]``, what the attention module received there); ``width``
    below ``head_dim`` rotates the first ``width`` features and passes the rest, as a caller's partial rotary does
    (default: ``cos``'s width).
    ``rotary(q, k, cos, sin)`` is the model's own ``apply_rotary_pos_emb`` (its query output is used)."""
    width = cos.shape[-1] if width is None else width
    with exact():
        part = x[..., :width].float().unsqueeze(2)  # [n, m, 1, rot]: heads at dim 1 as the model's call has them
        c, s = cos.float().to(x.device)[:, None], sin.float().to(x.device)[:, None]  # [n, 1, rot]
        rotated = rotary(part, part, c, s)[0].squeeze(2)
        return torch.cat([rotated.to(x.dtype), x[..., width:].float()], -1)


def score_matrix(q: torch.Tensor, q0: torch.Tensor, k: torch.Tensor, k0: torch.Tensor, scaling: float):
    """``(values [n, keys, C, C], constant [n, keys])`` of the scores of query ``q`` ``[n, C, d]`` (+ ``q0`` ``[n, d]``)
    against each key ``k`` ``[n, keys, C, d]`` (+ ``k0`` ``[n, keys, d]``); see the module docstring."""
    with exact():
        values = torch.einsum("nid,nkjd->nkij", q, k) * scaling
        constant = (torch.einsum("nd,nkd->nk", q0, k.sum(2)) + torch.einsum("nd,nkd->nk", q.sum(1), k0)
                    + torch.einsum("nd,nkd->nk", q0, k0)) * scaling
        return values, constant

