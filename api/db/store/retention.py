"""Retention: deleting jobs that finished long enough ago, with their items, results and usage
(the tables cascade from `jobs`)."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import and_, delete
from sqlalchemy.ext.asyncio import AsyncConnection

from tgq.api.db import models as db
from tgq.api.db.store.records import TERMINAL_STATUSES
from tgq.api.db.store.statements import lock_jobs


async def delete_finished_before(conn: AsyncConnection, *, before: datetime) -> int:
    """Delete jobs that finished before `before`, with their items, results and usage; returns
    how many jobs."""
    job = db.jobs.c
    finished = and_(job.status.in_(TERMINAL_STATUSES), job.finished_at < before)
    job_ids = await lock_jobs(conn, finished)
    if not job_ids:
        return 0
    await conn.execute(delete(db.jobs).where(job.id.in_(job_ids)))
    return len(job_ids)
