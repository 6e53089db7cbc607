"""Usage per key, model and day (UTC), from the usage rows written with each item's result
(`store.results`: one row per item, exactly once)."""

from __future__ import annotations

from datetime import UTC, date, datetime, time, timedelta
from typing import Any

from sqlalchemy import ColumnElement, func, select
from sqlalchemy.ext.asyncio import AsyncConnection

from tgq.api.db import models as db


async def usage_by_day(
    conn: AsyncConnection, *, start: date, end: date, key_id: int | None = None
) -> list[dict[str, Any]]:
    """One row per (day, key, model) with usage from `start` to `end` (both included): requests
    (jobs), prompt, completion, cached and total tokens. `key_id`: that key's rows only."""
    usage = db.usage.c
    day = _utc_day(conn.dialect.name, usage.created_at).label("day")
    since = datetime.combine(start, time(), UTC)
    until = datetime.combine(end + timedelta(days=1), time(), UTC)
    query = (
        select(
            day,
            usage.api_key_id,
            usage.model,
            func.count(func.distinct(usage.job_id)),
            func.sum(usage.prompt_tokens),
            func.sum(usage.completion_tokens),
            func.sum(usage.cached_tokens),
        )
        .where(usage.created_at >= since, usage.created_at < until)
        .group_by(day, usage.api_key_id, usage.model)
        .order_by(day, usage.api_key_id, usage.model)
    )
    if key_id is not None:
        query = query.where(usage.api_key_id == key_id)
    rows = await conn.execute(query)
    return [
        {
            "date": str(row[0]),
            "api_key_id": row[1],
            "model": row[2],
            "requests": int(row[3]),
            "prompt_tokens": int(row[4]),
            "completion_tokens": int(row[5]),
            "cached_tokens": int(row[6]),
            "total_tokens": int(row[4]) + int(row[5]),
        }
        for row in rows
    ]


def _utc_day(dialect: str, moment: ColumnElement[Any]) -> ColumnElement[Any]:
    if dialect == "postgresql":
        return func.date(func.timezone("UTC", moment))
    return func.date(moment)  # SQLite keeps UTC timestamps as ISO text
