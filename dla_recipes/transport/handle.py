"""``attribute(..., remote=..., blocking=False)``: the jobs are submitted and a ``RemoteJob`` handle comes back.

The batches are cut into NDIF sessions as a blocking run cuts them (``session.JOB_LIMIT``; nothing is measured
before sending, so ``JobLimit.batch_seconds`` or else ``assumed_batch_seconds`` sizes them), each submitted without
waiting (nnsight's non-blocking ``RemoteBackend``: a plain POST, no websocket). The handle then::

    job = dla_recipes.attribute(model, prompts, " Paris", remote=True, batch_size=8, blocking=False)
    job.status()    # "RUNNING", "COMPLETED", "ERROR", "LOST" (the server no longer knows a job: it restarted), ...
    job.result()    # waits (polls GET /response/{id}), downloads each session's readouts once, returns the Attribution
    job.resume()    # sends again the jobs that were lost or failed transiently, keeps what came back; returns the job

A result already downloaded is kept in the handle, so after a server restart ``job.resume().result()`` sends only
the sessions whose results did not come back. A server-side exception in a session is final (``result()`` raises
its ``RemoteError``); a lost job, an unreachable server or a 5xx is not (``result()`` raises a ``RemoteError``
saying to call ``resume()``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import nnsight
import torch

from ..errors import RemoteError
from .remote import is_transient, register_for_remote, remote_error
from .session import JOB_LIMIT, How, Work, chunks, session_work, unpack
from .versions import check_versions

IN_PROGRESS = ("SUBMITTED", "RECEIVED", "QUEUED", "PROVISIONING", "DEPLOYING", "DISPATCHED", "RUNNING", "LOG")
ORDER = ("ERROR", "LOST", "UNREACHABLE", "UNSENT") + IN_PROGRESS + ("COMPLETED",)  # status(): the first one present


@dataclass
class Job:
    """One submitted session: its batches, nnsight's backend (``job_id``), its last status, its readouts."""

    batches: range
    backend: object = None
    status: str = "UNSENT"
    readouts: list | None = None
    error: RemoteError | None = None


def submit_session(model, plan, batches: Sequence, calls: Sequence, remote, intervene=None):
    """POST one session running every batch, without waiting: nnsight's backend, holding the ``job_id``."""
    register_for_remote()
    work = session_work(model, plan, batches, calls)
    with torch.no_grad(), model.session(remote=remote, blocking=False) as session:  # the body runs server side
        packs = []
        for encoding, options, call in work:
            if intervene is None:
                with model.trace(encoding, **options):
                    packed = call.run(model).pack()
            else:
                with model.trace(**options) as tracer:
                    with tracer.invoke(encoding):
                        intervene(model)
                    with tracer.invoke():
                        packed = call.run(model).pack()
            packs.append(packed)
        packs = nnsight.save(packs)  # comes back in the result, under its name
    return session.backend


