"""A request answered 503 is never run later.

An interactive request whose rows were committed and that then could not be enqueued or
followed (Redis away) is answered 503, and a client that gets a 503 retries: were the request
run later as well (the reconciler re-enqueueing it, or Redis coming back with it still queued),
its work would be done twice. So before the 503 is sent, the request is *withdrawn*: its job is
failed in the database (the reconciler skips terminal jobs) with the reason, and its requests
are aborted in the transport (a batcher drops an aborted request it pulls, and stops one it
runs). The database write is tried in the request, within `MARK_TIMEOUT_S`; the aborts are sent
from a background task. What fails is retried every `retry_s` for as long as this replica
lives; if the replica dies first, the reconciler's rule for interactive items (it never runs one
again, `api/reconciler.py`) still holds. A cancelled job's aborts go the same way (`abort`): the
cancel is answered once it is recorded, and its aborts reach Redis when Redis is back.
"""

from __future__ import annotations

import asyncio
import logging

from sqlalchemy.ext.asyncio import AsyncEngine

from tgq.api.db import store
from tgq.batcher.transport.aio import AsyncApiTransport

log = logging.getLogger(__name__)

MARK_TIMEOUT_S = 2.0  # the request waits this long at most for its job to be failed
RETRY_S = 0.5


class Withdrawals:
    def __init__(
        self, db: AsyncEngine, transport: AsyncApiTransport, *, retry_s: float = RETRY_S
    ) -> None:
        self.db = db
        self.transport = transport
        self.retry_s = retry_s
        self._unmarked: dict[str, str] = {}  # job id -> reason, not yet failed in the database
        self._unaborted: dict[str, str] = {}  # request id -> reason, not yet aborted
        self._has_work = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._is_failing = False  # the retries log once, not every round

    @property
    def num_pending(self) -> int:
        return len(self._unmarked) + len(self._unaborted)

    async def withdraw(self, job_ids: list[str], request_ids: list[str], reason: str) -> None:
        """Fails the jobs now (or keeps trying), and aborts their requests in the background."""
        self._unmarked.update(dict.fromkeys(job_ids, reason))
        self._unaborted.update(dict.fromkeys(request_ids, reason))
        await self._mark()
        self._has_work.set()

    async def abort(self, request_ids: list[str], reason: str) -> None:
        """Aborts the requests now; those Redis does not take are retried in the background."""
        for done, request_id in enumerate(request_ids):
            try:
                await self.transport.abort(request_id, reason)
            except Exception as error:  # Redis away
                self._log_failure(f"aborting {len(request_ids) - done} requests", error)
                self._unaborted.update(dict.fromkeys(request_ids[done:], reason))
                self._has_work.set()
                return

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="withdrawals")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self.num_pending:
            log.error("withdrawals left undone at shut-down: %d", self.num_pending)

    async def _run(self) -> None:
        while True:
            await self._has_work.wait()
            await self._mark()
            await self._abort()
            if self.num_pending:
                await asyncio.sleep(self.retry_s)
            else:
                self._has_work.clear()

    async def _mark(self) -> None:
        pending = dict(self._unmarked)
        if not pending:
            return
        try:
            async with asyncio.timeout(MARK_TIMEOUT_S), self.db.begin() as conn:
                for reason in set(pending.values()):
                    job_ids = [job_id for job_id, why in pending.items() if why == reason]
                    await store.fail_jobs(conn, job_ids=job_ids, error=reason)
        except Exception as error:  # the database is away too: retried
            self._log_failure(f"failing {len(pending)} jobs", error)
            return
        for job_id in pending:
            self._unmarked.pop(job_id, None)
        log.warning("withdrew %d jobs answered 503: %s", len(pending), sorted(pending))

    async def _abort(self) -> None:
        for request_id, reason in list(self._unaborted.items()):
            try:
                await self.transport.abort(request_id, reason)
            except Exception as error:  # Redis is still away: retried
                self._log_failure(f"aborting {len(self._unaborted)} requests", error)
                return
            self._unaborted.pop(request_id, None)  # a concurrent round may have sent it
        self._is_failing = False

    def _log_failure(self, what: str, error: Exception) -> None:
        if not self._is_failing:
            log.warning(
                "withdrawals: %s failed; retrying every %g s: %r", what, self.retry_s, error
            )
        self._is_failing = True
