"""Remote generation through the one session loop: the answers generated and, in the same NDIF request, their
teacher-forced batch built and attributed server side; the generated ids come back with the readout.

A remote generation is ``transport.session.run_sessions`` with another session body (``send_generation``), so it
is cut under NDIF's job limit, retried and stopped as every remote run is (``Work``, ``How``). Each group of prompts
(``transport.batches.groups``) is one item of the work: a ``GenerateCall``. Its body runs ``model.generate``
(``run.step_readout``: a few ``[batch, steps]`` numbers a group) and, when the call also attributes
(``GenerateCall.forced``), ``answer_batch`` on the server (the answers cut at their EOS, prompt + answer padded and
its sites placed, as ``attribute`` would), then the attribution trace (``LogitCall``, as every ``attribute``
batch), an edit (``intervene``) made at every generation step and in the trace. What returns is each group's step
readout and packed attribution readout; here ``answer_batch`` is built again from the returned ids (the same
function of the same ids, so the same sites in the same order) and the readouts are assembled and self-checked as
``attribute`` assembles its own (``result.assemble``). ``by="source"`` and ``reduce="stats"`` generate through the
same loop (a call that only generates), then attribute as ``attribute`` does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import nnsight
import torch

from ..errors import RemoteError
from ..result import Of, assemble, layout_of, rows_of
from ..selfcheck import model_dtype
from ..trace.calls import LogitCall
from ..trace.reading import Reading, Where
from ..transport.batches import Group, groups, prepare
from ..transport.remote import register_for_remote, retry_or_raise
from ..transport.session import How, Work, run_sessions, trace_options, unpack
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


class Asked(NamedTuple):
    """What the session generates and contrasts: the ``Settings``, per-step contrast ids (or None) and the
    ``contrast`` as given."""

    settings: Settings
    chosen: list | None
    contrast: object


@dataclass(frozen=True)
class Forced:
    """How a group's teacher-forced batch is built from its answers and what its trace reads: the group (each
    prompt's index in the user's call) and its prompts' own ids, the ids that end an answer, the contrast (as given,
    and its per-step ids of the group's rows) and the ``Reading``."""

    group: tuple
    prompts: tuple
    stop: frozenset
    contrast: object
    chosen: tuple | None
    reading: Reading

    def batch(self, model, out: tuple):
        """The teacher-forced ``Batch`` of the group's answers (``out``: its ``step_readout``)."""
        rows = [row_of(out, k, set(self.stop)) for k in range(len(self.prompts))]
        answers = [r[0] for r in rows]
        sequences, spans = forced(self.prompts, answers)
        grid = contrast_grid(self.contrast, answers, [[int(t) for t in r[2]] for r in rows],
                             None if self.chosen is None else list(self.chosen))
        return prepare(model, sequences, "next", grid, spans, Group(list(self.group)))

    def call(self, plan, batch) -> LogitCall:
        """The batch's in-trace attribution."""
        return LogitCall(plan, Where(batch.positions, batch.rows), batch.targets, reading=self.reading)


@dataclass(frozen=True)
class GenerateCall:
    """One group's generation (``kwargs`` of ``model.generate``, the padded prompts' ``width``, the per-step
    contrast ``chosen`` ids ``[n, steps]``, the sampler's ``seed``) and, unless None, its attribution (``forced``)."""

    kwargs: dict
    width: int
    chosen: torch.Tensor
    seed: int | None = None
    forced: Forced | None = None


