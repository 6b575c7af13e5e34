"""Running the batches: one trace per batch locally, NDIF sessions of many remotely, with retries; no result built.

``run_trace`` runs one batch's in-trace call (``trace.LogitCall`` / ``trace.DirectionCall``) and returns its
``Readout`` (locally, or as one NDIF request); ``run`` runs every batch not done yet, in order, with a progress bar:
remotely in as few sessions as NDIF's job limit allows (``session``), stopping at the first session that fails for
good and returning what completed (``Ran``): the result stage builds the ``Attribution`` or the
``RemoteBatchError`` from it.
"""

from __future__ import annotations

import nnsight
import torch

from ..trace.readout import Readout
from .remote import register_for_remote, retry_or_raise
from .session import How, Ran, Work, run_sessions, trace_options, unpack


def run_trace(model, plan, batch, call, remote=False, intervene=None) -> Readout:
    """One trace of ``batch`` running ``call.run(model)`` (an in-trace call returning a ``Readout``).

    The head runs on the last positions the batch attributes only (transformers' ``logits_to_keep``), where the
    family allows it: every prompt's last token with left padding and ``position=-1``.

    ``remote``: False, True (NDIF) or a server URL. Remotely the recipe runs server side and one
    ``[batch, n_components + len(Readout.FIELDS)]`` tensor comes back; a transient failure (server unreachable, HTTP
    5xx) is retried ``remote.RETRIES`` times, anything else raises a ``RemoteError`` naming its cause.

    ``intervene``: ``fn(model)``, nnsight code editing the forward pass (see ``attribute``). It runs in the invoke
    that carries the batch and the recipe in a second, empty invoke over the same rows: an invoke reads modules in
    forward order, so the recipe (which reads every block from the first) cannot share one with an edit at a later
    block, and the edits of the first invoke are made before the second reads the same site.
    """
    trace_kwargs = trace_options(model, plan, batch)  # only the attributed positions need logits
    if remote:
        register_for_remote()
        trace_kwargs["remote"] = remote
    attempt = 0
    while True:  # a transient remote failure is retried a bounded number of times (remote.py)
        try:
            if intervene is None:
                with torch.no_grad(), model.trace(dict(batch.encoding), **trace_kwargs):
                    out = call.run(model)
                    out = nnsight.save(out if not remote else out.pack())  # locally the readout itself
            else:
                with torch.no_grad(), model.trace(**trace_kwargs) as tracer:
                    with tracer.invoke(dict(batch.encoding)):
                        intervene(model)
                    with tracer.invoke():
                        out = call.run(model)
                        out = nnsight.save(out if not remote else out.pack())
            break
        except Exception as error:
            if not remote:
                raise
            attempt = retry_or_raise(error, attempt, remote)
    if type(out) is Readout and out.gathered_into is not None:  # local: already what unpacking its pack() gives
        return out
    return unpack(call, out if remote else out.pack())


def run(model, plan, work: Work, how: How, done: tuple = ()) -> Ran:
    """Run ``work.calls[k]`` on ``work.batches[k]`` for every batch after the ``done`` readouts, in order
    (``work.intervene``: the edit each trace makes first).

    Locally one trace a batch, and a failure raises as it is. Remotely (``how.remote``) the batches travel in NDIF
    sessions, as few as the job limit allows (``session.run_sessions``), and a session that still fails after its
    retries stops the run: the returned ``Ran`` holds the readouts so far and the ``RemoteError``.
    ``how.progress``: a progress bar over the batches (default: when there is more than one).
    """
    if how.remote:
        return run_sessions(model, plan, work, how, done)
    batches = work.batches
    todo = list(zip(batches, work.calls))[len(done):]
    show = how.progress if how.progress is not None else len(batches) > 1
    if show:
        from tqdm.auto import tqdm

        todo = tqdm(todo, desc=how.desc, unit="batch", initial=len(done), total=len(batches))
    readouts = list(done)
    for batch, call in todo:
        readouts.append(run_trace(model, plan, batch, call, False, work.intervene))
    return Ran(tuple(readouts))
