"""Keys and usage: `GET /v1/usage` (a key's own tokens and requests per day and model, or every
key's for the admin) and the admin's key routes (`/admin/keys`: create, list, change limits).

The admin is whoever holds the static `API_KEY`; with no static key configured the admin routes
answer 404 (keys are then managed with `tgq keys`).
"""

from __future__ import annotations

from dataclasses import asdict
from datetime import UTC, date, datetime, timedelta
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from pydantic import BaseModel, ConfigDict, Field

from tgq.api.app import state_of
from tgq.api.db import api_keys
from tgq.api.db.usage import usage_by_day
from tgq.api.errors import NotFoundError, ValidationError
from tgq.api.key_policy import KeyAccess, KeyLimits

router = APIRouter(tags=["Keys and usage"])
MAX_USAGE_DAYS = 366
DEFAULT_USAGE_DAYS = 30


class LimitsBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    rpm: int | None = Field(None, ge=1)
    tpm: int | None = Field(None, ge=1)
    max_concurrent: int | None = Field(None, ge=1)
    max_queued_jobs: int | None = Field(None, ge=1)
    priority: str | None = Field(None, pattern="^(interactive|bulk)$")
    adapters: list[str] | None = Field(None, description="the only models it may use")


class NewKeyBody(LimitsBody):
    name: str = Field(min_length=1, max_length=200)


def _limits(body: LimitsBody) -> KeyLimits:
    values = body.model_dump(include=set(LimitsBody.model_fields))
    adapters = values.pop("adapters")
    return KeyLimits(**values, adapters=None if adapters is None else tuple(adapters))


def _key_view(record: api_keys.ApiKeyRecord) -> dict[str, Any]:
    return {
        "id": record.id,
        "name": record.name,
        "key_prefix": record.key_prefix,
        "created_at": record.created_at.isoformat(),
        "revoked_at": None if record.revoked_at is None else record.revoked_at.isoformat(),
        "limits": asdict(record.limits),
    }


def _check_admin(request: Request) -> None:
    """Admin routes need the static key; without one configured they do not exist."""
    settings = state_of(request).settings
    if settings.api_key is None or request.state.key is not None:
        raise NotFoundError(f"No route {request.url.path}")


@router.get("/admin/keys")
async def list_keys(request: Request) -> dict[str, Any]:
    _check_admin(request)
    async with state_of(request).db.begin() as conn:
        records = await api_keys.list_api_keys(conn)
    return {"object": "list", "data": [_key_view(r) for r in records]}


@router.post("/admin/keys", status_code=201)
async def create_key(body: NewKeyBody, request: Request) -> dict[str, Any]:
    """A new key; the answer holds its secret, shown this once."""
    _check_admin(request)
    limits = _limits(body)
    async with state_of(request).db.begin() as conn:
        record, secret = await api_keys.create_api_key(conn, name=body.name, limits=limits)
    return {**_key_view(record), "key": secret}


@router.put("/admin/keys/{key_id}/limits")
async def set_limits(key_id: int, body: LimitsBody, request: Request) -> dict[str, Any]:
    """Replaces the key's limits (a field left out: no such limit)."""
    _check_admin(request)
    async with state_of(request).db.begin() as conn:
        record = await api_keys.set_key_limits(conn, key_id=key_id, limits=_limits(body))
    if record is None:
        raise NotFoundError(f"No API key {key_id}", param="key_id")
    return _key_view(record)


@router.get("/v1/usage")
async def usage(
    request: Request,
    start_date: Annotated[date | None, Query(description="first day (UTC); 30 days ago")] = None,
    end_date: Annotated[date | None, Query(description="last day (UTC); today")] = None,
) -> dict[str, Any]:
    """Requests and tokens per day and model: the key's own, or every key's (by key) for the
    admin and where auth is off. Written with the results, exactly once per item."""
    end = end_date or datetime.now(UTC).date()
    start = start_date or end - timedelta(days=DEFAULT_USAGE_DAYS - 1)
    if start > end:
        raise ValidationError("`start_date` must not be after `end_date`", param="start_date")
    if (end - start).days >= MAX_USAGE_DAYS:
        raise ValidationError(
            f"At most {MAX_USAGE_DAYS} days at once. Given: {(end - start).days + 1}",
            param="start_date",
        )
    key: KeyAccess | None = request.state.key
    async with state_of(request).db.begin() as conn:
        rows = await usage_by_day(
            conn, start=start, end=end, key_id=None if key is None else key.key_id
        )
    if key is not None:  # the key's own rows: no need to say whose
        rows = [{k: v for k, v in row.items() if k != "api_key_id"} for row in rows]
    return {"object": "list", "start_date": str(start), "end_date": str(end), "data": rows}
