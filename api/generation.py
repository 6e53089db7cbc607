"""Generation in the api: every request becomes a row in the database, committed, then a message
in the transport; its tokens are followed from the transport, its final result is written back to
the database by the persister, whoever waits for it.

- `Recorder`: group commit. Concurrent submissions are gathered (up to `max_group` per round),
  written in one transaction, then enqueued in one transport round trip. Nothing is enqueued
  without its commit; a failed commit fails the whole group with 503 and enqueues nothing. A
  failed enqueue after the commit also answers 503, and withdraws the group's jobs first
  (`api/withdrawals.py`): a 503 is never run later. A job with an `Idempotency-Key` is the
  exception: it stays queued (the reconciler enqueues it), and a retry with the key returns it.
  Each submission is an `enqueue` span (tracing on); its requests carry the HTTP request's id
  and that span's trace context to the batcher.
- `Persister`: pulls durable final results from the transport, records them idempotently (unique
  per job item), and acks them only after the commit.
- `follow`: a request's token events in order, then its final result.
- `Running`: items whose first token the transport has seen are marked `running`, in batches.

Request ids are `"{job_id}.{item_index}"`, so a final result names its row without a lookup.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import secrets
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from tgq.api.db import store
from tgq.api.errors import UnavailableError, dependency_failure
from tgq.api.withdrawals import Withdrawals
from tgq.batcher import tracing
from tgq.batcher.logs import current_request_id
from tgq.batcher.messages import FinalResult, SubmitRequest, TokenEvent
from tgq.batcher.transport.aio import AsyncApiTransport
from tgq.batcher.transport.base import StoredFinal

log = logging.getLogger(__name__)

FOLLOW_POLL_S = 4.0  # one blocking read waits at most this long (under the socket timeout)


def new_job_id() -> str:
    return f"job_{secrets.token_hex(16)}"


def request_id_of(job_id: str, item_index: int) -> str:
    return f"{job_id}.{item_index}"


def parse_request_id(request_id: str) -> tuple[str, int] | None:
    job_id, _, index = request_id.rpartition(".")
    if not job_id.startswith("job_") or not index.isdigit():
        return None
    return job_id, int(index)


RECANCEL_S = 0.5  # how often `cancel_and_wait` repeats a cancellation the task has not taken


async def cancel_and_wait(task: asyncio.Task[Any]) -> None:
    """Cancels `task` and waits until it has ended; an exception it ended with is logged.

    A cancellation can get lost inside a library: the api's monitor loop once went back to
    sleeping after a Redis pipeline swallowed its CancelledError, and the shut-down waited for
    it forever. So the cancellation is repeated every `RECANCEL_S` until the task is done.
    """
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=RECANCEL_S)
    if not task.cancelled() and (error := task.exception()) is not None:
        log.error("task %s ended with %r", task.get_name(), error)


class _Loop:
    """A background loop of the api: `start` runs `_run` on a task, `stop` cancels it."""

    _task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=type(self).__name__.lower())

    async def stop(self) -> None:
        if self._task is not None:
            await cancel_and_wait(self._task)

    async def _run(self) -> None:
        raise NotImplementedError


@dataclass(slots=True)
class _Pending:
    job: store.NewJob
    requests: list[SubmitRequest]
    done: asyncio.Future[store.JobRecord] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )


class Recorder(_Loop):
    """Commits jobs, then enqueues their requests; many concurrent submissions per round."""

    def __init__(
        self, engine: AsyncEngine, transport: AsyncApiTransport, *, max_group: int = 256
    ) -> None:
        self.engine = engine
        self.transport = transport
        self.max_group = max_group
        self._queue: asyncio.Queue[_Pending] = asyncio.Queue()
        self.num_rounds = 0
        self.withdrawals = Withdrawals(engine, transport)

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

    async def submit_idempotent(
        self, job: store.NewJob, requests: list[SubmitRequest]
    ) -> tuple[store.JobRecord, bool]:
        """A job with an idempotency key, in its own transaction: (the job, created). A repeat of
        the key returns the first job and enqueues nothing."""
        with tracing.span("enqueue", job_id=job.job_id, num_requests=len(requests)):
            try:
                async with self.engine.begin() as conn:
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
        try:
            async with self.engine.begin() as conn:
                records = await store.create_jobs(conn, jobs=[pending.job for pending in group])
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


STOP_GRACE_S = 10.0  # the persister's last round at shut-down, before it is cancelled


class Persister(_Loop):
    """Writes every final result to the database, then acks it in the transport."""

    def __init__(
        self,
        engine: AsyncEngine,
        transport: AsyncApiTransport,
        consumer: str,
        *,
        max_count: int = 256,
        block_ms: int = 1000,
        on_results: Callable[[list[StoredFinal]], None] = lambda finals: None,
    ) -> None:
        self.engine = engine
        self.on_results = on_results
        self.transport = transport
        self.consumer = consumer
        self.max_count = max_count
        self.block_ms = block_ms
        self.num_written = 0
        self._is_stopping = False
        # Pulled but not yet written and acked (the database was away): retried before anything
        # new. They stay pending to this consumer, so without this they would wait for the
        # lease (`lease_s`) to lapse before being claimed again.
        self._unwritten: list[StoredFinal] = []

    async def _run(self) -> None:
        backoff_s = 0.1
        while not self._is_stopping:
            try:
                await self.persist_once()
                backoff_s = 0.1
            except asyncio.CancelledError:
                raise
            except Exception as error:  # database or Redis down: retry; nothing was acked
                log.warning("persister: %s; retrying in %.1fs", error, backoff_s)
                await asyncio.sleep(backoff_s)
                backoff_s = min(backoff_s * 2, 5.0)

    async def stop(self) -> None:
        """Lets the round in progress finish, then persists what is already stored without
        waiting for more: a replica that shuts down cleanly leaves no finished job `running`
        until another replica claims its results after the lease."""
        self._is_stopping = True
        if self._task is not None:  # a round cut short would leave its results pending to us
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(self._task), STOP_GRACE_S)
        await super().stop()
        try:
            while await self.persist_once(block_ms=0):
                pass
        except Exception as error:  # database or Redis away: the results wait for the next one
            log.warning("persister: results left for another replica: %s", error)

    async def persist_once(self, *, block_ms: int | None = None) -> int:
        wait_ms = self.block_ms if block_ms is None else block_ms
        finals = self._unwritten or await self.transport.pull_finals(
            self.consumer, self.max_count, wait_ms
        )
        if not finals:
            return 0
        self._unwritten = finals
        results = []
        for stored in finals:
            new = new_result(stored.result)
            if new is None:
                log.warning(
                    "final result for unknown request id %r dropped", stored.result.request_id
                )
            else:
                results.append(new)
        try:
            async with self.engine.begin() as conn:
                written = await store.record_results(conn, results=results)
        except Exception:  # a result the database refuses, or the database away: one by one
            written = [await self._record_alone(result) for result in results]
        await self.transport.ack_finals([stored.entry_id for stored in finals])
        self._unwritten = []
        self.num_written += sum(written)
        self.on_results(finals)
        return len(finals)

    async def _record_alone(self, result: store.NewResult) -> bool:
        """One result in its own transaction. One the database refuses while it takes
        others (a value it cannot store) is recorded as a failed result that keeps only its
        ids, so its job still ends; when the database itself is away, the error propagates
        (nothing is acked)."""
        try:
            async with self.engine.begin() as conn:
                return (await store.record_results(conn, results=[result]))[0]
        except Exception as error:
            if not await self._database_is_up():
                raise
            log.error("persister: result %s refused (%r); failing it", result.request_id, error)
            refused = type(error).__name__
        stand_in = dataclasses.replace(
            result, text=None, token_ids=[], logprobs=None, finish_reason="failed",
            finish_detail=f"the database refused this result ({refused})",
            num_prompt_tokens=0, num_output_tokens=0, num_cached_tokens=0,
        )  # fmt: skip
        async with self.engine.begin() as conn:
            return (await store.record_results(conn, results=[stand_in]))[0]

    async def _database_is_up(self) -> bool:
        try:
            async with self.engine.connect() as conn:
                await conn.execute(text("SELECT 1"))
        except Exception:
            return False
        return True


def new_result(result: FinalResult) -> store.NewResult | None:
    where = parse_request_id(result.request_id)
    if where is None:
        return None
    job_id, item_index = where
    return store.NewResult(
        job_id=job_id,
        item_index=item_index,
        request_id=result.request_id,
        text=result.text,
        token_ids=result.token_ids,
        logprobs=result.logprobs or None,
        finish_reason=result.finish_reason,
        finish_detail=result.finish_detail,
        num_prompt_tokens=result.num_prompt_tokens,
        num_output_tokens=result.num_output_tokens,
        num_cached_tokens=result.num_cached_tokens,
        attempt=result.attempt,
        batcher_id=result.batcher_id,
    )


class Running(_Loop):
    """Marks items `running` (with their job's `started_at`) as batchers start them: reads the
    transport's started log and updates in batches. Best effort: a status, not a result."""

    def __init__(
        self, engine: AsyncEngine, transport: AsyncApiTransport, *, max_count: int = 1000
    ) -> None:
        self.engine = engine
        self.transport = transport
        self.max_count = max_count

    async def _run(self) -> None:
        cursor: str | None = None
        while True:
            try:
                cursor, request_ids = await self.transport.read_started(
                    cursor, self.max_count, 1000
                )
                if request_ids:
                    async with self.engine.begin() as conn:
                        await store.mark_running(conn, request_ids=sorted(set(request_ids)))
            except asyncio.CancelledError:
                raise
            except Exception as error:
                log.warning("marking items running failed: %s", error)
                await asyncio.sleep(1.0)


async def follow(
    transport: AsyncApiTransport, request_id: str, from_seq: int = 0
) -> AsyncIterator[TokenEvent | FinalResult]:
    """The request's token events from `from_seq` on, in order, then its final result."""
    seq = from_seq
    while True:
        events = await transport.read_tokens(request_id, seq, FOLLOW_POLL_S)
        for event in events:
            yield event
            seq = event.seq_index + 1
        if events:
            continue
        final = await transport.read_final(request_id)
        if final is not None:
            for event in await transport.read_tokens(request_id, seq, 0):
                yield event
            yield final
            return
