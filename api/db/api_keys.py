"""API keys, stored hashed (sha256 of a 256-bit random key: a fast hash is enough for keys that
cannot be guessed), compared in constant time, revocable. The plaintext is shown once."""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass, replace
from datetime import datetime, timedelta

from sqlalchemy import insert, select, update
from sqlalchemy.ext.asyncio import AsyncConnection

from tgq.api.db import models as db
from tgq.api.db.store import as_records, record_columns, utc_now

LAST_USED_RESOLUTION = timedelta(minutes=1)  # `last_used_at` is written at most this often


@dataclass(frozen=True, slots=True)
class ApiKeyRecord:
    id: int
    name: str
    key_prefix: str
    created_at: datetime
    revoked_at: datetime | None
    last_used_at: datetime | None


_API_KEY = record_columns(db.api_keys, ApiKeyRecord)


def _hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


async def create_api_key(conn: AsyncConnection, *, name: str) -> tuple[ApiKeyRecord, str]:
    """A new key: its record and the plaintext, which is shown once and never stored."""
    key = "tgq_" + secrets.token_urlsafe(32)
    created = await conn.execute(
        insert(db.api_keys)
        .values(name=name, key_hash=_hash_key(key), key_prefix=key[:8], created_at=utc_now())
        .returning(*_API_KEY)
    )
    return ApiKeyRecord(*created.one()), key


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