def send_generation(model, plan, batches, calls, remote, intervene=None) -> list:
    """One NDIF request generating every group (``batches[k]``: its padded encoding) with ``calls[k]``, each
    followed by its attribution trace where the call has one; ``(step readout, packed readout or None)`` a group.
    A transient failure is retried, anything else raises a ``RemoteError`` (``transport.session``'s contract)."""
    register_for_remote()
    attempt = 0
    while True:  # nnsight reads the session's code from this frame: the body stays here, whole
        try:
            with torch.no_grad(), model.session(remote=remote):
                results = []
                for encoding, call in zip(batches, calls):
                    if call.seed is not None:  # each group from the seed, as a local generation
                        torch.manual_seed(call.seed)
                    if intervene is None:
                        with model.generate(dict(encoding), **call.kwargs) as tracer:
                            out = step_readout(tracer.result, call.width, call.chosen)
                    else:
                        with model.generate(**call.kwargs) as tracer:
                            with tracer.invoke(dict(encoding)):
                                for _ in tracer.all():  # the edit at every step
                                    intervene(model)
                            with tracer.invoke():
                                out = step_readout(tracer.result, call.width, call.chosen)
                    packed = None
                    if call.forced is not None:
                        batch = call.forced.batch(model, out)
                        options = trace_options(model, plan, batch)
                        if intervene is None:
                            with model.trace(dict(batch.encoding), **options):
                                packed = call.forced.call(plan, batch).run(model).pack()
                        else:
                            with model.trace(**options) as tracer:
                                with tracer.invoke(dict(batch.encoding)):
                                    intervene(model)
                                with tracer.invoke():
                                    packed = call.forced.call(plan, batch).run(model).pack()
                    results.append((out, packed))
                results = nnsight.save(results)
            break
        except Exception as error:  # noqa: BLE001 (classified by retry_or_raise: retried, or raised as RemoteError)
            attempt = retry_or_raise(error, attempt, remote)
    return results


def generation_work(model, plan, prompts: list, asked: Asked, question):
    """``(groups, Work)``: each group of ``prompts`` (own ids) as one ``GenerateCall`` (attributing too unless
    the question splits by source or reduces to statistics, which ``attribute`` does after)."""
    settings, chosen, q = asked.settings, asked.chosen, question
    stop, pad = eos_ids(model, settings), pad_id(model, settings)
    kwargs = settings.kwargs(edited=q.edits)
    attributes = q.by != "source" and q.stats is None
    reading = q.reading()
    run_groups = groups(model, plan, prompts, q.batch_size, [list(p) for p in prompts])
    encodings, calls = [], []
    for g in run_groups:
        encoding = left_padded([prompts[i] for i in g], pad)
        ids = chosen_ids(chosen, g, settings.max_new_tokens)
        mine = None if chosen is None else tuple(chosen[i] for i in g)
        how = Forced(tuple(g), tuple(tuple(prompts[i]) for i in g), frozenset(stop), asked.contrast, mine, reading)
        encodings.append(encoding)
        calls.append(GenerateCall(kwargs, int(encoding["input_ids"].shape[1]), ids, settings.seed,
                                  how if attributes else None))
    return run_groups, Work(encodings, calls, q.intervene, send_generation)


def remote_generation(model, plan, prompts: list, asked: Asked, question):
    """``(Generated, the assembled attribution or None)`` of the remote sessions (see the module docstring);
    ``question``: the call's ``Question`` (its granularity, dictionaries, check, tolerance, reduce, edit, remote
    and batch size). The attribution is None when the question attributes after (by source, statistics)."""
    q, stop = question, eos_ids(model, asked.settings)
    run_groups, work = generation_work(model, plan, prompts, asked, q)
    ran = run_sessions(model, plan, work, How(q.remote, q.progress, "generate"))
    if ran.error is not None:  # an answer half generated cannot be resumed: the whole call fails with its cause
        raise RemoteError(f"the remote generation failed after {len(ran.readouts)} of {len(run_groups)} "
                          f"group(s): {ran.error}") from ran.error
    rows: list = [None] * len(prompts)
    batches, readouts = [], []
    for group, call, (out, packed) in zip(run_groups, work.calls, ran.readouts):
        for k, i in enumerate(group):
            rows[i] = row_of(out, k, stop)
        if call.forced is not None:
            batch = call.forced.batch(model, out)
            batches.append(batch)
            readouts.append(unpack(call.forced.call(plan, batch), packed))
    if not batches:
        return collect(prompts, rows), None
    of = Of(plan, q.by, model_dtype(model), q.tolerance, edits=q.edits)
    attr = assemble(of, rows_of(batches), readouts, [i for g in run_groups for i in g],
                    layout_of(batches, run_groups, model.tokenizer), q.reduce)
    return collect(prompts, rows), attr
