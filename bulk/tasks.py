"""Celery tasks: thin wrappers that open what they need from the settings and call tested
functions (`api.reconciler.reconcile_once`, `api.db.store.delete_finished_before`)."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta

from sqlalchemy.pool import NullPool

from api.app import model_dir_of
from api.db import create_engine, store
from api.reconciler import reconcile_once
from api.settings import Settings
from batcher.transport.aio import AsyncRedisApiTransport
from bulk.celery_app import DEFAULT_BROKER, app
from gpu_worker.config import model_eos_token_ids  # torch-free: it reads config.json


@app.task(name="tgq.reconcile")  # type: ignore[untyped-decorator]  # celery has no types
def reconcile() -> int:
    """Re-enqueues the accepted items Redis lost; returns how many."""
    return asyncio.run(_reconcile(Settings()))


async def _reconcile(settings: Settings) -> int:
    engine = create_engine(settings.database_url, poolclass=NullPool)
    redis_url = settings.redis_url or DEFAULT_BROKER
    transport = AsyncRedisApiTransport.from_url(redis_url, settings.redis_prefix)
    try:
        return await reconcile_once(
            engine=engine,
            transport=transport,
            settings=settings,
            eos_token_ids=model_eos_token_ids(model_dir_of(settings)),
            older_than_s=settings.reconcile_grace_s,
        )
    finally:
        await transport.close()
        await engine.dispose()


@app.task(name="tgq.retention")  # type: ignore[untyped-decorator]  # celery has no types
def retention() -> int:
    """Deletes what finished more than `retention_days` ago; returns how many jobs."""
    return asyncio.run(delete_expired(Settings()))


async def delete_expired(settings: Settings, *, now: datetime | None = None) -> int:
    if settings.retention_days <= 0:
        return 0
    before = (now or datetime.now(UTC)) - timedelta(days=settings.retention_days)
    engine = create_engine(settings.database_url, poolclass=NullPool)
    try:
        async with engine.begin() as conn:
            return await store.delete_finished_before(conn, before=before)
    finally:
        await engine.dispose()
