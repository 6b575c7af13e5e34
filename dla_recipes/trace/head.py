"""The final head of the in-trace recipe: what each site's target reads on the final norm's input, made before the
forward pass from the weights and the target alone (``final_direction``), and the family's final map on the logits.

A logit is ``logit_scale * (lm_head.weight[t] @ norm(x) + lm_head.bias[t])`` (then a soft-cap) at the attributed
position; with the final norm frozen (``FrozenNorm``) it is ``s * (x @ direction) + constant``, ``direction =
logit_scale * center(gain * W[t])`` (minus the same for a contrast token; any ``targets.LinearTarget``). ``Head``
holds that and what the self-check reads of the head (its rows in logit units, whether they are finite) and the
target on the device, so that a call that takes an earlier call's ``Prepared`` makes none of it again.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..math.frozen_norm import NormProbe, identity_probe, probe_norm
from ..math.linalg import dot
from ..plan.plan import Plan
from . import targets as linear_targets
from .targets import LinearTarget


class Head(NamedTuple):
    """The final head, for each site's target: all of it depends only on the weights and the target, so it is made
    before the forward pass (and kept with the call's ``Prepared``).

    Attributes:
        probe: the final norm's ``NormProbe``.  direction: ``[n, d_model]`` on the final norm's input.
        constant: ``[n]`` the final norm's and ``lm_head``'s biases through the head.
        rows: ``[n, d_model]`` the target's combination of ``lm_head``'s rows, float32 (``targets.head_rows``).
        logit_rows: ``rows`` in logit units (times the family's logit scale).
        finite: ``[n]`` float, 1 where ``direction`` and ``logit_rows`` are finite.
        target: the ``LinearTarget`` with its tensors on the device.
    """

    probe: NormProbe
    direction: torch.Tensor
    constant: torch.Tensor
    rows: torch.Tensor
    logit_rows: torch.Tensor
    finite: torch.Tensor
    target: LinearTarget


def final_direction(model, plan: Plan, target: LinearTarget) -> Head:
    """The final head for each site's target (``Head``)."""
    width = model.lm_head.weight.shape[-1]
    probe: NormProbe = identity_probe(width) if plan.family.final_norm == "none" else probe_norm(model.ln_final, width)
    weight = model.lm_head.weight
    probe = probe.to(weight.device)  # a norm without parameters (OLMo, nanochat) is probed on the CPU
    own = linear_targets.head_rows(target, weight).to(probe.gain.device)  # [n, d_model]
    head_bias = linear_targets.head_bias(target, getattr(model.lm_head, "bias", None))
    rows = own * plan.head_input_scale if plan.head_input_scale != 1 else own  # lm_head reads the norm's output times it (MiniCPM)
    direction = plan.logit_scale * probe.center(probe.gain * rows)
    constant = plan.logit_scale * (dot(rows, probe.bias) + torch.as_tensor(head_bias).to(rows.device))
    logit_rows = own * plan.logit_scale if plan.logit_scale != 1 else own
    finite = (torch.isfinite(direction).all(-1) & torch.isfinite(logit_rows).all(-1)).float()
    return Head(probe, direction, constant, rows=own, logit_rows=logit_rows, finite=finite,
                target=target.on(direction.device))


def softcap(z: torch.Tensor, cap: float | None) -> torch.Tensor:
    return z if cap is None else cap * torch.tanh(z / cap)


def scaled_by(z: torch.Tensor, factor: float) -> torch.Tensor:
    """``z * factor``; ``z`` itself for a factor of 1 (the same numbers, no op issued)."""
    return z if factor == 1 else z * factor
