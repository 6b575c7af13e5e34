"""``attribute_scores``: why a head attends, its pre-softmax score split into query x key component pairs.

The stages, each once, downward: the arguments checked (the head label, the query and key positions counted in each
prompt's own tokens), the model loaded and planned (``plan.scores.score_spec`` refuses a family whose score it cannot
split), the prompts tokenized into batches, each batch's in-trace split (``trace.scores``) run locally or on an NDIF
server, and the readouts checked and joined into one ``ScoreAttribution``. A split that does not sum to the model's own
score within its precision raises ``ExactnessError``; a query or key the recipe cannot rebuild from the components
(the attention computes them some other way) raises a ``DLAError`` naming the family.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .api import planned
from .args import Check, Granularity, check_prompts
from .errors import DLAError, ExactnessError, InputError
from .math.rounding import unit_roundoff
from .plan.scores import score_spec
from .present.scores import ScoreAttribution
from .question import Question, ask
from .selfcheck import model_dtype
from .trace.scores import ScoreCall
from .transport.batches import Group, groups, offsets, prepare, token_ids
from .transport.run import run as run_batches
from .transport.session import How, Work

REBUILD_RTOL = 1e-4  # float32: the stream, query and key rebuilt from the components (llama 3e-7); a family whose
# attention computes them some other way is off by far more (OPT 3, Falcon-H1 0.17, Hunyuan 0.05). In low precision
# REBUILD_UNITS u: the model rounds each of them on the way (measured on tiny llama, gemma3 and qwen3: 1.9 u in
# bfloat16, 1.8 u in float16)
REBUILD_UNITS = 4.0
SIGMAS = 8.0  # the score's bound, in units of the rounding of its parts and of the model's own q . k


def own_positions(value, length: int, role: str, prompt: int) -> int:
    """A position counted in the prompt's own tokens (negative: from its end), or an ``InputError`` naming ``role``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InputError(f"{role}={value!r}: give an int position (negative counts from each prompt's end)")
    own = value + length if value < 0 else value
    if not 0 <= own < length:
        raise InputError(f"{role}={value}: prompt {prompt} has {length} tokens (positions 0 .. {length - 1} or "
                         f"-{length} .. -1)")
    return own


def attribute_scores(model, prompts, head: str, *, query: int = -1, keys=(0,), by: Granularity = "block",
                     dictionaries: dict | None = None, sources: dict | None = None, intervene=None,
                     check: Check = "logit", tolerance: float | None = None, reduce=None, remote=False,
                     blocking: bool = True, batch_size: int | None = None, progress: bool | None = None,
                     fast=True) -> ScoreAttribution:
    """Split head ``head``'s pre-softmax attention score of ``query`` against each of ``keys`` into components.

    Args:
        model: a ``StandardizedTransformer`` (or anything ``attribute`` loads).
        prompts: a string or a list of strings (a padded batch), or token ids, as in ``attribute``.
        head: ``"L29.H0"``: block 29's query head 0 (its key head is its GQA group's).
        query: the query position, in each prompt's own tokens (negative: from its end).
        keys: an int or a list of key positions (negative: from each prompt's end), each at or before the query.
        by: ``"block"`` (the embedding and each earlier block's terms) or ``"head"`` (each earlier attention's heads
            and their rest, ``L3.attn``; MLPs whole). Both sides have the same components.
        intervene: ``fn(model)`` as in ``attribute``: the score of the EDITED forward pass, split over what each
            component wrote in it (an edit of the head's own query or key is refused by the rebuild check).
        remote: as in ``attribute`` (runs in the trace on the server; only the matrices come back).
        batch_size, progress, fast: as in ``attribute``.
        tolerance: a relative tolerance replacing the derived bound: ``tolerance * max(1, |score|)``.
        dictionaries, sources, check, reduce, blocking: refused, each with its reason
            (``dla_recipes.question.REFUSED``).

    Returns:
        A ``ScoreAttribution``: ``values [batch, keys, components, components]``, ``constant`` and ``score``
        ``[batch, keys]`` with ``values.sum((-2, -1)) + constant == score`` (the model's own, before any soft-cap).
    """
    question = ask("attribute_scores", by=by, dictionaries=dictionaries, sources=sources, intervene=intervene,
                   check=check, tolerance=tolerance, reduce=reduce, remote=remote, blocking=blocking,
                   batch_size=batch_size, progress=progress, fast=fast)
    return score_logits(model, prompts, Score(head, query, keys), question)


class Score(NamedTuple):
    """What ``attribute_scores`` attributes: ``head``'s pre-softmax score of ``query`` against each of ``keys``."""

    head: str
    query: object = -1
    keys: object = (0,)


