"""Reads of jobs, items and results (one job, its items and results, lists and counts)."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import Select, and_, func, or_, select
from sqlalchemy.ext.asyncio import AsyncConnection

from tgq.api.db import models as db
from tgq.api.db.store.records import (
    ITEM_COLUMNS,
    JOB_COLUMNS,
    OPEN_STATUSES,
    RESULT_COLUMNS,
    ItemRecord,
    JobRecord,
    ResultRecord,
    as_records,
)


async def get_job(
    conn: AsyncConnection, *, job_id: str, api_key_id: int | None = None
) -> JobRecord | None:
    """The job, or None; with `api_key_id`, only a job created with that key."""
    query = select(*JOB_COLUMNS).where(db.jobs.c.id == job_id)
    if api_key_id is not None:
        query = query.where(db.jobs.c.api_key_id == api_key_id)
    row = (await conn.execute(query)).first()
    return None if row is None else JobRecord(*row)


async def get_items(
    conn: AsyncConnection, *, job_id: str, item_indexes: Sequence[int] | None = None
) -> list[ItemRecord]:
    """The job's items in order; with `item_indexes`, only those."""
    items = db.job_items.c
    query = select(*ITEM_COLUMNS).where(items.job_id == job_id)
    if item_indexes is not None:
        query = query.where(items.item_index.in_(item_indexes))
    return as_records(ItemRecord, await conn.execute(query.order_by(items.item_index)))


async def get_results(
    conn: AsyncConnection, *, job_id: str, item_indexes: Sequence[int] | None = None
) -> list[ResultRecord]:
    """The job's results in item order; with `item_indexes`, only those items'."""
    results = db.results.c
    query = select(*RESULT_COLUMNS).where(results.job_id == job_id)
    if item_indexes is not None:
        query = query.where(results.item_index.in_(item_indexes))
    return as_records(ResultRecord, await conn.execute(query.order_by(results.item_index)))


async def get_result(conn: AsyncConnection, *, job_id: str, item_index: int) -> ResultRecord | None:
    results = db.results.c
    query = select(*RESULT_COLUMNS).where(
        results.job_id == job_id, results.item_index == item_index
    )
    row = (await conn.execute(query)).first()
    return None if row is None else ResultRecord(*row)


async def get_item_status(conn: AsyncConnection, *, job_id: str, item_index: int) -> str | None:
    items = db.job_items.c
    query = select(items.status).where(items.job_id == job_id, items.item_index == item_index)
    status: str | None = (await conn.execute(query)).scalar()
    return status


async def get_job_for_request(conn: AsyncConnection, *, request_id: str) -> tuple[str, int] | None:
    """`(job_id, item_index)` of the item with this request id, or None."""
    items = db.job_items.c
    query = select(items.job_id, items.item_index).where(items.request_id == request_id)
    row = (await conn.execute(query)).first()
    return None if row is None else (row.job_id, row.item_index)


async def list_jobs(
    conn: AsyncConnection,
    *,
    limit: int,
    status: str | None = None,
    after: str | None = None,
    api_key_id: int | None = None,
) -> list[JobRecord]:
    """Newest first (`created_at`, then id, descending). `after` is the last job id of the
    previous page; an unknown cursor gives an empty page."""
    job = db.jobs.c
    query: Select[Any] = select(*JOB_COLUMNS)
    if status is not None:
        query = query.where(job.status == status)
    if api_key_id is not None:
        query = query.where(job.api_key_id == api_key_id)
    if after is not None:
        cursor = select(job.created_at).where(job.id == after).scalar_subquery()
        query = query.where(
            or_(job.created_at < cursor, and_(job.created_at == cursor, job.id < after))
        )
    query = query.order_by(job.created_at.desc(), job.id.desc()).limit(limit)
    return as_records(JobRecord, await conn.execute(query))


async def unfinished_items(
    conn: AsyncConnection, *, created_before: datetime, limit: int
) -> list[ItemRecord]:
    """Queued or running items created before the given time, oldest first (the reconciler
    re-enqueues those that the transport lost)."""
    items = db.job_items.c
    query = (
        select(*ITEM_COLUMNS)
        .where(items.status.in_(OPEN_STATUSES), items.created_at < created_before)
        .order_by(items.created_at, items.job_id, items.item_index)
        .limit(limit)
    )
    return as_records(ItemRecord, await conn.execute(query))


async def count_jobs_by_status(conn: AsyncConnection) -> dict[str, int]:
    """How many jobs are in each status (for the metrics); statuses without jobs are absent."""
    job = db.jobs.c
    rows = await conn.execute(select(job.status, func.count()).group_by(job.status))
    return {status: count for status, count in rows.tuples()}
