"""Ending open jobs without results: cancelling one (its client asked) or failing some (nothing
ran, or what runs is withdrawn). Their open items end with them.
"""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import and_, select, update
from sqlalchemy.ext.asyncio import AsyncConnection

from tgq.api.db import models as db
from tgq.api.db.store.records import OPEN_STATUSES, TERMINAL_STATUSES, storable, utc_now
from tgq.api.db.store.statements import lock_jobs


async def cancel_job(conn: AsyncConnection, *, job_id: str) -> list[str] | None:
    """Cancel a job and its unfinished items; returns those items' request ids (to abort in the
    transport), [] when the job had already finished (nothing changes), None when there is no
    such job."""
    job = db.jobs.c
    row = (await conn.execute(select(job.status).where(job.id == job_id).with_for_update())).first()
    if row is None:
        return None
    if row.status in TERMINAL_STATUSES:
        return []
    now = utc_now()
    await conn.execute(
        update(db.jobs).where(job.id == job_id).values(status="cancelled", finished_at=now)
    )
    items = db.job_items.c
    cancelled = await conn.execute(
        update(db.job_items)
        .where(items.job_id == job_id, items.status.in_(OPEN_STATUSES))
        .values(status="cancelled", finished_at=now)
        .returning(items.item_index, items.request_id)
    )
    return [request_id for _, request_id in sorted(cancelled.all())]


async def fail_jobs(conn: AsyncConnection, *, job_ids: Sequence[str], error: str) -> list[str]:
    """Fail the open ones of these jobs with their open items, without result rows (nothing
    ran, or what runs is withdrawn: a later result for them is not written); returns the
    request ids of the items failed. For interactive requests answered 503 after their rows
    were committed, and for interactive items the transport lost."""
    job, items = db.jobs.c, db.job_items.c
    locked = await lock_jobs(
        conn, and_(job.id.in_(sorted(set(job_ids))), job.status.in_(OPEN_STATUSES))
    )
    if not locked:
        return []
    now = utc_now()
    await conn.execute(
        update(db.jobs)
        .where(job.id.in_(locked))
        .values(status="failed", finished_at=now, error=storable(error))
    )
    failed = await conn.execute(
        update(db.job_items)
        .where(items.job_id.in_(locked), items.status.in_(OPEN_STATUSES))
        .values(status="failed", finished_at=now)
        .returning(items.request_id)
    )
    return sorted(failed.scalars())