def score_logits(model, prompts, asked: Score, question: Question) -> ScoreAttribution:
    """``attribute_scores``'s work, from its checked ``question``."""
    head, query, keys = asked.head, asked.query, asked.keys
    prompts = check_prompts(prompts)
    tolerance = question.tolerance
    keys = [keys] if isinstance(keys, int) else list(keys)
    if not keys:
        raise InputError("keys=[]: give at least one key position")
    model, plan = planned(model, question)
    spec = score_spec(model, plan, head, question.by)
    ids = token_ids(model, plan, prompts, every=True)  # each prompt's own length, whatever the padding
    lengths = [len(i) for i in ids] if ids is not None else [0] * len(prompts)  # no tokenizer: prepare raises
    queries = [own_positions(query, n, "query", b) for b, n in enumerate(lengths)]
    own_keys = [[own_positions(k, n, "keys", b) for k in keys] for b, n in enumerate(lengths)]
    for b, (q, ks) in enumerate(zip(queries, own_keys)):
        after = [k for k in ks if k > q]
        if after:
            raise InputError(f"keys={keys}: prompt {b}'s key position(s) {after} come after its query ({q}): a "
                             "causal head attends only to earlier positions")
    run_groups = groups(model, plan, prompts, question.batch_size, ids)
    unpadded = None if plan.family.padding_safe else ids  # padding-unsafe: each batch is these ids, unpadded
    batches = tuple(prepare(model, [prompts[i] for i in g], 0, None, query,
                            Group(g, None if unpadded is None else [unpadded[i] for i in g])) for g in run_groups)
    calls = []
    for g, batch in zip(run_groups, batches):
        start = offsets(batch)  # [n]: where each prompt's own tokens start
        k_positions = torch.tensor([own_keys[i] for i in g], dtype=torch.long) + start[:, None]
        calls.append(ScoreCall(plan, spec, batch.positions, k_positions))
    ran = run_batches(model, plan, Work(batches, tuple(calls), question.intervene),
                      How(question.remote, question.progress, f"scores of {head}"))
    if ran.error is not None:
        raise ran.error
    order = [i for g in run_groups for i in g]
    rank = [order.index(i) for i in range(len(prompts))]
    readouts = ran.readouts
    values = torch.cat([r.values for r in readouts])[rank]
    constant, score = torch.cat([r.constant for r in readouts])[rank], torch.cat([r.score for r in readouts])[rank]
    allowed = torch.cat([r.allowed for r in readouts])[rank]
    size, qk_size = torch.cat([r.size for r in readouts])[rank], torch.cat([r.qk_size for r in readouts])[rank]
    checks = torch.stack([r.checks for r in readouts]).max(0).values
    masked = [(b, own_keys[b][k]) for b, k in (allowed == 0).nonzero().tolist()]
    if masked:
        raise InputError(f"keys={keys}: the {head} query at each prompt's position {query} does not see "
                         f"(prompt, key) {masked}: outside its sliding window (or masked); pick keys it attends to")
    dtype = model_dtype(model)
    check_rebuilt(plan, spec, head, checks, dtype)
    total = values.double().sum((-2, -1)) + constant.double()
    error = (total - score.double()).abs().float()
    bound = score_bound(size, qk_size, score, dtype, tolerance)
    if bool((error > bound).any()):
        b, k = divmod(int(torch.argmax(error - bound)), error.shape[1])
        raise ExactnessError(f"{head}: the pairs sum to {float(total[b, k]):.6g}, the model's own score is "
                             f"{float(score[b, k]):.6g} (prompt {b}, key {own_keys[b][k]}): off by "
                             f"{float(error[b, k]):.3g}, past the bound {float(bound[b, k]):.3g}")
    softcap = float(checks[4]) or None
    texts = [text for batch in batches for text in batch.prompts]
    return ScoreAttribution(values, constant, score, query_labels=spec.labels, key_labels=spec.labels,
                            keys=tuple(tuple(k) for k in own_keys), queries=tuple(queries),
                            head=f"L{spec.layer}.H{spec.head}", prompts=tuple(texts[r] for r in rank),
                            softcap=softcap, error=error,
                            diagnostics={"stream_error": float(checks[0]), "query_error": float(checks[1]),
                                         "key_error": float(checks[2]), "norm_fit_error": float(checks[3]),
                                         "bound": bound})


def check_rebuilt(plan, spec, head: str, checks: torch.Tensor, dtype: torch.dtype) -> None:
    """The stream, query and key rebuilt from the components against the model's own, and the norm fits."""
    limit = max(REBUILD_RTOL, REBUILD_UNITS * unit_roundoff(dtype))
    stream, query, key, fit = (float(c) for c in checks[:4])
    if stream > limit or fit > limit:
        raise ExactnessError(f"{head}: the components do not rebuild the stream block {spec.layer}'s attention norm "
                             f"reads (relative gap {stream:.3g}, norm fit error {fit:.3g}, limit {limit:.3g})")
    if query > limit or key > limit:
        raise DLAError(f"family {plan.family.name!r}: attribute_scores cannot split {head}'s score: the query and key "
                       f"rebuilt as norm(proj(ln1(x))) rotated are off the attention call's own (relative gaps "
                       f"{query:.3g} and {key:.3g}, limit {limit:.3g}): its attention computes them some other way")


def score_bound(size: torch.Tensor, qk_size: torch.Tensor, score: torch.Tensor, dtype: torch.dtype,
                tolerance: float | None) -> torch.Tensor:
    """``[batch, keys]``: how far the pairs' sum may be from the model's own score: the float32 rounding of the parts
    (``SIGMAS * 2^-24 * sum |parts|``) and the model's own rounding of its query and key (``SIGMAS * u * |q| |k|
    scaling``, ``u`` its unit roundoff), or ``tolerance * max(1, |score|)``."""
    if tolerance is not None:
        return tolerance * score.abs().clamp(min=1.0)
    return SIGMAS * (unit_roundoff(torch.float32) * size + unit_roundoff(dtype) * qk_size) + 1e-6
