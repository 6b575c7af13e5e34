"""In the trace, what the per-add check (``math.adds``) reads: which blocks it checks, and each term's write as added;
and the dtype the activations had (the precision every bound of the self-check is sized by).

A block is checked when its stream is nothing but the block's input plus its terms' writes: no term acts on the
stream itself (``Term.stream``: a norm, scale, bias or multiplier on the stream, as on MiniMax, RWKV's block 0,
OpenAI GPT's post-norm blocks, Doge, ZAYA, Beam), writes through a norm shared with another term
(``Write.outer_norm``, Gemma-4) or into parallel streams (``Term.hyper``: DeepSeek-V4, HY-V4), and the family does
not scale the whole stream after the block (``Family.layer_scale``, Gemma-4). Those blocks keep the whole-logit
bound only (``checked_blocks``). Post-norms (Gemma-2/3, OLMo-2), parallel blocks (GPT-NeoX, GPT-J, Falcon, Cohere),
config multipliers (Granite, Falcon-H1), affine merges, experts and hybrid mixers (Mamba, RG-LRU) are checked: their
write is read where it is added and rebuilt as the model adds it (``written_at``).
"""

from __future__ import annotations

import torch

from ..families import Stream
from ..math.adds import AddCheck, Written, coarsest
from ..plan.plan import Plan, PlannedTerm, Stop
from .readers import param


def checkable(planned: PlannedTerm) -> bool:
    """The term's write is added to the stream as it is, nothing else acting on the stream (module docstring)."""
    term = planned.term
    return term.stream == Stream() and term.hyper is None and term.write.outer_norm is None


def checked_blocks(plan: Plan, stop: Stop | None = None) -> frozenset[int]:
    """The blocks whose adds the per-add check holds (whole blocks written before ``stop``; see the docstring)."""
    if plan.family.layer_scale is not None:
        return frozenset()
    last = len(plan.layers) if stop is None else stop[0]
    return frozenset(i for i in range(last) if plan.layers[i] and all(checkable(p) for p in plan.layers[i]))


def written_at(layer, planned: PlannedTerm, value: torch.Tensor) -> Written:
    """The term's write ``[n, d_model]`` as the stream receives it, from ``value`` (its output read at the sites):
    ``(value + bias) * scale * multiplier``, in float32, with the roundings those take in the model (none: the read
    itself, converted when the check runs)."""
    write = planned.term.write
    if write.bias is None and write.scale is None and planned.multiplier == 1.0:
        return Written(value, 0, value.dtype)
    w, roundings = value.float(), 0
    if write.bias is not None:
        w, roundings = w + param(layer, write.bias).to(w.device), roundings + 1
    if write.scale is not None:
        w, roundings = w * param(layer, write.scale).to(w.device), roundings + 1
    if planned.multiplier != 1.0:
        w, roundings = w * planned.multiplier, roundings + 1
    return Written(w, roundings, value.dtype)


def final_read(adds: AddCheck | None, plan: Plan, stream: torch.Tensor) -> None:
    """The last block's output against the final norm's input ``stream`` ``[n, d_model]`` (the per-add check's
    last boundary), where the last block was checked and the final norm reads it directly (no stream collapse, no
    shared norm)."""
    if (adds is not None and adds.last is not None and adds.last[0] == len(plan.layers) - 1
            and plan.family.final_norm == "module" and plan.family.collapse is None):
        adds.between(adds.last[0], adds.last[1], stream)


def low_precision(weight: torch.Tensor) -> bool:
    """The model computes in bfloat16 or float16: its parameters are (``weight``: ``lm_head``'s, read once a call:
    each read of a parameter through an envoy is a few microseconds), or it runs under autocast (the bounds are
    then sized by the dtype its activations really had: ``activations_dtype``)."""
    return weight.dtype in (torch.bfloat16, torch.float16) or torch.is_autocast_enabled(weight.device.type)


def activations_dtype(weight: torch.Tensor, *read: torch.dtype) -> torch.dtype:
    """The dtype the forward pass computed in: the coarsest of the parameters' dtype (``weight``: ``lm_head``'s),
    the dtypes of activations ``read`` in the trace and the autocast running it (server side on NDIF, where the
    client's model has no weights): a float32 model under ``torch.autocast`` to bfloat16 computes in bfloat16."""
    device = weight.device.type
    autocast = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype
    return coarsest(weight.dtype, *read, autocast)
