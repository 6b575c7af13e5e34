"""What is attributed at each site: a linear function of its logits, ``sum_k w_k z[t_k] - m * mean_v z[v]``.

One token (``" Paris"``), a token minus a contrast (``" Paris"`` minus ``" Rome"``), a weighted set of tokens
(``{" Paris": 1.0, "Paris": 1.0}``: the sum of their logits) and a token minus the mean logit over the vocabulary
(``contrast="mean"``) are all one record, ``LinearTarget``: ``ids`` and ``weights`` ``[n, K]`` (a contrast's
tokens carry negative weights; unused slots weight 0) and ``mean`` ``[n]``, the weight of the mean logit subtracted.
Every function of the head here is linear in the final norm's output, so the attribution stays exact.

``head_rows`` is the target's row of ``lm_head``'s weight (``sum_k w_k W[t_k] - m * mean_v W[v]``), ``head_bias``
its bias, ``read_logits`` the same combination of the logits read at the sites (``pick``, ``vocab_mean``: never a
``[n, vocab]`` copy) and ``logit_size`` the size each logit is rounded at (the self-check's bound).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..math.linalg import on
from ..math.rounding import binade


@dataclass(frozen=True)
class LinearTarget:
    """``sum_k weights[:, k] * z[ids[:, k]] - mean * mean_v z[v]`` at each of ``n`` sites.

    Attributes:
        ids: ``[n, K]`` long token ids.  weights: ``[n, K]`` float32 (0: an unused slot).
        mean: ``[n]`` float32, the weight of the mean logit over the vocabulary (subtracted).
    """

    ids: torch.Tensor
    weights: torch.Tensor
    mean: torch.Tensor

    @classmethod
    def tokens(cls, targets: torch.Tensor, contrasts: torch.Tensor | None = None) -> LinearTarget:
        """One token per site (``targets [n]``), minus one contrast token (``contrasts [n]``) when given."""
        ids = targets.long().reshape(-1, 1)
        weights = torch.ones(ids.shape)
        if contrasts is not None:
            ids = torch.cat([ids, contrasts.long().reshape(-1, 1)], 1)
            weights = torch.cat([weights, -torch.ones(weights.shape)], 1)
        return cls(ids, weights, torch.zeros(ids.shape[0]))

    def on(self, device) -> LinearTarget:
        """The same target with its tensors on ``device`` (read there without a copy a call), ``uses_mean`` read on
        the host first (a read of a device tensor on the host would wait for the device)."""
        moved = LinearTarget(self.ids.to(device), self.weights.to(device), self.mean.to(device))
        moved.__dict__["uses_mean_"] = self.uses_mean
        return moved

    @property
    def uses_mean(self) -> bool:
        """Whether any site subtracts the mean logit, read once (``mean`` is a host tensor) and kept in the instance's
        ``__dict__`` (not ``functools.cached_property``: its lock cannot be pickled into a remote trace)."""
        kept = self.__dict__.get("uses_mean_")
        if kept is None:
            kept = self.__dict__["uses_mean_"] = bool((self.mean != 0).any())
        return kept


def as_target(targets, contrasts=None) -> LinearTarget:
    """``targets`` as a ``LinearTarget``: one already, or ``[n]`` token ids (minus ``contrasts [n]``)."""
    if isinstance(targets, LinearTarget):
        return targets
    return LinearTarget.tokens(torch.as_tensor(targets), None if contrasts is None else torch.as_tensor(contrasts))


def combine(target: LinearTarget, table: torch.Tensor, mean_row: torch.Tensor | None = None) -> torch.Tensor:
    """``[n, ...]``: ``sum_k w_k table[t_k] - m * mean_row`` (``table``: ``[vocab, ...]``, a weight or a bias)."""
    picked = table[target.ids.to(table.device)].float()  # [n, K, ...]
    weights = target.weights.to(picked.device).reshape(*target.weights.shape, *([1] * (picked.dim() - 2)))
    out = (picked * weights).sum(1)
    if mean_row is not None:
        out = out - target.mean.to(out.device).reshape(-1, *([1] * (out.dim() - 1))) * mean_row.float().to(out.device)
    return out


def head_rows(target: LinearTarget, weight: torch.Tensor) -> torch.Tensor:
    """``[n, d_model]``: the target's combination of ``lm_head``'s rows (``weight [vocab, d_model]``)."""
    return combine(target, weight, weight.mean(0, dtype=torch.float32) if target.uses_mean else None)


def head_bias(target: LinearTarget, bias: torch.Tensor | None):
    """``[n]``: the target's combination of ``lm_head``'s bias, or 0.0 without one."""
    if bias is None:
        return 0.0
    return combine(target, bias, bias.float().mean() if target.uses_mean else None)


def pick(value: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor, target: LinearTarget) -> torch.Tensor:
    """``[n, K]`` float32: ``value [batch, pos, vocab]`` at each site's row and position and its target's tokens
    (no ``[n, vocab]`` copy is made)."""
    device = value.device
    picked = value[on(rows, device)[:, None], on(positions, device)[:, None], on(target.ids, device)]
    return picked if picked.dtype == torch.float32 else picked.float()


def vocab_mean(value: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor, absolute: bool = False):
    """``[n]`` float32: the mean over the vocabulary of ``value [batch, pos, vocab]`` (of ``|value|``) at each site."""
    if absolute:
        means = torch.linalg.vector_norm(value, 1, dim=-1, dtype=torch.float32) / value.shape[-1]
    else:
        means = value.mean(-1, dtype=torch.float32)
    return means[rows.to(value.device), positions.to(value.device)]


def read_logits(target: LinearTarget, picked: torch.Tensor, mean: torch.Tensor | None = None) -> torch.Tensor:
    """``[n]``: the target's combination of its tokens' logits ``picked [n, K]`` and the vocabulary's mean logit
    ``mean [n]`` (needed only when the target uses it)."""
    out = (picked * on(target.weights, picked.device)).sum(-1)
    if target.uses_mean:
        out = out - target.mean.to(out.device) * mean.to(out.device)
    return out


def head_error(target: LinearTarget, head: torch.Tensor, logits: torch.Tensor, capped) -> torch.Tensor:
    """``[]``: the largest ``|capped(head) - logits|`` at the target's tokens (``[n, K]`` each: ``lm_head``'s
    output and the model's output logits there), ``capped`` the family's final head (logit scale, soft-cap)."""
    gap = (capped(head) - on(logits, head.device)).abs()
    return (gap * (on(target.weights, gap.device) != 0)).max()


def logit_size(target: LinearTarget, head: torch.Tensor, abs_mean: torch.Tensor | None = None) -> torch.Tensor:
    """``[n]``: ``sum_k |w_k| b(z[t_k]) + m * mean_v |z[v]|``: each logit is rounded at its own size (``binade``), so
    a combination is rounded at the sum of its logits' sizes, not at its own (``head``: ``[n, K]`` at the
    target's tokens; ``abs_mean`` ``[n]`` the mean ``|z|``, needed only when the target uses the mean)."""
    size = (binade(head) * on(target.weights, head.device).abs()).sum(-1)
    if target.uses_mean:
        size = size + target.mean.to(size.device).abs() * abs_mean.to(size.device)
    return size
