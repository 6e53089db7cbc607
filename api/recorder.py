"""`Recorder`: group commit. Concurrent submissions are gathered (up to `max_group` per round),
written in one transaction, then enqueued in one transport round trip. Nothing is enqueued without
its commit; a failed commit fails the whole group with 503 and enqueues nothing. A failed enqueue
after the commit also answers 503, and withdraws the group's jobs first (`api/withdrawals.py`): a
503 is never run later. A job with an `Idempotency-Key` is the exception: it stays queued (the
reconciler enqueues it), and a retry with the key returns it. Each submission is an `enqueue`
span (tracing on); its requests carry the HTTP request's id and that span's trace context to the
batcher.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from dataclasses import dataclass, field
from functools import partial

from sqlalchemy.ext.asyncio import AsyncEngine

from tgq.api.db import api_keys, in_transaction, store
from tgq.api.errors import UnavailableError, dependency_failure
from tgq.api.key_policy import KeyAccess
from tgq.api.loops import BackgroundLoop
from tgq.api.withdrawals import Withdrawals
from tgq.batcher import tracing
from tgq.batcher.logs import current_request_id
from tgq.batcher.messages import SubmitRequest
from tgq.batcher.transport.aio import AsyncApiTransport

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Pending:
    job: store.NewJob
    requests: list[SubmitRequest]
    done: asyncio.Future[store.JobRecord] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )


class Recorder(BackgroundLoop):
    """Commits jobs, then enqueues their requests; many concurrent submissions per round."""

    def __init__(
        self, db: AsyncEngine, transport: AsyncApiTransport, *, max_group: int = 256
    ) -> None:
        self.db = db
        self.transport = transport
        self.max_group = max_group
        self._queue: asyncio.Queue[_Pending] = asyncio.Queue()
        self.num_rounds = 0
        self.withdrawals = Withdrawals(db, transport)

    def start(self) -> None:
        super().start()
        self.withdrawals.start()

    async def stop(self) -> None:
        await super().stop()
        await self.withdrawals.stop()

    async def submit(self, job: store.NewJob, requests: list[SubmitRequest]) -> store.JobRecord:
        """Returns the job's row once it is committed and its requests are enqueued."""
        with tracing.span("enqueue", job_id=job.job_id, num_requests=len(requests)):
            pending = _Pending(job, stamped(requests))
            self._queue.put_nowait(pending)
            record = await asyncio.shield(pending.done)
        _log_queued(job, len(requests))
        return record

    async def submit_alone(
        self, job: store.NewJob, requests: list[SubmitRequest], *, key: KeyAccess | None = None
    ) -> tuple[store.JobRecord, bool]:
        """A job in its own transaction (one with an idempotency key, or of a key with a
        queued-jobs limit, checked in that transaction): (the job, created). A repeat of the
        idempotency key returns the first job and enqueues nothing."""
        with tracing.span("enqueue", job_id=job.job_id, num_requests=len(requests)):
            try:
                async with self.db.begin() as conn:
                    await api_keys.check_room_for_work(conn, key=key)
                    fields = {f.name: getattr(job, f.name) for f in dataclasses.fields(job)}
                    record, created = await store.create_job(conn, **fields)
            except Exception as error:
                if dependency_failure(error) is None:
                    raise
                raise _unavailable(error) from error
            if created:
                try:
                    await self._enqueue(stamped(requests))
                except UnavailableError as error:
                    message = (
                        f"The queue is unavailable; job {job.job_id} is recorded and will run"
                        " once it is back: repeat the request with the same Idempotency-Key"
                        " to get it"
                    )
                    raise UnavailableError(message) from error
        if created:
            _log_queued(job, len(requests))
        return record, created

    async def _run(self) -> None:
        while True:
            group = [await self._queue.get()]
            await asyncio.sleep(0)  # let submissions that are already running join this round
            while len(group) < self.max_group and not self._queue.empty():
                group.append(self._queue.get_nowait())
            await self._commit_and_enqueue(group)

    async def _commit_and_enqueue(self, group: list[_Pending]) -> None:
        self.num_rounds += 1
        requests = [r for pending in group for r in pending.requests]
        jobs = [pending.job for pending in group]
        try:
            records = await in_transaction(self.db, partial(store.create_jobs, jobs=jobs))
        except Exception as error:  # every waiter learns it; the loop goes on
            _fail(group, _unavailable(error))
            return
        try:
            await self._enqueue(requests)
        except UnavailableError as error:  # committed, perhaps partly enqueued: withdrawn
            job_ids = [pending.job.job_id for pending in group]
            reason = f"unavailable: the queue could not take it ({error.__cause__!r})"
            await self.withdrawals.withdraw(job_ids, [r.request_id for r in requests], reason)
            _fail(group, error)
            return
        for pending, record in zip(group, records, strict=True):
            if not pending.done.done():
                pending.done.set_result(record)

    async def _enqueue(self, requests: list[SubmitRequest]) -> None:
        try:
            await self.transport.submit(requests)
        except Exception as error:
            log.error("enqueue failed after commit (%d requests): %r", len(requests), error)
            raise UnavailableError(
                "The queue is unavailable; nothing was run. Retry later"
            ) from error


def _fail(group: list[_Pending], error: UnavailableError) -> None:
    for pending in group:
        if not pending.done.done():
            pending.done.set_exception(error)


def stamped(requests: list[SubmitRequest]) -> list[SubmitRequest]:
    """The requests with the HTTP request's id and the current span's `traceparent`, so the
    batcher's log lines and spans about them join the api's."""
    request_id, parent = current_request_id.get(), tracing.traceparent()
    if not request_id and not parent:
        return requests
    return [
        dataclasses.replace(r, http_request_id=request_id, traceparent=parent) for r in requests
    ]


def _log_queued(job: store.NewJob, num_requests: int) -> None:
    """Relates the job (and its items, `job_id.N` in the batcher's lines) to the request id."""
    message = "job %s: %d requests queued"
    log.info(message, job.job_id, num_requests, extra={"job_id": job.job_id, "job_kind": job.kind})


def _unavailable(error: Exception) -> UnavailableError:
    log.error("database unavailable: %s", error)
    return UnavailableError("The database is unavailable; nothing was queued. Retry later")
