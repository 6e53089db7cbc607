"""Queries of uploaded files' records (the bytes are in `api.files.storage`).

A delete is soft: it sets `deleted_at`, after which the file is invisible to every query here,
and the caller removes the bytes. The row stays so that what referred to the file (batches) can
still say what it was, and so that bytes left behind by a failed removal can be found again.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

from sqlalchemy import Select, and_, delete, or_, select, update
from sqlalchemy.ext.asyncio import AsyncConnection

from tgq.api.db import models as db
from tgq.api.db.batches import TERMINAL as BATCH_TERMINAL
from tgq.api.db.store import as_records, record_columns, utc_now

Order = Literal["asc", "desc"]


@dataclass(frozen=True, slots=True)
class FileRecord:
    id: str
    purpose: str
    filename: str
    bytes: int
    num_lines: int
    status: str
    api_key_id: int | None
    created_at: datetime
    deleted_at: datetime | None
    storage_key: str


_FILE = record_columns(db.files, FileRecord)


async def create_file(
    conn: AsyncConnection,
    *,
    file_id: str,
    purpose: str,
    filename: str,
    num_bytes: int,
    num_lines: int,
    storage_key: str,
    api_key_id: int | None = None,
    status: str = "processed",
) -> FileRecord:
    created = await conn.execute(
        db.files.insert()
        .values(
            id=file_id,
            purpose=purpose,
            filename=filename,
            bytes=num_bytes,
            num_lines=num_lines,
            status=status,
            api_key_id=api_key_id,
            created_at=utc_now(),
            storage_key=storage_key,
        )
        .returning(*_FILE)
    )
    return FileRecord(*created.one())


def _visible(query: Select[Any], api_key_id: int | None) -> Select[Any]:
    """Not deleted and, with `api_key_id`, uploaded with that key."""
    query = query.where(db.files.c.deleted_at.is_(None))
    if api_key_id is not None:
        query = query.where(db.files.c.api_key_id == api_key_id)
    return query


async def get_file(
    conn: AsyncConnection, *, file_id: str, api_key_id: int | None = None
) -> FileRecord | None:
    query = _visible(select(*_FILE).where(db.files.c.id == file_id), api_key_id)
    row = (await conn.execute(query)).first()
    return None if row is None else FileRecord(*row)


async def list_files(
    conn: AsyncConnection,
    *,
    limit: int,
    order: Order = "desc",
    after: str | None = None,
    purpose: str | None = None,
    api_key_id: int | None = None,
) -> list[FileRecord]:
    """By `created_at`, then id, in `order`. `after` is the last file id of the previous page;
    an unknown cursor gives an empty page."""
    file = db.files.c
    query = _visible(select(*_FILE), api_key_id)
    if purpose is not None:
        query = query.where(file.purpose == purpose)
    if after is not None:
        cursor = select(file.created_at).where(file.id == after).scalar_subquery()
        if order == "desc":
            later = or_(file.created_at < cursor, and_(file.created_at == cursor, file.id < after))
        else:
            later = or_(file.created_at > cursor, and_(file.created_at == cursor, file.id > after))
        query = query.where(later)
    if order == "desc":
        query = query.order_by(file.created_at.desc(), file.id.desc())
    else:
        query = query.order_by(file.created_at, file.id)
    return as_records(FileRecord, await conn.execute(query.limit(limit)))


async def delete_file(
    conn: AsyncConnection, *, file_id: str, api_key_id: int | None = None
) -> FileRecord | None:
    """Mark the file deleted; its record as it was, or None when it is not visible."""
    file = db.files.c
    query = update(db.files).where(file.id == file_id, file.deleted_at.is_(None))
    if api_key_id is not None:
        query = query.where(file.api_key_id == api_key_id)
    row = (await conn.execute(query.values(deleted_at=utc_now()).returning(*_FILE))).first()
    return None if row is None else FileRecord(*row)


async def purge_file(conn: AsyncConnection, *, file_id: str) -> None:
    """Remove the file's record for good (a file about to be written again, retention)."""
    await conn.execute(delete(db.files).where(db.files.c.id == file_id))


async def expired_files(conn: AsyncConnection, *, created_before: datetime) -> list[FileRecord]:
    """Files (deleted or not) created before the given time that no unfinished batch reads."""
    file, batch = db.files.c, db.batches.c
    in_use = select(batch.input_file_id).where(batch.status.not_in(BATCH_TERMINAL))
    query = select(*_FILE).where(file.created_at < created_before, file.id.not_in(in_use))
    return as_records(FileRecord, await conn.execute(query.order_by(file.created_at)))
