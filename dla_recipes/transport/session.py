"""Remote runs in NDIF sessions: many batches in one request, split so that no job passes NDIF's job time limit.

``attribute(..., remote=..., batch_size=k)`` sends its batches in ``model.session(remote=...)`` blocks: one NDIF
request (one job) runs the traces of several batches server side, one after the other, and returns their readouts
together, instead of one request a batch. NDIF stops a job that runs past its execution timeout (an hour on the
public deployment, ``JobLimit.seconds``), so the batches are cut into sessions the job limit allows:

- ``JobLimit.batch_seconds`` is the estimate of what one batch takes server side. When it is None (the default),
  the first session of a blocking run holds one batch and its round trip (an overestimate: it includes the
  transfers and the queue) is taken as the estimate for the sessions after it;
- each session then holds ``floor(seconds * margin / batch_seconds)`` batches, at least 1, at most ``max_batches``
  (which also bounds what one request sends and one failure loses).

With ``reduce="stats"`` the session's batches are merged server side (``trace.stats.StatsReadout.merge``): one
request returns ``O(components x replicates)`` numbers however many batches it ran (the others' places hold None).

Set ``session.JOB_LIMIT = JobLimit(...)`` (or pass ``limit=``) to change it; ``JobLimit(max_batches=1)`` sends one
request a batch. A session is retried as a whole (``remote.retry_or_raise``); one that fails for good stops the
run with the readouts of the sessions before it (``Ran``), which the caller keeps and can resume from.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import nnsight
import torch

from ..errors import RemoteError
from ..trace.readout import Readout
from .remote import register_for_remote, retry_or_raise
from .versions import check_versions


@dataclass(frozen=True)
class JobLimit:
    """How remote batches are grouped into NDIF jobs (see the module docstring).

    Attributes:
        seconds: the server's job time limit (NDIF's execution timeout: 3600 s).
        margin: the fraction of ``seconds`` a job is planned to use (the estimate is rough).
        batch_seconds: the estimated server time of one batch; None: measured by a first one-batch session
            (blocking runs), or ``assumed_batch_seconds`` (``blocking=False``, which cannot measure before it sends).
        max_batches: the most batches in one job.
        assumed_batch_seconds: the estimate when nothing measured it.
    """

    seconds: float = 3600.0
    margin: float = 0.5
    batch_seconds: float | None = None
    max_batches: int = 128
    assumed_batch_seconds: float = 30.0

    def per_job(self, batch_seconds: float | None = None) -> int:
        """Batches in one job, for an estimate of ``batch_seconds`` a batch (default: this limit's own)."""
        estimate = batch_seconds if batch_seconds is not None else self.batch_seconds
        estimate = self.assumed_batch_seconds if estimate is None else estimate
        fits = math.floor(self.seconds * self.margin / max(float(estimate), 1e-9))
        return max(1, min(int(self.max_batches), fits))


JOB_LIMIT = JobLimit()


@dataclass(frozen=True)
class Work:
    """What a run sends: ``calls[k]`` on ``batches[k]``, after ``intervene``'s edit (``fn(model)`` or None).
    ``send``: the session body, ``send(model, plan, batches, calls, remote, intervene)`` -> one readout a batch
    (None: ``send_session``, each batch's trace; ``generation.session`` sends a generation and its trace)."""

    batches: Sequence
    calls: Sequence
    intervene: object = None
    send: object = None

    def part(self, indices: range) -> Work:
        """The batches and calls at ``indices``, the same edit and body."""
        return Work([self.batches[k] for k in indices], [self.calls[k] for k in indices], self.intervene, self.send)


@dataclass(frozen=True)
class How:
    """How a run goes: ``remote`` (False, True or a server URL), ``progress`` (a bar over the batches; None: when
    there is more than one), ``desc`` (the bar's label) and ``limit`` (the ``JobLimit``; None: ``JOB_LIMIT``)."""

    remote: object = False
    progress: bool | None = None
    desc: str = "DLA"
    limit: JobLimit | None = None


@dataclass(frozen=True)
class Ran:
    """What a run did: ``readouts`` of the batches that completed, in order (the ``done`` ones first), and the
    ``RemoteError`` that stopped it (None: every batch completed)."""

    readouts: tuple[Readout, ...]
    error: RemoteError | None = None


_KEEPS: dict = {}  # the model class's forward -> whether it takes logits_to_keep (inspect.signature costs ~0.5 ms)


def keeps_logits(model) -> bool:
    """Whether the model's forward takes ``logits_to_keep`` (transformers computes the head on those positions only)."""
    import inspect

    bound = model._module.forward  # a bound method, or nnsight's Controller wrapping the class's own forward
    forward = getattr(bound, "__func__", None) or getattr(bound, "__wrapped__", None)
    if forward is None or forward is not getattr(type(model._module), "forward", None):  # patched: look every time
        return "logits_to_keep" in inspect.signature(model._module.forward).parameters
    if forward not in _KEEPS:
        _KEEPS[forward] = "logits_to_keep" in inspect.signature(model._module.forward).parameters
    return _KEEPS[forward]


def trace_options(model, plan, batch) -> dict:
    """The keyword arguments of ``batch``'s trace: ``logits_to_keep`` (the head on the attributed positions only)
    where the family allows it."""
    if plan.family.logits_to_keep and keeps_logits(model):
        return {"logits_to_keep": int(batch.encoding["input_ids"].shape[1]) - int(batch.positions.min())}
    return {}


def unpack(call, packed) -> Readout:
    """The readout ``call`` sent (``packed``); None stays None (a ``reduce="stats"`` batch merged into the first
    of its session)."""
    return None if packed is None else getattr(call, "unpack", Readout.unpack)(packed)


def session_work(model, plan, batches: Sequence, calls: Sequence) -> list:
    """What a session body iterates over, one ``(encoding, trace options, call)`` a batch (travels by value)."""
    return [(dict(b.encoding), trace_options(model, plan, b), c) for b, c in zip(batches, calls)]


def send_session(model, plan, batches: Sequence, calls: Sequence, remote, intervene=None) -> list[Readout]:
    """One NDIF request running ``calls[k]`` on ``batches[k]`` for every k, in one ``model.session(remote=...)``;
    the readouts, in order. A transient failure is retried, anything else raises a ``RemoteError``."""
    register_for_remote()
    work = session_work(model, plan, batches, calls)
    attempt = 0
    while True:  # nnsight reads the session's code from this frame: the body stays here, whole
        try:
            with torch.no_grad(), model.session(remote=remote):
                packs, merged = [], None
                for encoding, options, call in work:
                    if intervene is None:
                        with model.trace(encoding, **options):
                            out = call.run(model)
                    else:
                        with model.trace(**options) as tracer:
                            with tracer.invoke(encoding):
                                intervene(model)
                            with tracer.invoke():
                                out = call.run(model)
                    if hasattr(out, "merge"):  # reduce="stats": the session's batches merged server side
                        merged = out if merged is None else merged.merge(out)
                        packs.append(None)
                    else:
                        packs.append(out.pack())
                if merged is not None:  # in the first batch's place; the others' come back as None
                    packs[0] = merged.pack()
                packs = nnsight.save(packs)
            break
        except Exception as error:  # noqa: BLE001 (classified by retry_or_raise: retried, or raised as RemoteError)
            attempt = retry_or_raise(error, attempt, remote)
    return [None if packed is None else unpack(call, packed) for call, packed in zip(calls, packs)]


def chunks(start: int, stop: int, size: int) -> list[range]:
    """``range(start, stop)`` cut into consecutive ranges of at most ``size``."""
    return [range(i, min(i + size, stop)) for i in range(start, stop, size)]


def run_sessions(model, plan, work: Work, how: How, done: tuple = ()) -> Ran:
    """Run every batch of ``work`` after the ``done`` readouts on the NDIF server, as few sessions as the job limit
    allows (``how.limit``), each session ``work.send``'s body (``send_session`` by default).

    Stops at the first session that still fails after its retries: the returned ``Ran`` holds the readouts of the
    sessions before it and the ``RemoteError``.
    """
    limit, remote = how.limit or JOB_LIMIT, how.remote
    send = work.send or send_session  # looked up at the call: a test may replace send_session
    check_versions(remote)
    readouts, n = list(done), len(work.batches)
    bar = None
    if (how.progress if how.progress is not None else n > 1) and len(done) < n:
        from tqdm.auto import tqdm

        bar = tqdm(desc=how.desc, unit="batch", initial=len(done), total=n)
    estimate = limit.batch_seconds
    try:
        while len(readouts) < n:
            start = len(readouts)
            size = 1 if estimate is None and n - start > 1 else limit.per_job(estimate)
            part = work.part(range(start, min(start + size, n)))
            began = time.monotonic()
            try:
                readouts += send(model, plan, part.batches, part.calls, remote, part.intervene)
            except RemoteError as error:
                return Ran(tuple(readouts), error)
            if estimate is None:  # measured: the round trip of this session, per batch (an overestimate)
                estimate = (time.monotonic() - began) / len(part.batches)
            if bar is not None:
                bar.update(len(part.batches))
    finally:
        if bar is not None:
            bar.close()
    return Ran(tuple(readouts))
