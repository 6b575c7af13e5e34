"""``attribute_direction``: a direction read by a block's norm, attributed to everything written before it.

The same stages as ``attribute`` (``api``), with a different target: the question checked once
(``question.ask``), the model planned (``api.planned``), the prompts tokenized into batches, each batch's in-trace
call (``trace.calls.DirectionCall``: ``trace.recipe.direction_attribution``) run locally or on NDIF, and the
readouts assembled and self-checked against the norm's own output along the direction.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .api import Request, complete, planned
from .args import Check, Granularity, check_int, check_position, check_prompts
from .errors import ExactnessError, InputError
from .plan import sources as source_split
from .question import Question, ask
from .result import EDIT_HINT, Of, layout_of
from .selfcheck import model_dtype
from .trace.calls import DirectionCall
from .trace.reading import Where
from .transport.batches import Group, groups, offsets, prepare, token_ids
from .transport.handle import RemoteJob
from .transport.session import How, Work
from .transport.sites import for_prompts
from .transport.stats import pair_groups, stats_calls


def attribute_direction(
    model,
    prompts,
    direction: torch.Tensor,
    *,
    layer: int,
    sublayer: str = "mlp",
    position=-1,
    by: Granularity = "block",
    dictionaries: dict | None = None,
    sources: dict | None = None,
    intervene=None,
    check: Check = "logit",
    tolerance: float | None = None,
    reduce=None,
    remote=False,
    blocking: bool = True,
    batch_size: int | None = None,
    progress: bool | None = None,
    fast=True,
):
    """Attribute ``norm(stream) @ direction`` where ``norm`` is the norm in front of block ``layer``'s ``sublayer``.

    The stream that sublayer reads is decomposed into the terms written before it (the embedding, every earlier
    block's terms, and this block's earlier terms unless the block is parallel), the norm that really reads it is
    frozen at that stream, and the parts sum to the model's own ``norm(stream) @ direction``, read from the norm's
    output in the same trace. Every row is read through that one norm's frozen scale.

    Args:
        direction: ``[d_model]``, ``[batch, d_model]`` or ``[batch, n_positions, d_model]`` (one per prompt and
            position): a direction on the norm's output (a probe, a query direction, a difference of means).
        layer, sublayer: the block and its sublayer (``"attn"``, ``"mlp"``, ...; names as in the labels) whose
            norm reads the stream: ``sublayer="mlp"`` is ``ln2`` / ``post_attention_layernorm``.
        position, by, dictionaries, sources, intervene, check, tolerance: as in ``attribute`` (``check="adds"``
            holds the adds of the blocks before ``layer``; ``dictionaries`` split the terms written before it, not
            the stream; ``by="source"`` splits the heads of the blocks before it).
        reduce, remote, blocking, batch_size, progress, fast: as in ``attribute``.

    Returns:
        An ``Attribution`` (several positions: a ``PositionAttribution``) whose ``logit`` is
        ``norm(stream) @ direction`` at each prompt's position.
    """
    question = ask("attribute_direction", by=by, dictionaries=dictionaries, sources=sources, intervene=intervene,
                   check=check, tolerance=tolerance, reduce=reduce, remote=remote, blocking=blocking,
                   batch_size=batch_size, progress=progress, fast=fast)
    return direction_logits(model, prompts, Direction(direction, layer, sublayer, position), question)


class Direction(NamedTuple):
    """What ``attribute_direction`` attributes: ``direction`` on the output of the norm in front of block
    ``layer``'s ``sublayer``, at ``position`` (as given)."""

    direction: object
    layer: object
    sublayer: str = "mlp"
    position: object = -1


