"""API keys, stored hashed (sha256 of a 256-bit random key: a fast hash is enough for keys that
cannot be guessed), compared in constant time, revocable. The plaintext is shown once."""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import asdict, dataclass, replace
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import func, insert, select, update
from sqlalchemy.ext.asyncio import AsyncConnection

from tgq.api.db import models as db
from tgq.api.db.batches import TERMINAL as BATCH_TERMINAL
from tgq.api.db.store import OPEN_STATUSES, as_records, record_columns, utc_now
from tgq.api.key_policy import KeyAccess, KeyLimits, check_open_work

NO_LIMITS = KeyLimits()
LAST_USED_RESOLUTION = timedelta(minutes=1)  # `last_used_at` is written at most this often


@dataclass(frozen=True, slots=True)
class ApiKeyRecord:
    id: int
    name: str
    key_prefix: str
    created_at: datetime
    revoked_at: datetime | None
    last_used_at: datetime | None
    rpm: int | None = None
    tpm: int | None = None
    max_concurrent: int | None = None
    max_queued_jobs: int | None = None
    priority: str | None = None
    adapters: list[str] | None = None

    @property
    def limits(self) -> KeyLimits:
        adapters = None if self.adapters is None else tuple(self.adapters)
        return KeyLimits(
            self.rpm, self.tpm, self.max_concurrent, self.max_queued_jobs, self.priority, adapters
        )

    def access(self) -> KeyAccess:
        """The key as a request carries it (`request.state.key`)."""
        return KeyAccess(self.id, self.name, self.limits)


_API_KEY = record_columns(db.api_keys, ApiKeyRecord)


def _columns(limits: KeyLimits) -> dict[str, Any]:
    values = asdict(limits)
    values["adapters"] = None if limits.adapters is None else list(limits.adapters)
    return values


def _hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


async def create_api_key(
    conn: AsyncConnection, *, name: str, limits: KeyLimits = NO_LIMITS
) -> tuple[ApiKeyRecord, str]:
    """A new key: its record and the plaintext, which is shown once and never stored."""
    key = "tgq_" + secrets.token_urlsafe(32)
    created = await conn.execute(
        insert(db.api_keys)
        .values(
            name=name,
            key_hash=_hash_key(key),
            key_prefix=key[:8],
            created_at=utc_now(),
            **_columns(limits),
        )
        .returning(*_API_KEY)
    )
    return ApiKeyRecord(*created.one()), key


async def set_key_limits(
    conn: AsyncConnection, *, key_id: int, limits: KeyLimits
) -> ApiKeyRecord | None:
    """Replaces the key's limits (None: no such key). Replicas apply them from the key's next
    request on."""
    updated = await conn.execute(
        update(db.api_keys)
        .where(db.api_keys.c.id == key_id)
        .values(**_columns(limits))
        .returning(*_API_KEY)
    )
    row = updated.first()
    return None if row is None else ApiKeyRecord(*row)


async def verify_api_key(conn: AsyncConnection, *, key: str) -> ApiKeyRecord | None:
    """The record of a valid, unrevoked key, else None."""
    digest = _hash_key(key)
    keys = db.api_keys.c
    row = (
        await conn.execute(select(*_API_KEY, keys.key_hash).where(keys.key_hash == digest))
    ).first()
    if row is None or not hmac.compare_digest(row.key_hash, digest) or row.revoked_at is not None:
        return None
    record = ApiKeyRecord(*row[:-1])
    now = utc_now()
    if record.last_used_at is None or now - record.last_used_at >= LAST_USED_RESOLUTION:
        await conn.execute(update(db.api_keys).where(keys.id == record.id).values(last_used_at=now))
        record = replace(record, last_used_at=now)
    return record


async def get_api_key(conn: AsyncConnection, *, key_id: int) -> ApiKeyRecord | None:
    row = (await conn.execute(select(*_API_KEY).where(db.api_keys.c.id == key_id))).first()
    return None if row is None else ApiKeyRecord(*row)


async def revoke_api_key(conn: AsyncConnection, *, key_id: int) -> bool:
    """Revoke a key; False if there is no such key or it was already revoked."""
    keys = db.api_keys.c
    revoked = await conn.execute(
        update(db.api_keys)
        .where(keys.id == key_id, keys.revoked_at.is_(None))
        .values(revoked_at=utc_now())
        .returning(keys.id)
    )
    return revoked.first() is not None


async def list_api_keys(conn: AsyncConnection) -> list[ApiKeyRecord]:
    return as_records(
        ApiKeyRecord, await conn.execute(select(*_API_KEY).order_by(db.api_keys.c.id))
    )


# The first int of Postgres's two-int advisory locks that serialise one key's job creations.
OPEN_WORK_LOCK = 0x7467_7101


async def count_open_work(conn: AsyncConnection, *, key_id: int) -> int:
    """The key's jobs and batches not finished yet (`max_queued_jobs`), counted under a lock on
    the key held until the transaction ends: replicas creating work for one key count one after
    the other, each seeing the others' committed rows. (SQLite, embedded: one writer already.)"""
    if conn.dialect.name == "postgresql":
        await conn.execute(select(func.pg_advisory_xact_lock(OPEN_WORK_LOCK, key_id)))
    jobs, batches = db.jobs.c, db.batches.c
    num_jobs = select(func.count()).where(
        jobs.api_key_id == key_id, jobs.kind == "job", jobs.status.in_(OPEN_STATUSES)
    )
    num_batches = select(func.count()).where(
        batches.api_key_id == key_id, batches.status.not_in(BATCH_TERMINAL)
    )
    counted = await conn.execute(select(num_jobs.scalar_subquery() + num_batches.scalar_subquery()))
    return int(counted.scalar_one())


async def check_room_for_work(conn: AsyncConnection, *, key: KeyAccess | None) -> None:
    """429 when `key` has a queued-jobs limit and that many jobs and batches open; to be called
    in the transaction that creates the new one (`count_open_work`'s lock)."""
    if key is not None and key.limits.max_queued_jobs is not None:
        check_open_work(key.limits, await count_open_work(conn, key_id=key.key_id))
