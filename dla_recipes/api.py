"""The calls most users need: ``attribute`` a logit, ``attribute_direction`` a direction read by a block's norm.

Each runs the stages in order, each once, downward: the arguments are checked without a model (``args``), the model
is loaded where the user passed a folder or a transformers model (``loading``), the family table is resolved
against it (``plan``), the prompts are tokenized into batches (``transport.batches``), every batch runs its
in-trace call (``trace``) locally or on an NDIF server (``transport.run``), and the readouts become one
self-checked ``Attribution`` (``result``). A family whose parts do not sum raises ``ExactnessError`` instead of
returning a wrong answer; a remote request that still fails after its retries raises a ``RemoteBatchError`` that
keeps what completed and, when the failure is transient, can resume (a failure no retry fixes, such as a model the
server does not host, raises its ``RemoteError`` when nothing completed, and offers no ``.resume()``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import NamedTuple

import torch

from . import features
from .args import Check, Granularity, check_position, check_prompts
from .errors import ExactnessError, InputError
from .loading.load import as_standardized
from .math.frozen_norm import forget_probes
from .plan import build_plan
from .plan import sources as source_split
from .present.attribution import Attribution
from .question import Question, ask
from .result import EDIT_HINT, Of, assemble, assemble_stats, layout_of, rows_of
from .selfcheck import model_dtype
from .trace.calls import LogitCall, TopCall
from .trace.reading import Where
from .transport import memo
from .transport.batches import Group, groups, offsets, plain, prepare, resolve_all, token_ids
from .transport.handle import RemoteJob
from .transport.remote import RemoteBatchError, is_transient
from .transport.reuse import Reuse
from .transport.run import run as run_batches
from .transport.session import How, Work
from .transport.sites import check_grid, for_group, for_prompts
from .transport.stats import pair_groups, stats_calls


class Logits(NamedTuple):
    """What ``attribute`` attributes at each site: ``target`` minus ``contrast`` at ``position`` (as given)."""

    target: object
    contrast: object = None
    position: object = -1


def planned(model, question: Question):
    """``(model, plan)``: the model as a ``StandardizedTransformer`` and its plan, checked for ``question.by`` and
    with ``question.dictionaries`` attached (every problem of them in one ``InputError``). Every verb starts here."""
    model = as_standardized(model)
    if not question.fast.probes:  # the general path: every norm probed anew in this call
        forget_probes(getattr(model, "_module", model))
    plan = build_plan(model)
    plan.require(question.by)
    if question.dictionaries is not None:
        plan = features.attach(model, plan, question.dictionaries, remote=bool(question.remote))
    return model, plan


@dataclass(frozen=True)
class Request:
    """One ``attribute`` / ``attribute_direction`` call, batch by batch: what to run and how to assemble it."""

    model: object
    batches: tuple
    calls: tuple
    order: tuple  # the user's index of each prompt in run order
    question: Question
    of: Of  # what the readouts attribute (result.Of)
    layout: object = None


def stats_of(r: Request, readouts: tuple):
    """``reduce=Stats(...)``: the ``AttributionStats`` of the batches whose ``readouts`` came back."""
    k = len(readouts)
    names = r.layout.names(rows_of(r.batches[:k]).positions)
    return assemble_stats(r.of, readouts, names, [len(b.rows) for b in r.batches[:k]], r.question.stats)


def complete(request: Request, done: tuple = ()) -> Attribution:
    """Run the request's batches after the ``done`` readouts and assemble them; a remote request that fails for
    good raises a ``RemoteBatchError`` keeping the attribution of the requests that completed."""
    r, q = request, request.question
    ran = run_batches(r.model, r.of.plan, Work(r.batches, r.calls, q.intervene),
                      How(q.remote, q.progress, f"DLA by {q.by}"), done)
    if ran.error is None and q.stats is not None:
        return stats_of(r, ran.readouts)
    if ran.error is None:
        return assemble(r.of, rows_of(r.batches), ran.readouts, r.order, r.layout, q.reduce)
    k, n = len(ran.readouts), len(r.batches)
    ran_prompts = r.order[:sum(len(b.prompts) for b in r.batches[:k])]  # the user's indices of the prompts that ran
    covered = tuple(sorted(ran_prompts))
    resumable = is_transient(ran.error)  # else the same request would fail the same way: nothing to resume
    if not ran.readouts and not resumable:
        raise ran.error  # the first request failed for good: its RemoteError, nothing kept, nothing to resume
    partial = None
    if ran.readouts and q.stats is not None:
        partial = stats_of(r, ran.readouts)
    elif ran.readouts:  # its rows in the user's order too: rank the indices that ran
        layout = None if r.layout is None else layout_of(r.batches[:k], groups_of(r)[:k])
        partial = assemble(r.of, rows_of(r.batches[:k]), ran.readouts, [covered.index(i) for i in ran_prompts],
                           layout, q.reduce)
    kept = (f"The {k} request(s) before it completed: their attribution ({len(covered)} prompt(s)) is kept in this "
            "error's .partial")
    then = (f"; call .resume() to send the {n - k} remaining request(s) and get the whole attribution." if resumable
            else ". The failure is not transient (sending the request again would fail the same way), so there is "
            "no .resume(): fix its cause and attribute the prompts not in .done again.")
    raise RemoteBatchError(
        f"request {k + 1} of {n} failed: {ran.error}\n\n{kept}{then}",
        partial=partial, done=covered, failed_batch=k, cause=ran.error,
        resume=(lambda: complete(request, done=ran.readouts)) if resumable else None,
    ) from ran.error


def groups_of(request: Request) -> list[list[int]]:
    """Each batch's prompts, as the user numbers them (``Request.order`` cut by batch)."""
    out, start = [], 0
    for batch in request.batches:
        out.append(list(request.order[start:start + len(batch.prompts)]))
        start += len(batch.prompts)
    return out


