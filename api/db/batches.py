"""Queries of batches and their lines (the Batches API). A batch's valid lines are the items of
one job of kind `batch`, so their results, the persister and the reconciler are the jobs' own."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import and_, insert, or_, select, update
from sqlalchemy.ext.asyncio import AsyncConnection

from api.db import models as db
from api.db.store import as_records, record_columns, utc_now

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
) -> BatchRecord:
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
            created_at=utc_now(),
            expires_at=expires_at,
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


async def unfinished_batches(conn: AsyncConnection) -> list[BatchRecord]:
    query = select(*_BATCH).where(db.batches.c.status.not_in(TERMINAL))
    return as_records(BatchRecord, await conn.execute(query.order_by(db.batches.c.created_at)))


async def set_status(
    conn: AsyncConnection, *, batch_id: str, status: str, only_from: tuple[str, ...], **values: Any
) -> bool:
    """Move the batch to `status` (stamping its time) if it is in one of `only_from`."""
    batch = db.batches.c
    stamp = {_ENTERED_AT[status]: utc_now()} if status in _ENTERED_AT else {}
    moved = await conn.execute(
        update(db.batches)
        .where(batch.id == batch_id, batch.status.in_(only_from))
        .values(status=status, **stamp, **values)
        .returning(batch.id)
    )
    return moved.first() is not None


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


async def get_lines(conn: AsyncConnection, *, batch_id: str) -> list[LineRecord]:
    lines = db.batch_lines.c
    query = select(*_LINE).where(lines.batch_id == batch_id).order_by(lines.line_index)
    return as_records(LineRecord, await conn.execute(query))


async def open_items(conn: AsyncConnection, *, job_id: str, limit: int) -> list[str]:
    """Request ids of the job's first `limit` unfinished items, in item order (the window)."""
    items = db.job_items.c
    query = (
        select(items.request_id)
        .where(items.job_id == job_id, items.status.in_(("queued", "running")))
        .order_by(items.item_index)
        .limit(limit)
    )
    return list((await conn.execute(query)).scalars())
