"""Recording results: the first delivery per item counts, moves the item to its terminal status
and adds to the job's counters (atomic `SET n = n + 1`); later ones are ignored.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict
from datetime import datetime
from typing import Any

from sqlalchemy import and_, case, func, insert, select, update
from sqlalchemy.ext.asyncio import AsyncConnection

from tgq.api.db import models as db
from tgq.api.db.store.records import OPEN_STATUSES, NewResult, item_status, storable, utc_now
from tgq.api.db.store.statements import at, insert_unless_taken, lock_jobs


async def record_results(conn: AsyncConnection, *, results: Sequence[NewResult]) -> list[bool]:
    """Persist final results; per result, True if it was written, False if it was a repeat
    delivery, for an unknown item, or a non-`abort` result for a cancelled item."""
    if not results:
        return []
    await lock_jobs(conn, db.jobs.c.id.in_(sorted({result.job_id for result in results})))
    now = utc_now()
    return [await _record_result(conn, result, now) for result in results]


async def _record_result(conn: AsyncConnection, result: NewResult, now: datetime) -> bool:
    status = item_status(result.finish_reason)
    finished = await _finish_item(conn, result, status, now)
    if finished is None:
        return False
    written = await conn.execute(
        insert_unless_taken(conn.dialect.name, db.results, "job_id", "item_index"),
        {
            **asdict(result),
            "text": storable(result.text),
            "finish_detail": storable(result.finish_detail),
            "created_at": now,
        },
    )
    if written.first() is None:
        return False
    api_key_id, model = await _count_result(conn, result, is_failed=status == "failed", now=now)
    model = (finished or {}).get("adapter") or model  # a batch line's own LoRA adapter
    await conn.execute(
        insert(db.usage).values(
            job_id=result.job_id,
            item_index=result.item_index,
            api_key_id=api_key_id,
            model=model,
            prompt_tokens=result.num_prompt_tokens,
            completion_tokens=result.num_output_tokens,
            cached_tokens=result.num_cached_tokens,
            created_at=now,
        )
    )
    return True


async def _finish_item(
    conn: AsyncConnection, result: NewResult, status: str, now: datetime
) -> dict[str, Any] | None:
    """Move the item to its terminal status; its own parameters (`{}` when it has none), or
    None when it is not open. The cancel rule lives here: once an item is cancelled only an
    `abort` result (which keeps it cancelled) gets past this point."""
    allowed = (*OPEN_STATUSES, "cancelled") if status == "cancelled" else OPEN_STATUSES
    items = db.job_items.c
    moved = await conn.execute(
        update(db.job_items)
        .where(
            items.job_id == result.job_id,
            items.item_index == result.item_index,
            items.status.in_(allowed),
        )
        .values(
            status=status,
            finished_at=func.coalesce(items.finished_at, at(now)),
            attempts=result.attempt,  # the attempt that finished it (reruns after a crash: > 1)
        )
        .returning(items.item_index, items.params)
    )
    row = moved.first()
    return None if row is None else (row.params or {})


async def _count_result(
    conn: AsyncConnection, result: NewResult, *, is_failed: bool, now: datetime
) -> tuple[int | None, str | None]:
    """Add one result to the job's counters; the result that completes an open job makes it
    terminal: `succeeded` when any item succeeded, else `failed` when any failed, else
    `cancelled`. Returns the job's api key id and model."""
    job, items = db.jobs.c, db.job_items.c
    num_done = job.num_items_done + 1
    num_failed = job.num_items_failed + int(is_failed)
    num_cancelled = (
        select(func.count())
        .where(items.job_id == job.id, items.status == "cancelled")
        .scalar_subquery()
    )  # this item's own status is already final
    is_open = job.status.in_(OPEN_STATUSES)
    completes = and_(is_open, num_done >= job.num_items)
    outcome = case(
        (num_done - num_failed - num_cancelled > 0, "succeeded"),
        (num_failed > 0, "failed"),
        else_="cancelled",  # every item was aborted (e.g. its client went away)
    )
    status = case((completes, outcome), (is_open, "running"), else_=job.status)
    counted = await conn.execute(
        update(db.jobs)
        .where(job.id == result.job_id)
        .values(
            num_items_done=num_done,
            num_items_failed=num_failed,
            prompt_tokens=job.prompt_tokens + result.num_prompt_tokens,
            completion_tokens=job.completion_tokens + result.num_output_tokens,
            status=status,
            started_at=func.coalesce(job.started_at, at(now)),
            finished_at=case((completes, at(now)), else_=job.finished_at),
        )
        .returning(job.api_key_id, job.model)
    )
    api_key_id, model = counted.one()
    return api_key_id, model