def attribute(
    model,
    prompts,
    target,
    *,
    contrast=None,
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
    """Attribute the logit of ``target`` (minus ``contrast``) at ``position`` to the model's components.

    Args:
        model: a ``StandardizedTransformer`` (``dla_recipes.load``). A transformers model, an nnsight
            ``LanguageModel``, a local model folder or a short name (``"smollm2"``) is loaded for you with
            ``load`` (default dtype and device, once per model); a hub id is refused: ``load`` it first.
        prompts: a string or a list / tuple / generator of strings (a batch, padded as nnsight pads), or token ids:
            a list of ints (one prompt), a list of id lists, a ``[batch, pos]`` integer tensor, or a dict /
            ``BatchEncoding`` with ``input_ids`` and ``attention_mask``. Ids are attributed as given (no BOS added).
        target: what is attributed at each position, any linear function of the logits:
            a token string (``" Paris"``) or id; a weighted set of tokens (``{" Paris": 1.0, "Paris": 1.0}``: the sum
            of their logits); ``"next"`` (at each position, the prompt's next token; a position with none is left
            out); ``None`` (the model's own top token at each position, found by one more forward pass); one per
            prompt (a list, array or tensor) or one per prompt and position (``[batch, n_positions]``).
        contrast: subtracted from the target: a token, a weighted set, one per prompt or per prompt and position
            (as ``target``), or ``"mean"`` (the mean logit over the vocabulary). A contrast equal to the target
            gives 0.
        position: an int (negative counts from the end of each prompt's own tokens, so padding never shifts it), a
            list of ints, a ``slice`` of each prompt's own tokens, ``"all"``, or a list of one slice per prompt (each
            prompt's own span: an answer). With more than one, the result is a
            ``PositionAttribution`` (``values [batch, n_positions, n_components]``, masked where a prompt is
            shorter), computed in the same ONE forward pass.
        by: ``"block"`` (embed, then each block's terms), ``"head"``, ``"neuron"`` (MLP neurons, and the neurons
            of every routed expert), ``"expert"`` (one component per routed expert) or ``"source"`` (``L3.H5.S2``:
            head 5's part read from the prompt's own token 2; eager or sdpa attention, see ``dla_recipes.sources``).
        remote: ``True`` to run on NDIF (host from nnsight's config / ``NDIF_HOST``, key from ``NDIF_API_KEY``),
            or a server URL such as ``"http://127.0.0.1:PORT"``. The math runs server side; only the result returns.
            The batches travel in NDIF sessions, several a request, cut so that none passes NDIF's job time limit
            (``dla_recipes.transport.session.JOB_LIMIT``).
        batch_size: prompts per forward pass (one trace each); default: all in one.
        progress: show a progress bar over the batches (default: when there is more than one).
        tolerance: a relative tolerance replacing the self-check's bound (derived from the model's precision)
            by ``tolerance * max(1, |logit|)`` at every position.
        intervene: ``fn(model)``, nnsight code run in the same forward pass before the attribution reads it: set
            or edit any module's input or output, at any block (in forward order, nnsight's rule within one
            function): zero a head's slice of ``o_proj``'s input, patch in a value computed earlier, add a
            steering vector to what a sublayer writes. The attribution is then of the *edited* forward pass: its
            parts sum to the edited model's own logit, and an ablated head's direct part is 0. It runs once per
            batch (``batch_size``) on that batch's rows, and with ``remote`` it travels with the request (by its
            source: give a ``def`` or a lambda, and pass the tensors it uses as defaults or globals). At
            ``by="head"`` / ``"neuron"`` / ``"expert"`` / ``"source"`` each split term then has a column
            ``L3.mlp.edit`` before its rest: what the sublayer wrote beyond its parts and bias (an edit of its
            output after the projection, such as steering ``mlp.output``; in low precision also its rounding).
        sources: ``by="source"`` only: ``dict(layers=[...], top_heads=k)`` splits only these blocks' heads, or
            only the ``k`` heads with the largest ``|by="head"|`` part (one more forward pass picks them); the
            other heads stay whole (``L3.H5``). Default: every head. Sources are ``S0 .. S{n-1}`` with ``n`` the
            largest attributed own position plus one; a prompt has zeros for sources it does not have.
            ``upstream="block"`` / ``"head"``: each source split by the component that wrote its stream
            (``L3.H5.S2<-L1.mlp``; ``"head"``: upstream heads split, ``L3.H5.S2<-L1.H0``).
        reduce: ``"sum"``: one row a prompt, the sum over its positions (an answer span: the parts of the sum
            of the span's logits, exact as each position is). ``"stats"`` or ``Stats(replicates=200, seed=0,
            paired=False)``: per-component statistics reduced in the trace (``AttributionStats``: ``summary()``
            with mean, std, sem, t interval, share positive, bootstrap interval, sign-flip p-value), one sample
            per attributed site (one int position: a prompt; several: every (prompt, position) pooled);
            ``O(components x replicates)`` numbers return per request whatever the batch. Every site is still
            self-checked: each batch sends back the full rows of its sites nearest to failing, and the check on
            those raises as without it. ``paired=True``: ``prompts`` is ``clean + corrupted`` (row ``i`` pairs
            with ``i + n/2``, both in one batch) and the samples are the per-site differences.
        blocking: ``False`` (with ``remote``): submit the jobs and return at once a ``RemoteJob`` handle:
            ``.status()``, ``.result()`` (waits, returns the attribution), ``.resume()`` (sends again what a
            restarted or unreachable server lost).
        check: ``"logit"`` (default): the parts against the model's own logit within the bound of all its rounding
            at once (``dla_recipes.selfcheck``). ``"adds"``: also each residual add, channel by channel, against
            what the block's components wrote, within the add's own rounding, so a write no component made (a
            torch hook, an edit outside the call) raises ``ExactnessError`` naming its block, in bfloat16 from
            below 1% of the stream's norm (``dla_recipes.math.adds``; about 5% more time by block).
        dictionaries: ``{"L12.mlp": sae, "L8.mlp": transcoder, "L16.resid": sae2}``: split those terms (and the
            stream entering block 16) into the dictionaries' latents (``L12.mlp.F1234``, ``L12.mlp.bias``,
            ``L12.mlp.skip``, ``L12.mlp.error``), the other terms at ``by``; sae-lens objects as they are, or
            ``dla_recipes.features.Dictionary``. See ``dla_recipes.features``.

    Returns:
        One int position: an ``Attribution`` (``values [batch, n_components]``, ``labels``, ``constant [batch]``,
        ``logit [batch]``, ``error``); several: a ``PositionAttribution`` (``reduce="sum"``: an ``Attribution``);
        ``reduce="stats"``: an ``AttributionStats``.
        Raises ``ExactnessError`` when the parts do not sum to the model's own logit at some prompt and position.
    """
    question = ask("attribute", by=by, dictionaries=dictionaries, sources=sources, intervene=intervene, check=check,
                   tolerance=tolerance, reduce=reduce, remote=remote, blocking=blocking, batch_size=batch_size,
                   progress=progress, fast=fast)
    return attribute_logits(model, prompts, Logits(target, contrast, position), question)


def attribute_logits(model, prompts, logits: Logits, question: Question):
    """``attribute``'s work, from its checked ``question``: what every verb that attributes a logit calls
    (``attribute_generation`` the teacher-forced pass, ``attribute_dataset`` each chunk)."""
    q = question
    prompts = check_prompts(prompts)
    if isinstance(logits.target, str) and logits.target == "generated":  # the answer is not known before it is
        raise InputError("target='generated': the model's own answer is attributed by dla_recipes.attribute_generation("
                         "model, prompts, max_new_tokens=..., contrast=...), which generates it and chooses each "
                         "answer's positions itself (no position=)")
    model, plan = planned(model, q)
    n, stats = len(prompts), q.stats
    key = memo.key_of(model, prompts, logits, q.batch_size) if stats is None and q.fast.memo else None
    batches, run_groups, layout, logits = memo.prepared(plan, key, lambda: _batches(model, plan, prompts, logits, q))
    split = None
    if q.by == "source":
        layers, top, upstream = source_split.parse(plan, q.sources)
        source_split.check(model, plan, layers)
        if upstream is not None:
            source_split.check_upstream(model, plan, layers, upstream)
        heads = None
        if top is not None:  # one more forward pass picks the heads to split
            heads = attribute_logits(model, prompts, logits, q.but(by="head", sources=None, reduce=None,
                                                                   dictionaries=None, check="logit"))
            heads = getattr(heads, "sites", heads)
        count = max(own for b in batches for own in b.own_positions) + 1
        split = source_split.choose(plan, layers, top, count, heads, upstream)
    reading = q.reading(split)

    def calls_for(reuse: Reuse | None) -> tuple:  # each batch's in-trace call (reuse: local, no edits)
        calls = tuple(LogitCall(plan, Where(b.positions, b.rows, offsets(b) if q.by == "source" else None),
                                b.targets, reading=reading,
                                prepared=None if reuse is None else reuse.for_target(b.targets))
                      for b in batches)
        return calls if stats is None else stats_calls(calls, batches, run_groups, stats, q.tolerance, n)

    reuse = Reuse(model, plan) if not q.remote and not q.edits and q.fast.reuse else None
    of = Of(plan, q.by, model_dtype(model), q.tolerance, sources=split, edits=q.edits)
    request = Request(model, batches, calls_for(reuse), order=tuple(i for g in run_groups for i in g), question=q,
                      of=of, layout=layout)
    if not q.blocking:  # the jobs are submitted; the handle assembles the readouts once they are all back
        return RemoteJob(model, plan, Work(batches, request.calls, q.intervene), How(q.remote),
                         lambda readouts: complete(request, done=readouts))
    try:
        return complete(request)
    except ExactnessError as error:
        if reuse is not None and reuse.served():  # a record from before a weight edit no stamp sees: made anew
            reuse.forget()
            return complete(replace(request, calls=calls_for(None)))
        if not q.edits:
            raise
        raise type(error)(f"{error}\n\n{EDIT_HINT}") from error  # NonFiniteError stays one
    finally:
        if reuse is not None:
            reuse.settle()


def _batches(model, plan, prompts: list, logits: Logits, question: Question):
    """``(batches, groups, layout, logits)``: ``attribute``'s prompts checked, tokenized and grouped into batches,
    every bad token named in one error (the position checked, the target and contrast resolved to ids where they
    are tokens); ``target=None`` runs one more forward pass to read the model's top tokens."""
    n, q = len(prompts), question
    target, contrast = logits.target, logits.contrast
    if plain(target) and plain(contrast) and target is not None:  # every bad token named in one error
        target, contrast = resolve_all(model, prompts, target, contrast)
    ids = token_ids(model, plan, prompts)  # padding-unsafe: tokenized once, to group by length and to pad
    run_groups = (pair_groups(model, plan, prompts, q.batch_size, ids) if q.stats is not None and q.stats.paired
                  else groups(model, plan, prompts, q.batch_size, ids))

    position = check_position(logits.position)

    def batches_for(target):
        return tuple(prepare(model, [prompts[i] for i in g], for_group(target, g, n), for_group(contrast, g, n),
                             for_prompts(position, g, n), Group(g, None if ids is None else [ids[i] for i in g]))
                     for g in run_groups)

    if target is None:  # the model's own top token at each site: one more forward pass reads it
        batches = batches_for(0)
        tops = run_batches(model, plan, Work(batches, tuple(TopCall(b.positions, b.rows, int(b.encoding["input_ids"].shape[1]))
                                                           for b in batches), q.intervene),
                           How(q.remote, q.progress, "top tokens"))
        if tops.error is not None:
            raise tops.error
        batches = tuple(prepare(model, [prompts[i] for i in g], top_grid(b, top), for_group(contrast, g, n),
                                for_prompts(position, g, n), Group(g, b.ids)) for g, b, top in zip(run_groups, batches, tops.readouts))
    else:
        batches = batches_for(target)
        check_grid(target, batches, "target")
    check_grid(contrast, batches, "contrast")
    return batches, run_groups, layout_of(batches, run_groups, model.tokenizer), Logits(target, contrast, position)


def top_grid(batch, ids: torch.Tensor) -> list[list[int]]:
    """``[prompts, n_columns]`` token ids: each site's top token (``ids [n]``) in its prompt's row and column."""
    grid = [[0] * batch.n_columns for _ in batch.prompts]
    for b, column, token in zip(batch.rows.tolist(), batch.columns, ids.tolist()):
        grid[b][column] = int(token)
    return grid
