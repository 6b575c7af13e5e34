"""Remote generation and attribution in ONE NDIF session: the answers generated, the teacher-forced batch built
and attributed, server side; the generated ids come back with the readout.

The session body (one request) runs, per group of prompts (``transport.batches.groups``): ``model.generate``
(``run.step_readout``: a few ``[batch, steps]`` numbers), then ``answer_batch`` on the server (the answers cut at
their EOS, prompt + answer padded and its sites placed, as ``attribute`` would), then the attribution trace
(``LogitCall``, as every ``attribute`` batch). What returns is each group's step readout and packed attribution
readout; here ``answer_batch`` is built again from the returned ids (the same function of the same ids, so the same
sites in the same order) and the readouts are assembled and self-checked as ``attribute`` assembles its own
(``result.assemble``). Used for ``remote=`` without ``reduce="stats"`` and ``by="source"`` (those send two requests:
the generation, then ``attribute``); one session holds every group (the NDIF job limit is not split here).
"""

from __future__ import annotations

from typing import NamedTuple

import nnsight
import torch

from ..result import Of, assemble, layout_of, rows_of
from ..selfcheck import model_dtype
from ..trace.calls import LogitCall
from ..trace.reading import Reading, Where
from ..transport.batches import groups, prepare
from ..transport.remote import register_for_remote, retry_or_raise
from ..transport.session import trace_options, unpack
from .inputs import Settings
from .run import (
    chosen_ids,
    collect,
    contrast_grid,
    eos_ids,
    forced,
    left_padded,
    pad_id,
    row_of,
    step_readout,
)


def answer_batch(model, prompts, group, out: tuple, stop: set[int], contrast, chosen):
    """The teacher-forced ``Batch`` of ``group``'s answers (``out``: the group's ``step_readout``)."""
    rows = [row_of(out, k, stop) for k in range(len(group))]
    answers = [r[0] for r in rows]
    sequences, spans = forced([prompts[i] for i in group], answers)
    grid = contrast_grid(contrast, answers, [[int(t) for t in r[2]] for r in rows],
                         None if chosen is None else [chosen[i] for i in group])
    return prepare(model, sequences, "next", grid, spans, rows=group)


class Asked(NamedTuple):
    """What the session generates and contrasts: the ``Settings``, per-step contrast ids (or None) and the
    ``contrast`` as given."""

    settings: Settings
    chosen: list | None
    contrast: object


def call_of(plan, batch, reading: Reading) -> LogitCall:
    return LogitCall(plan, Where(batch.positions, batch.rows), batch.targets, reading=reading)


def generate_and_attribute(model, plan, prompts: list, asked: Asked, question):
    """``(Generated, the assembled attribution)`` of one NDIF session (see the module docstring); ``question``: the
    call's ``Question`` (its granularity, dictionaries, check, tolerance, reduce, remote and batch size)."""
    settings, chosen, contrast, q = asked.settings, asked.chosen, asked.contrast, question
    reading = Reading(q.by, None, False, q.check, q.fast.lane)
    remote, batch_size = q.remote, q.batch_size
    stop, pad = eos_ids(model, settings), pad_id(model, settings)
    run_groups = groups(model, plan, prompts, batch_size, [list(p) for p in prompts])
    work = [(g, left_padded([prompts[i] for i in g], pad), chosen_ids(chosen, g, settings.max_new_tokens))
            for g in run_groups]
    kwargs = settings.kwargs()
    register_for_remote()
    attempt = 0
    while True:  # nnsight reads the session's code from this frame: the body stays here, whole
        try:
            with torch.no_grad(), model.session(remote=remote):
                if settings.seed is not None:
                    torch.manual_seed(settings.seed)
                results = []
                for group, encoding, ids in work:
                    with model.generate(dict(encoding), **kwargs) as tracer:
                        out = step_readout(tracer.result, int(encoding["input_ids"].shape[1]), ids)
                    batch = answer_batch(model, prompts, group, out, stop, contrast, chosen)
                    with model.trace(dict(batch.encoding), **trace_options(model, plan, batch)):
                        packed = call_of(plan, batch, reading).run(model).pack()
                    results.append((out, packed))
                results = nnsight.save(results)
            break
        except Exception as error:  # noqa: BLE001 (classified by retry_or_raise: retried, or raised as RemoteError)
            attempt = retry_or_raise(error, attempt, remote)
    rows: list = [None] * len(prompts)
    batches, readouts = [], []
    for (group, _, _), (out, packed) in zip(work, results):
        batch = answer_batch(model, prompts, group, out, stop, contrast, chosen)
        batches.append(batch)
        readouts.append(unpack(call_of(plan, batch, reading), packed))
        for k, i in enumerate(group):
            rows[i] = row_of(out, k, stop)
    of = Of(plan, q.by, model_dtype(model), q.tolerance)
    attr = assemble(of, rows_of(batches), readouts, [i for g in run_groups for i in g],
                    layout_of(batches, run_groups, model.tokenizer), q.reduce)
    return collect(prompts, rows), attr
