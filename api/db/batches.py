"""Queries of batches and their lines (the Batches API). A batch's valid lines are the items of
one job of kind `batch`, so their results, the persister and the reconciler are the jobs' own."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import and_, func, insert, or_, select, update
from sqlalchemy.ext.asyncio import AsyncConnection

from tgq.api.db import models as db
from tgq.api.db.store import ItemRecord, as_records, item_rows, record_columns, utc_now

TERMINAL = ("completed", "failed", "expired", "cancelled")
# The timestamp column each status sets when a batch enters it.
_ENTERED_AT = {
    "in_progress": "in_progress_at",
    "finalizing": "finalizing_at",
    "completed": "completed_at",
    "failed": "failed_at",
    "expired": "expired_at",
    "cancelling": "cancelling_at",
    "cancelled": "cancelled_at",
}


@dataclass(frozen=True, slots=True)
class BatchRecord:
    id: str
    status: str
    endpoint: str
    input_file_id: str
    completion_window: str
    job_id: str | None
    output_file_id: str | None
    error_file_id: str | None
    num_total: int
    num_completed: int
    num_failed: int
    metadata: dict[str, Any] | None
    error: str | None
    api_key_id: int | None
    created_at: datetime
    expires_at: datetime
    in_progress_at: datetime | None
    finalizing_at: datetime | None
    completed_at: datetime | None
    failed_at: datetime | None
    expired_at: datetime | None
    cancelling_at: datetime | None
    cancelled_at: datetime | None
    runner_id: str | None
    lease_until: datetime | None
    finalizing_to: str | None

    @property
    def is_finished(self) -> bool:
        return self.status in TERMINAL


@dataclass(frozen=True, slots=True)
class LineRecord:
    batch_id: str
    line_index: int
    custom_id: str
    item_index: int | None
    error: str | None


_BATCH = record_columns(db.batches, BatchRecord)
_LINE = record_columns(db.batch_lines, LineRecord)


async def create_batch(
    conn: AsyncConnection,
    *,
    batch_id: str,
    endpoint: str,
    input_file_id: str,
    completion_window: str,
    expires_at: datetime,
    metadata: dict[str, Any] | None = None,
    api_key_id: int | None = None,
    dispatch_grace_s: float = 60.0,
) -> BatchRecord:
    """A new batch, `validating`, leased for `dispatch_grace_s` to the runner about to be
    started for it (the reconciler resumes it if none has claimed it by then)."""
    now = utc_now()
    created = await conn.execute(
        insert(db.batches)
        .values(
            id=batch_id,
            status="validating",
            endpoint=endpoint,
            input_file_id=input_file_id,
            completion_window=completion_window,
            metadata=metadata,
            api_key_id=api_key_id,
            created_at=now,
            expires_at=expires_at,
            lease_until=now + timedelta(seconds=dispatch_grace_s),
        )
        .returning(*_BATCH)
    )
    return BatchRecord(*created.one())


async def get_batch(
    conn: AsyncConnection, *, batch_id: str, api_key_id: int | None = None
) -> BatchRecord | None:
    query = select(*_BATCH).where(db.batches.c.id == batch_id)
    if api_key_id is not None:
        query = query.where(db.batches.c.api_key_id == api_key_id)
    row = (await conn.execute(query)).first()
    return None if row is None else BatchRecord(*row)


async def list_batches(
    conn: AsyncConnection, *, limit: int, after: str | None = None, api_key_id: int | None = None
) -> list[BatchRecord]:
    """Newest first; `after` is the last id of the previous page."""
    batch = db.batches.c
    query = select(*_BATCH)
    if api_key_id is not None:
        query = query.where(batch.api_key_id == api_key_id)
    if after is not None:
        cursor = select(batch.created_at).where(batch.id == after).scalar_subquery()
        query = query.where(
            or_(batch.created_at < cursor, and_(batch.created_at == cursor, batch.id < after))
        )
    query = query.order_by(batch.created_at.desc(), batch.id.desc()).limit(limit)
    return as_records(BatchRecord, await conn.execute(query))


async def claim(conn: AsyncConnection, *, batch_id: str, runner_id: str, lease_s: float) -> bool:
    """Take (or renew) the batch's lease for `runner_id`: it succeeds when the batch is
    unfinished and its lease is this runner's, nobody's, or has run out."""
    batch = db.batches.c
    now = utc_now()
    claimed = await conn.execute(
        update(db.batches)
        .where(
            batch.id == batch_id,
            batch.status.not_in(TERMINAL),
            or_(
                batch.runner_id.is_(None),
                batch.runner_id == runner_id,
                batch.lease_until.is_(None),
                batch.lease_until < now,
            ),
        )
        .values(runner_id=runner_id, lease_until=now + timedelta(seconds=lease_s))
        .returning(batch.id)
    )
    return claimed.first() is not None


async def release(conn: AsyncConnection, *, batch_id: str, runner_id: str) -> None:
    """Give the lease up now (a runner stopping early), so another can take over at once."""
    batch = db.batches.c
    await conn.execute(
        update(db.batches)
        .where(batch.id == batch_id, batch.runner_id == runner_id)
        .values(runner_id=None, lease_until=utc_now())
    )


async def lapsed_batches(conn: AsyncConnection, *, grace_s: float) -> list[str]:
    """Unfinished batches nobody drives: their lease ran out (their runner died, or the task
    that was to start one was lost). Each is leased for `grace_s` to the runner the caller
    starts, so that other replicas of the caller leave it alone meanwhile."""
    batch = db.batches.c
    now = utc_now()
    lapsed = await conn.execute(
        update(db.batches)
        .where(
            batch.status.not_in(TERMINAL),
            or_(batch.lease_until.is_(None), batch.lease_until < now),
        )
        .values(runner_id=None, lease_until=now + timedelta(seconds=grace_s))
        .returning(batch.id, batch.created_at)
    )
    return [batch_id for batch_id, _ in sorted(lapsed.all(), key=lambda row: row[1])]


async def set_status(
    conn: AsyncConnection, *, batch_id: str, status: str, only_from: tuple[str, ...], **values: Any
) -> bool:
    """Move the batch to `status` (stamping its time) if it is in one of `only_from`; a
    terminal status releases the lease."""
    batch = db.batches.c
    stamp: dict[str, Any] = {_ENTERED_AT[status]: utc_now()} if status in _ENTERED_AT else {}
    if status in TERMINAL:
        stamp |= {"runner_id": None, "lease_until": None}
    moved = await conn.execute(
        update(db.batches)
        .where(batch.id == batch_id, batch.status.in_(only_from))
        .values(status=status, **stamp, **values)
        .returning(batch.id)
    )
    return moved.first() is not None


async def lock_status(conn: AsyncConnection, *, batch_id: str) -> str | None:
    """The batch's status, its row locked until the transaction ends (a cancel waits)."""
    query = select(db.batches.c.status).where(db.batches.c.id == batch_id).with_for_update()
    status: str | None = (await conn.execute(query)).scalar()
    return status


