"""The reconciler: accepted work the transport lost is enqueued again from the database.

Postgres is the record; Redis only carries work. An item that is still open (queued or running)
some time after it was committed, and that the transport has no trace of (`missing`: Redis was
flushed or restarted without persistence, or the enqueue after the commit failed), is rebuilt
from its row (prompt token ids) and its job's recorded parameters (`api.submit.rebuild_request`),
and submitted again with the next attempt number. A duplicate run is harmless: the first final
result wins, in Redis and in the results table.

Interactive items are the exception: the reconciler never runs one again. Its client waits on
one api replica, and only that replica enqueues it again when the transport loses it
(`Generation.resubmit_unfinished`, on a new epoch); a client answered 503 retries, and running
its request too would do the work twice. A lost interactive item is one whose client is gone
(its replica died) or was answered 503 and the withdrawal could not be written: the reconciler
fails it, once the transport's epoch is `EPOCH_SETTLE_S` old, so that live replicas have
enqueued theirs again first.

A new epoch (Redis restarted empty or flushed; `EpochWatch`) is seen by the api's monitor within
a quarter of a second; the replica that started the new epoch reconciles at once, whatever the
grace, instead of within `reconcile_interval_s` + `reconcile_grace_s`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta

from sqlalchemy.ext.asyncio import AsyncEngine

from tgq.api.db import batches as db_batches
from tgq.api.db import store
from tgq.api.settings import Settings
from tgq.api.submit import rebuild_request
from tgq.batcher.transport.aio import AsyncApiTransport, Epoch

log = logging.getLogger(__name__)

EPOCH_SETTLE_S = 5.0  # every live replica has enqueued its clients' lost requests again by then
LOST_INTERACTIVE = "unavailable: the queue lost it and no client waits for it"


async def reconcile_once(
    *,
    db: AsyncEngine,
    transport: AsyncApiTransport,
    settings: Settings,
    eos_token_ids: frozenset[int],
    older_than_s: float,
    limit: int = 1000,
) -> int:
    """Re-enqueues the lost items among the `limit` oldest open ones; returns how many.
    Lost interactive items are failed instead, once the epoch has settled."""
    before = datetime.now(UTC) - timedelta(seconds=older_than_s)
    async with db.connect() as conn:
        items = await store.unfinished_items(conn, created_before=before, limit=limit)
        if not items:
            return 0
        missing = set(await transport.missing([item.request_id for item in items]))
        lost = [item for item in items if item.request_id in missing]
        jobs = {}
        for job_id in sorted({item.job_id for item in lost}):
            job = await store.get_job(conn, job_id=job_id)
            # A batch's lines have parameters of their own: its runner refills them.
            if job is not None and not job.is_finished and job.kind != "batch":
                jobs[job_id] = job
    orphans = sorted(job_id for job_id, job in jobs.items() if job.kind == "interactive")
    if orphans:
        await _fail_orphans(db, transport, orphans)
    requests = [
        rebuild_request(item, jobs[item.job_id], settings, eos_token_ids)
        for item in lost
        if item.job_id in jobs and jobs[item.job_id].kind != "interactive"
    ]
    if requests:
        await transport.submit(requests)
        log.warning("reconciler: re-enqueued %d requests the transport had lost", len(requests))
    return len(requests)


async def _fail_orphans(db: AsyncEngine, transport: AsyncApiTransport, job_ids: list[str]) -> None:
    """Fails lost interactive jobs, unless the epoch is too young for every replica to have
    enqueued its own again (they are looked at again in the next round)."""
    epoch = await transport.epoch()
    if time.time() - epoch.started_at < EPOCH_SETTLE_S:
        return
    async with db.begin() as conn:
        failed = await store.fail_jobs(conn, job_ids=job_ids, error=LOST_INTERACTIVE)
    log.warning("reconciler: failed %d lost interactive items nobody waits for", len(failed))


async def resume_batches(
    db: AsyncEngine, start: Callable[[str], Awaitable[None]], *, grace_s: float
) -> list[str]:
    """Starts a runner for every unfinished batch that nobody drives (its runner died, or the
    task meant to start one was lost); returns their ids. Each is leased for `grace_s` to the
    runner being started, so that other reconcilers leave it alone meanwhile."""
    async with db.begin() as conn:
        lapsed = await db_batches.lapsed_batches(conn, grace_s=grace_s)
    for batch_id in lapsed:
        log.warning("reconciler: batch %s has no live runner: starting one", batch_id)
        await start(batch_id)
    return lapsed


class EpochWatch:
    """One replica's view of the transport's epoch, checked on every monitor tick."""

    def __init__(self) -> None:
        self.token: str | None = None

    async def check(self, transport: AsyncApiTransport) -> Epoch | None:
        """The epoch, when it is not the one the previous check saw (the transport lost its
        data in between, or this is the first check); else None."""
        epoch = await transport.epoch()
        if epoch.token == self.token:
            return None
        self.token = epoch.token
        return epoch