class RemoteJob:
    """The handle of a non-blocking remote ``attribute``: ``status()``, ``result()``, ``resume()`` (module docs)."""

    def __init__(self, model, plan, work: Work, how: How, finish: Callable):
        """Submit ``work`` (its batches, calls and edit) as ``how`` says (its ``remote`` and job ``limit``);
        ``finish(readouts)`` assembles the result once every job is back."""
        self.model, self.plan, self.batches, self.calls = model, plan, tuple(work.batches), tuple(work.calls)
        self.remote, self.intervene, self.finish = how.remote, work.intervene, finish
        per_job = (how.limit or JOB_LIMIT).per_job()
        self.jobs = [Job(part) for part in chunks(0, len(self.batches), per_job)]
        self.attribution = None
        check_versions(how.remote)
        self.send()

    def __repr__(self) -> str:
        return f"RemoteJob({self.status()}: {len(self.jobs)} job(s), {len(self.batches)} batch(es))"

    @property
    def job_ids(self) -> list[str | None]:
        return [getattr(job.backend, "job_id", None) for job in self.jobs]

    def send(self, which: Sequence[Job] | None = None) -> None:
        """Submit ``which`` jobs (default: those not sent yet); a job that cannot be sent keeps its error."""
        for job in self.jobs if which is None else which:
            if which is None and job.status != "UNSENT":
                continue
            part = job.batches
            try:
                job.backend = submit_session(self.model, self.plan, [self.batches[k] for k in part],
                                             [self.calls[k] for k in part], self.remote, self.intervene)
                job.status, job.error = "SUBMITTED", None
            except Exception as error:  # noqa: BLE001 (kept on the job, named by status() and result())
                job.error = remote_error(error, self.remote)
                job.status = "UNREACHABLE" if is_transient(error) else "ERROR"

    def poll(self, job: Job) -> None:
        """Ask the server for ``job``'s latest status (GET /response/{id}); download its readouts when COMPLETED."""
        import httpx
        from nnsight.schema.response import ResponseModel

        if job.status not in IN_PROGRESS:
            return
        backend = job.backend
        try:
            answer = httpx.get(f"{backend.host}/response/{backend.job_id}", timeout=30.0,
                               headers={"ndif-api-key": backend.api_key} if backend.api_key else None)
            if answer.status_code == 404:
                job.status = "LOST"
                job.error = RemoteError(f"the NDIF server at {backend.host} does not know job {backend.job_id} "
                                        "(it restarted, or forgot it)")
                return
            answer.raise_for_status()
            response = ResponseModel.model_validate_json(answer.text)
            job.status = str(getattr(response.status, "value", response.status)).upper()
            job.status = "RUNNING" if job.status == "LOG" else job.status  # a log line: still running
            if job.status in ("COMPLETED", "ERROR"):
                saves = backend.handle(response)  # nnsight: raises its RemoteError on ERROR, downloads on COMPLETED
                job.readouts = [unpack(self.calls[k], packed) for k, packed in zip(job.batches, saves["packs"])]
        except Exception as error:  # noqa: BLE001 (kept on the job, named by status() and result())
            job.error = remote_error(error, self.remote)
            job.status = "UNREACHABLE" if is_transient(error) else "ERROR"

    def status(self) -> str:
        """The least advanced status of the jobs: "COMPLETED" once every result is here; "ERROR" when one failed
        for good; "LOST" / "UNREACHABLE" when one needs ``resume()``; else "QUEUED", "RUNNING", ..."""
        for job in self.jobs:
            self.poll(job)
        present = {job.status for job in self.jobs}
        return next(status for status in ORDER if status in present)

    def result(self, timeout: float | None = None, poll_s: float = 0.2):
        """Wait for every job, and return the ``Attribution`` (self-checked). Raises a ``RemoteError`` when a job
        failed (saying whether ``resume()`` can help), or when ``timeout`` seconds pass first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.attribution is None:
            status = self.status()
            if status == "COMPLETED":
                self.attribution = self.finish(tuple(r for job in self.jobs for r in job.readouts))
                break
            failed = next((job for job in self.jobs if job.status in ("ERROR", "LOST", "UNREACHABLE", "UNSENT")),
                          None)
            if failed is not None:
                first, last = failed.batches[0] + 1, failed.batches[-1] + 1
                advice = ("call .resume() to send it again" if failed.status != "ERROR" else
                          "sending it again would fail the same way")
                raise RemoteError(f"the job of batches {first}-{last} of {len(self.batches)} did not complete "
                                  f"({failed.status}): {failed.error}\n\n{advice}") from failed.error
            if deadline is not None and time.monotonic() > deadline:
                raise RemoteError(f"the remote jobs are not done after {timeout} s ({status}): call .result() again")
            time.sleep(poll_s)
        return self.attribution

    def resume(self) -> RemoteJob:
        """Send again every job that was lost (server restarted), could not reach the server, or failed transiently;
        the results already here are kept. Returns this handle (``job.resume().result()``)."""
        for job in self.jobs:
            self.poll(job)
        again = [job for job in self.jobs if job.status in ("LOST", "UNREACHABLE", "UNSENT")
                 or job.status == "ERROR" and job.error is not None and is_transient(job.error)]
        self.send(again)
        return self