async def set_job(conn: AsyncConnection, *, batch_id: str, job_id: str) -> None:
    await conn.execute(update(db.batches).where(db.batches.c.id == batch_id).values(job_id=job_id))


async def set_counts(conn: AsyncConnection, *, batch_id: str, completed: int, failed: int) -> None:
    await conn.execute(
        update(db.batches)
        .where(db.batches.c.id == batch_id)
        .values(num_completed=completed, num_failed=failed)
    )


async def add_lines(conn: AsyncConnection, *, lines: list[LineRecord]) -> None:
    if lines:
        rows = [
            {
                "batch_id": line.batch_id,
                "line_index": line.line_index,
                "custom_id": line.custom_id,
                "item_index": line.item_index,
                "error": line.error,
            }
            for line in lines
        ]
        await conn.execute(insert(db.batch_lines), rows)


async def get_lines(
    conn: AsyncConnection, *, batch_id: str, first: int = 0, limit: int | None = None
) -> list[LineRecord]:
    """The batch's lines from line index `first`, in order, at most `limit` of them."""
    lines = db.batch_lines.c
    query = select(*_LINE).where(lines.batch_id == batch_id, lines.line_index >= first)
    query = query.order_by(lines.line_index).limit(limit)
    return as_records(LineRecord, await conn.execute(query))


async def count_lines(conn: AsyncConnection, *, batch_id: str) -> tuple[int, int]:
    """How many lines the batch has recorded, and how many of them are job items."""
    lines = db.batch_lines.c
    query = select(func.count(), func.count(lines.item_index)).where(lines.batch_id == batch_id)
    num_lines, num_items = (await conn.execute(query)).one()
    return int(num_lines), int(num_items)


async def add_items(
    conn: AsyncConnection,
    *,
    job_id: str,
    first_index: int,
    items: list[tuple[str, list[int]]],
    params: list[dict[str, Any]],
) -> None:
    """Append items (each with its own parameters) to the batch's job."""
    if items:
        rows = item_rows(job_id, items, params, now=utc_now(), first_index=first_index)
        await conn.execute(insert(db.job_items), rows)


async def set_num_items(conn: AsyncConnection, *, job_id: str, num_items: int) -> None:
    await conn.execute(update(db.jobs).where(db.jobs.c.id == job_id).values(num_items=num_items))


async def open_items(conn: AsyncConnection, *, job_id: str, limit: int) -> list[ItemRecord]:
    """The job's first `limit` unfinished items, in item order (the window)."""
    items = db.job_items.c
    query = (
        select(*record_columns(db.job_items, ItemRecord))
        .where(items.job_id == job_id, items.status.in_(("queued", "running")))
        .order_by(items.item_index)
        .limit(limit)
    )
    return as_records(ItemRecord, await conn.execute(query))


async def request_counts_in_progress(conn: AsyncConnection) -> dict[str, int]:
    """Requests of the batches not yet finished, summed (the metrics' batch progress)."""
    batch = db.batches.c
    query = select(
        func.coalesce(func.sum(batch.num_total), 0),
        func.coalesce(func.sum(batch.num_completed), 0),
        func.coalesce(func.sum(batch.num_failed), 0),
    ).where(batch.status.not_in(TERMINAL))
    total, completed, failed = (await conn.execute(query)).one()
    return {"total": int(total), "completed": int(completed), "failed": int(failed)}
