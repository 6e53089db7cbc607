"""Creating jobs with their items (idempotent per key when the request has one) and moving
queued items, and their jobs, to `running`.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import func, insert, select, update
from sqlalchemy.ext.asyncio import AsyncConnection

from tgq.api.db import models as db
from tgq.api.db.store.records import JOB_COLUMNS, JobRecord, NewJob, storable, utc_now
from tgq.api.db.store.statements import at, insert_unless_taken, lock_jobs


async def create_job(
    conn: AsyncConnection,
    *,
    job_id: str,
    kind: str,
    route: str | None,
    priority: int,
    model: str | None,
    params: dict[str, Any],
    items: list[tuple[str, list[int]]],
    item_params: list[dict[str, Any]] | None = None,
    idempotency_key: str | None = None,
    idempotency_scope: str = "",
    fingerprint: str | None = None,
    api_key_id: int | None = None,
    deadline: datetime | None = None,
    metadata: dict[str, Any] | None = None,
) -> tuple[JobRecord, bool]:
    """Insert a job and its items: `(job, True)`. When the idempotency key is already taken in
    the scope nothing is inserted and it returns `(existing job, False)`; the caller compares
    `idempotency_fingerprint` with its own to tell a retry from a conflicting request."""
    job = NewJob(
        job_id=job_id,
        kind=kind,
        route=route,
        priority=priority,
        model=model,
        params=params,
        items=items,
        item_params=item_params,
        idempotency_key=idempotency_key,
        idempotency_scope=idempotency_scope,
        fingerprint=fingerprint,
        api_key_id=api_key_id,
        deadline=deadline,
        metadata=metadata,
    )
    now = utc_now()
    if job.idempotency_key is None:
        return (await create_jobs(conn, jobs=[job]))[0], True
    row = _job_row(job, now)
    statement = insert_unless_taken(
        conn.dialect.name, db.jobs, "idempotency_scope", "idempotency_key"
    )
    if (await conn.execute(statement, row)).first() is None:
        return await _job_by_idempotency_key(
            conn, job.idempotency_scope, job.idempotency_key
        ), False
    await conn.execute(insert(db.job_items), _item_rows(job, now))
    return JobRecord(**row), True


async def create_jobs(conn: AsyncConnection, *, jobs: Sequence[NewJob]) -> list[JobRecord]:
    """Insert many jobs without idempotency keys: one statement per table (group commits)."""
    if any(job.idempotency_key is not None for job in jobs):
        raise ValueError("create_jobs takes jobs without an idempotency key: use create_job")
    now = utc_now()
    rows = [_job_row(job, now) for job in jobs]
    if rows:
        await conn.execute(insert(db.jobs), rows)
    item_rows = [item for job in jobs for item in _item_rows(job, now)]
    if item_rows:
        await conn.execute(insert(db.job_items), item_rows)
    return [JobRecord(**row) for row in rows]


def _job_row(job: NewJob, now: datetime) -> dict[str, Any]:
    return {
        "id": job.job_id,
        "kind": job.kind,
        "route": job.route,
        "status": "queued",
        "priority": job.priority,
        "model": job.model,
        "params": storable(job.params),
        "num_items": len(job.items),
        "num_items_done": 0,
        "num_items_failed": 0,
        "prompt_tokens": 0,
        "completion_tokens": 0,
        "idempotency_scope": job.idempotency_scope,
        "idempotency_key": job.idempotency_key,
        "idempotency_fingerprint": job.fingerprint,
        "api_key_id": job.api_key_id,
        "deadline": job.deadline,
        "created_at": now,
        "started_at": None,
        "finished_at": None,
        "error": None,
        "metadata": storable(job.metadata),
    }


def _item_rows(job: NewJob, now: datetime) -> list[dict[str, Any]]:
    return item_rows(job.job_id, job.items, job.item_params, now=now)


def item_rows(
    job_id: str,
    items: Sequence[tuple[str, list[int]]],
    params: Sequence[dict[str, Any]] | None = None,
    *,
    now: datetime,
    first_index: int = 0,
) -> list[dict[str, Any]]:
    """Rows of `job_items` for the job's items numbered from `first_index`."""
    return [
        {
            "job_id": job_id,
            "item_index": first_index + offset,
            "request_id": request_id,
            "prompt_token_ids": prompt_token_ids,
            "status": "queued",
            "attempts": 0,
            "created_at": now,
            "finished_at": None,
            "params": None if params is None else storable(params[offset]),
        }
        for offset, (request_id, prompt_token_ids) in enumerate(items)
    ]


async def _job_by_idempotency_key(conn: AsyncConnection, scope: str, key: str) -> JobRecord:
    query = select(*JOB_COLUMNS).where(
        db.jobs.c.idempotency_scope == scope, db.jobs.c.idempotency_key == key
    )
    row = (await conn.execute(query)).first()
    if row is None:  # the conflicting job was deleted between the insert and this select
        raise LookupError(f"the job with idempotency key {key!r} no longer exists")
    return JobRecord(*row)


async def mark_running(conn: AsyncConnection, *, request_ids: Sequence[str]) -> int:
    """Move queued items to `running`, and their queued jobs too (with `started_at`); returns
    how many items moved."""
    if not request_ids:
        return 0
    of_requests = db.job_items.c.request_id.in_(request_ids)
    await lock_jobs(conn, db.jobs.c.id.in_(select(db.job_items.c.job_id).where(of_requests)))
    moved = await conn.execute(
        update(db.job_items)
        .where(of_requests, db.job_items.c.status == "queued")
        .values(status="running")
        .returning(db.job_items.c.job_id)
    )
    job_ids = list(moved.scalars())
    if job_ids:
        await conn.execute(
            update(db.jobs)
            .where(db.jobs.c.id.in_(set(job_ids)), db.jobs.c.status == "queued")
            .values(status="running", started_at=func.coalesce(db.jobs.c.started_at, at(utc_now())))
        )
    return len(job_ids)
