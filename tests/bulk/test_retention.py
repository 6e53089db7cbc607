"""Retention (a beat task): finished jobs older than `retention_days` go, with their results;
open and recent ones stay; 0 days keeps everything."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta

from sqlalchemy import update
from sqlalchemy.ext.asyncio import AsyncEngine

from api.db import models as db
from api.db import store
from api.settings import Settings
from bulk.tasks import delete_expired


def new_job(job_id: str) -> store.NewJob:
    return store.NewJob(
        job_id=job_id, kind="job", route=None, priority=0, model="m", params={},
        items=[(f"{job_id}.0", [1, 2])],
    )  # fmt: skip


def test_old_finished_jobs_go_and_the_rest_stay(pg_engine: AsyncEngine, pg_url: str) -> None:
    now = datetime.now(UTC)

    async def setup() -> None:
        async with pg_engine.begin() as conn:
            await store.create_jobs(
                conn, jobs=[new_job("job_old"), new_job("job_recent"), new_job("job_open")]
            )
            for job_id, age_days in (("job_old", 40), ("job_recent", 5)):
                await store.cancel_job(conn, job_id=job_id)
                finished = now - timedelta(days=age_days)
                await conn.execute(
                    update(db.jobs).where(db.jobs.c.id == job_id).values(finished_at=finished)
                )

    async def remaining() -> list[str]:
        async with pg_engine.connect() as conn:
            return sorted(job.id for job in await store.list_jobs(conn, limit=10))

    asyncio.run(setup())
    keep_all = Settings.model_validate({"database_url": pg_url, "retention_days": 0})
    assert asyncio.run(delete_expired(keep_all, now=now)) == 0
    settings = Settings.model_validate({"database_url": pg_url, "retention_days": 30})
    assert asyncio.run(delete_expired(settings, now=now)) == 1
    assert asyncio.run(remaining()) == ["job_open", "job_recent"]
