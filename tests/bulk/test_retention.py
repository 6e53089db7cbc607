"""Retention (a beat task): finished jobs older than `retention_days` go, with their results;
open and recent ones stay; 0 days keeps everything. Files older than `file_retention_days` go,
record and bytes, unless an unfinished batch reads them."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

from sqlalchemy import update
from sqlalchemy.ext.asyncio import AsyncEngine

from tgq.api.db import batches as db_batches
from tgq.api.db import files as db_files
from tgq.api.db import models as db
from tgq.api.db import store
from tgq.api.files.storage import LocalFileStorage
from tgq.api.settings import Settings
from tgq.bulk.tasks import delete_expired


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
    keep_all = Settings.model_validate(
        {"database_url": pg_url, "retention_days": 0, "file_retention_days": 0}
    )
    assert asyncio.run(delete_expired(keep_all, now=now)) == {"jobs": 0, "files": 0}
    settings = Settings.model_validate({"database_url": pg_url, "retention_days": 30})
    assert asyncio.run(delete_expired(settings, now=now)) == {"jobs": 1, "files": 0}
    assert asyncio.run(remaining()) == ["job_open", "job_recent"]


def test_old_files_go_unless_an_unfinished_batch_reads_them(
    pg_engine: AsyncEngine, pg_url: str, tmp_path: Path
) -> None:
    now = datetime.now(UTC)
    storage = LocalFileStorage(tmp_path)

    async def setup() -> None:
        for file_id, age_days in (("file-old", 40), ("file-read", 40), ("file-new", 1)):
            await storage.write(file_id, _chunks(b"{}\n"))
            async with pg_engine.begin() as conn:
                await db_files.create_file(
                    conn, file_id=file_id, purpose="batch", filename="x.jsonl", num_bytes=3,
                    num_lines=1, storage_key=file_id,
                )  # fmt: skip
                created = now - timedelta(days=age_days)
                await conn.execute(
                    update(db.files).where(db.files.c.id == file_id).values(created_at=created)
                )
        async with pg_engine.begin() as conn:  # a running batch reads file-read
            await db_batches.create_batch(
                conn, batch_id="batch_running", endpoint="/v1/completions",
                input_file_id="file-read", completion_window="24h",
                expires_at=now + timedelta(days=1),
            )  # fmt: skip

    async def remaining() -> list[str]:
        async with pg_engine.connect() as conn:
            return sorted(f.id for f in await db_files.list_files(conn, limit=10))

    asyncio.run(setup())
    settings = Settings.model_validate(
        {"database_url": pg_url, "file_retention_days": 30, "file_storage_dir": str(tmp_path)}
    )
    assert asyncio.run(delete_expired(settings, now=now)) == {"jobs": 0, "files": 1}
    assert asyncio.run(remaining()) == ["file-new", "file-read"]
    assert sorted(path.name for path in tmp_path.iterdir()) == ["file-new", "file-read"]


async def _chunks(content: bytes) -> AsyncIterator[bytes]:
    yield content
