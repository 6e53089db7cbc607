"""Celery tasks: thin wrappers that open what they need from the settings and call tested
functions (`bulk.batches.driver.run_batch`, `api.reconciler.reconcile_once`, ...)."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta

from sqlalchemy.pool import NullPool

from tgq.api.app import model_dir_of
from tgq.api.db import create_engine, store
from tgq.api.db import files as db_files
from tgq.api.files.storage import LocalFileStorage
from tgq.api.reconciler import reconcile_once, resume_batches
from tgq.api.settings import Settings
from tgq.api.tokenizer import ModelTokenizer
from tgq.batcher.transport.aio import AsyncRedisApiTransport
from tgq.bulk.batches.context import BatchContext
from tgq.bulk.batches.driver import run_batch
from tgq.bulk.celery_app import DEFAULT_BROKER, app, send_run_batch
from tgq.gpu_worker.config import model_eos_token_ids  # torch-free: it reads config.json


@app.task(name="tgq.run_batch")  # type: ignore[untyped-decorator]  # celery has no types
def run_batch_task(batch_id: str) -> str:
    """Drives the batch to its end (or leaves it to the runner that holds it); its status."""
    return asyncio.run(_run_batch(Settings(), batch_id))


async def _run_batch(settings: Settings, batch_id: str) -> str:
    db = create_engine(settings.database_url)
    transport = AsyncRedisApiTransport.from_url(
        settings.redis_url or DEFAULT_BROKER,
        settings.redis_prefix,
        cache_routing=settings.cache_routing,
    )
    tokenizer = ModelTokenizer.from_model_dir(
        model_dir_of(settings), max_workers=settings.validation_workers
    )
    context = BatchContext(
        db, transport, LocalFileStorage(settings.file_storage_dir), tokenizer, settings,
        window=settings.batch_window, lease_s=settings.batch_lease_s,
    )  # fmt: skip
    try:
        return await run_batch(context, batch_id)
    finally:
        tokenizer.close()
        await transport.close()
        await db.dispose()


@app.task(name="tgq.reconcile")  # type: ignore[untyped-decorator]  # celery has no types
def reconcile() -> int:
    """Re-enqueues the accepted items Redis lost, and starts runners for the batches nobody
    drives; returns how many items."""
    return asyncio.run(_reconcile(Settings()))


async def _reconcile(settings: Settings) -> int:
    db = create_engine(settings.database_url, poolclass=NullPool)
    redis_url = settings.redis_url or DEFAULT_BROKER
    transport = AsyncRedisApiTransport.from_url(
        redis_url, settings.redis_prefix, cache_routing=settings.cache_routing
    )

    async def start(batch_id: str) -> None:
        await asyncio.to_thread(send_run_batch, settings, batch_id)

    try:
        count = await reconcile_once(
            db=db,
            transport=transport,
            settings=settings,
            eos_token_ids=model_eos_token_ids(model_dir_of(settings)),
            older_than_s=settings.reconcile_grace_s,
        )
        if settings.batches_on_celery:
            await resume_batches(db, start, grace_s=2 * settings.batch_lease_s)
        return count
    finally:
        await transport.close()
        await db.dispose()


@app.task(name="tgq.retention")  # type: ignore[untyped-decorator]  # celery has no types
def retention() -> dict[str, int]:
    """Deletes finished jobs and old files past their retention; how many of each."""
    return asyncio.run(delete_expired(Settings()))


async def delete_expired(settings: Settings, *, now: datetime | None = None) -> dict[str, int]:
    """Jobs finished more than `retention_days` ago (with their items, results and usage), and
    files created more than `file_retention_days` ago that no unfinished batch reads: each
    file's record goes first, then its bytes (a crash in between leaves bytes nobody sees, never
    a record without them)."""
    now = now or datetime.now(UTC)
    db = create_engine(settings.database_url, poolclass=NullPool)
    storage = LocalFileStorage(settings.file_storage_dir)
    deleted = {"jobs": 0, "files": 0}
    try:
        if settings.retention_days > 0:
            before = now - timedelta(days=settings.retention_days)
            async with db.begin() as conn:
                deleted["jobs"] = await store.delete_finished_before(conn, before=before)
        if settings.file_retention_days > 0:
            before = now - timedelta(days=settings.file_retention_days)
            async with db.connect() as conn:
                expired = await db_files.expired_files(conn, created_before=before)
            for record in expired:
                async with db.begin() as conn:
                    await db_files.purge_file(conn, file_id=record.id)
                await storage.delete(record.storage_key)
            deleted["files"] = len(expired)
    finally:
        await db.dispose()
    return deleted