def direction_logits(model, prompts, asked: Direction, question: Question):
    """``attribute_direction``'s work, from its checked ``question``."""
    q, direction, layer, sublayer = question, asked.direction, asked.layer, asked.sublayer
    prompts = check_prompts(prompts)
    model, plan = planned(model, q)
    if plan.stream_dictionary is not None:
        raise InputError(f"dictionaries={{'L{plan.stream_dictionary[0]}.resid': ...}}: attribute_direction splits the "
                         "terms written before its layer, and a stream dictionary (the stream entering a block split "
                         "into latents) is not split there yet: give terms' dictionaries ('L3.mlp'), or attribute a "
                         "logit with attribute(..., dictionaries=)")
    stop = plan.stop_before(check_int(layer, "layer"), sublayer)
    reads = plan.layers[stop[0]][[p.term.name for p in plan.layers[stop[0]]].index(sublayer)].term.reads
    direction = torch.as_tensor(direction)
    if direction.device.type == "meta":
        raise InputError(
            "direction is on the meta device: a model's weights load at its first trace, so build the direction "
            "after one (or load with dispatch=True), or pass a real tensor"
        )
    direction = direction.detach().float().cpu()
    width = int(model.lm_head.weight.shape[-1])
    if direction.shape[-1] != width or direction.dim() not in (1, 2, 3):
        raise InputError(f"direction has shape {tuple(direction.shape)}: give [d_model={width}], [batch, {width}] or "
                         f"[batch, n_positions, {width}]")
    if direction.dim() >= 2 and direction.shape[0] != len(prompts):
        raise InputError(f"{direction.shape[0]} directions for {len(prompts)} prompts: give one or one per prompt")
    directions = direction.expand(len(prompts), *direction.shape[-2 if direction.dim() == 3 else -1:])
    stats = q.stats
    ids = token_ids(model, plan, prompts)  # padding-unsafe: tokenized once, to group by length and to pad
    run_groups = (pair_groups(model, plan, prompts, q.batch_size, ids) if stats is not None and stats.paired
                  else groups(model, plan, prompts, q.batch_size, ids))
    position = check_position(asked.position)
    batches = tuple(prepare(model, [prompts[i] for i in g], 0, None, for_prompts(position, g, len(prompts)),
                            Group(g, None if ids is None else [ids[i] for i in g])) for g in run_groups)
    if direction.dim() == 3 and direction.shape[1] != max(b.n_columns for b in batches):
        raise InputError(f"direction has {direction.shape[1]} positions; position={position!r} takes "
                         f"{max(b.n_columns for b in batches)}: give [batch, n_positions, {width}]")
    split = None
    if q.by == "source":  # the heads of the blocks before the stop, split by source
        layers, top, upstream = source_split.parse(plan, q.sources)
        layers = [i for i in layers if i < stop[0] or (i == stop[0] and not sublayer_first(plan, stop))]
        if top is not None or upstream is not None:
            raise InputError("attribute_direction(by='source') splits every head before the layer by source: "
                             "sources=dict(layers=[...]) chooses the blocks (top_heads= and upstream= are "
                             "attribute's)")
        source_split.check(model, plan, layers)
        count = max(own for b in batches for own in b.own_positions) + 1
        split = source_split.choose(plan, layers, None, count, None, None)
    reading = q.reading(split)
    calls = []
    for b, g in zip(batches, run_groups):
        mine = directions[torch.as_tensor(g)][b.rows]  # [n, (n_positions,) d]: each site's prompt's
        if mine.dim() == 3:
            mine = mine[torch.arange(len(b.rows)), torch.as_tensor(b.columns)]
        where = Where(b.positions, b.rows, offsets(b) if q.by == "source" else None, stop)
        calls.append(DirectionCall(plan, where, mine, reads, reading))
    if stats is not None:
        calls = stats_calls(calls, batches, run_groups, stats, q.tolerance, len(prompts))
    of = Of(plan, q.by, model_dtype(model), q.tolerance, stop=stop, sources=split, read_by=f"L{stop[0]}.{reads}",
            edits=q.edits)
    request = Request(model, batches, tuple(calls), order=tuple(i for g in run_groups for i in g), question=q,
                      of=of, layout=layout_of(batches, run_groups, model.tokenizer))
    if not q.blocking:
        return RemoteJob(model, plan, Work(batches, request.calls, q.intervene), How(q.remote),
                         lambda readouts: complete(request, done=readouts))
    try:
        return complete(request)
    except ExactnessError as error:
        if not q.edits:
            raise
        raise type(error)(f"{error}\n\n{EDIT_HINT}") from error


def sublayer_first(plan, stop) -> bool:
    """Whether the stop is at its block's first term (the block's attention is read by the stop's norm: none of
    its heads was written before it)."""
    return stop[1] == 0
