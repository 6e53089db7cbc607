"""The queries of jobs, their items and their results, in SQLAlchemy Core on an
`AsyncConnection`; the caller owns the transaction (`async with db.begin() as conn`). Files,
batches and API keys have their own modules beside this one.

Statuses: a job and each of its items go `queued` → `running` → `succeeded` | `failed` |
`cancelled`. A result row is unique per item and only the first delivery counts: it moves the
item to its terminal status and adds to the job's counters; the job is terminal once every item
has a result, or when it is cancelled. After a cancel only `abort` results are written.

Lock order, so that concurrent writers (several api replicas) never deadlock: a statement that
changes items first locks their jobs, in id order, then the items. Counters move by atomic
`UPDATE ... SET n = n + 1`, never read-modify-write.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, fields
from datetime import UTC, datetime
from typing import Any, TypeVar

from sqlalchemy import (
    ColumnElement,
    Executable,
    Select,
    Table,
    and_,
    case,
    delete,
    func,
    insert,
    literal,
    or_,
    select,
    update,
)
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Result
from sqlalchemy.ext.asyncio import AsyncConnection

from tgq.api.db import models as db

OPEN_STATUSES = ("queued", "running")
TERMINAL_STATUSES = ("succeeded", "failed", "cancelled")
# The item status a finish reason leads to; any other reason ("rejected", "deadline", "failed")
# fails the item.
_ITEM_STATUS = {"stop": "succeeded", "length": "succeeded", "abort": "cancelled"}


def item_status(finish_reason: str) -> str:
    """The terminal item status a final result with this finish reason leads to."""
    return _ITEM_STATUS.get(finish_reason, "failed")


R = TypeVar("R")
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class JobRecord:
    id: str
    kind: str
    route: str | None
    status: str
    priority: int | None
    model: str | None
    params: dict[str, Any] | None
    num_items: int
    num_items_done: int
    num_items_failed: int
    prompt_tokens: int
    completion_tokens: int
    idempotency_scope: str
    idempotency_key: str | None
    idempotency_fingerprint: str | None
    api_key_id: int | None
    deadline: datetime | None
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    error: str | None
    metadata: dict[str, Any] | None

    @property
    def is_finished(self) -> bool:
        return self.status in TERMINAL_STATUSES


@dataclass(frozen=True, slots=True)
class ItemRecord:
    job_id: str
    item_index: int
    request_id: str
    prompt_token_ids: list[int]
    status: str
    attempts: int
    created_at: datetime
    finished_at: datetime | None
    params: dict[str, Any] | None  # the item's own parameters; None: its job's


@dataclass(frozen=True, slots=True)
class ResultRecord:
    job_id: str
    item_index: int
    request_id: str
    text: str | None
    token_ids: list[int]
    logprobs: list[float | None] | None
    finish_reason: str
    finish_detail: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    attempt: int
    batcher_id: str
    created_at: datetime


@dataclass(frozen=True, slots=True, kw_only=True)
class NewJob:
    job_id: str
    kind: str  # "interactive" | "job" | "batch"
    route: str | None
    priority: int
    model: str | None
    params: dict[str, Any]
    items: list[tuple[str, list[int]]]  # (request_id, prompt token ids) per item
    item_params: list[dict[str, Any]] | None = None  # per item, when items differ (batches)
    idempotency_key: str | None = None
    idempotency_scope: str = ""
    fingerprint: str | None = None  # sha256 of the request body
    api_key_id: int | None = None
    deadline: datetime | None = None
    metadata: dict[str, Any] | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class NewResult:
    job_id: str
    item_index: int
    request_id: str
    text: str | None
    token_ids: list[int]
    logprobs: list[float | None] | None
    finish_reason: str  # "stop" | "length" | "abort" | "rejected" | "deadline" | "failed"
    finish_detail: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    attempt: int
    batcher_id: str


def record_columns(table: Table, record: type[Any]) -> list[ColumnElement[Any]]:
    return [table.c[field.name] for field in fields(record)]


_JOB = record_columns(db.jobs, JobRecord)
_ITEM = record_columns(db.job_items, ItemRecord)
_RESULT = record_columns(db.results, ResultRecord)


def storable(value: T) -> T:
    """`value` with NUL characters replaced by U+FFFD: Postgres text and JSONB cannot hold them,
    and a model can generate one (a byte-level token). The HTTP answer, built from the
    transport's result, keeps the real text; the stored copy has the replacement."""
    if isinstance(value, str):
        return value.replace("\x00", "\ufffd")  # type: ignore[return-value]
    if isinstance(value, list):
        return [storable(v) for v in value]  # type: ignore[return-value]
    if isinstance(value, dict):
        return {storable(k): storable(v) for k, v in value.items()}  # type: ignore[return-value]
    return value


def utc_now() -> datetime:
    return datetime.now(UTC)


def _at(moment: datetime) -> ColumnElement[datetime]:
    return literal(moment, db.UtcDateTime())


def as_records(make: Callable[..., R], result: Result[Any]) -> list[R]:
    return [make(*row) for row in result]


@functools.cache
def _insert_unless_taken(dialect: str, table: Table, *unique: str) -> Executable:
    """INSERT ... ON CONFLICT (unique) DO NOTHING RETURNING: a row comes back only when it
    was inserted. Built once per dialect and table (the api runs it for every request)."""
    statement: postgresql.Insert | sqlite.Insert
    if dialect == "postgresql":
        statement = postgresql.insert(table)
    elif dialect == "sqlite":
        statement = sqlite.insert(table)
    else:
        raise NotImplementedError(f"tgq supports Postgres and SQLite, not {dialect}")
    return statement.on_conflict_do_nothing(index_elements=unique).returning(table.c[unique[0]])


async def _lock_jobs(conn: AsyncConnection, where: ColumnElement[bool]) -> list[str]:
    """Lock the matching job rows in id order (a no-op on SQLite, which has one writer)."""
    query = select(db.jobs.c.id).where(where).order_by(db.jobs.c.id).with_for_update()
    return list((await conn.execute(query)).scalars())


# --- jobs ------------------------------------------------------------------------------------


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
    statement = _insert_unless_taken(
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
    query = select(*_JOB).where(
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
    await _lock_jobs(conn, db.jobs.c.id.in_(select(db.job_items.c.job_id).where(of_requests)))
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
            .values(
                status="running", started_at=func.coalesce(db.jobs.c.started_at, _at(utc_now()))
            )
        )
    return len(job_ids)


# --- results ---------------------------------------------------------------------------------


async def record_results(conn: AsyncConnection, *, results: Sequence[NewResult]) -> list[bool]:
    """Persist final results; per result, True if it was written, False if it was a repeat
    delivery, for an unknown item, or a non-`abort` result for a cancelled item."""
    if not results:
        return []
    await _lock_jobs(conn, db.jobs.c.id.in_(sorted({result.job_id for result in results})))
    now = utc_now()
    return [await _record_result(conn, result, now) for result in results]


async def _record_result(conn: AsyncConnection, result: NewResult, now: datetime) -> bool:
    status = item_status(result.finish_reason)
    if not await _finish_item(conn, result, status, now):
        return False
    written = await conn.execute(
        _insert_unless_taken(conn.dialect.name, db.results, "job_id", "item_index"),
        {
            **asdict(result),
            "text": storable(result.text),
            "finish_detail": storable(result.finish_detail),
            "created_at": now,
        },
    )
    if written.first() is None:
        return False
    api_key_id = await _count_result(conn, result, is_failed=status == "failed", now=now)
    await conn.execute(
        insert(db.usage).values(
            job_id=result.job_id,
            item_index=result.item_index,
            api_key_id=api_key_id,
            prompt_tokens=result.num_prompt_tokens,
            completion_tokens=result.num_output_tokens,
            created_at=now,
        )
    )
    return True


async def _finish_item(
    conn: AsyncConnection, result: NewResult, status: str, now: datetime
) -> bool:
    """Move the item to its terminal status. The cancel rule lives here: once an item is
    cancelled only an `abort` result (which keeps it cancelled) gets past this point."""
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
            finished_at=func.coalesce(items.finished_at, _at(now)),
            attempts=result.attempt,  # the attempt that finished it (reruns after a crash: > 1)
        )
        .returning(items.item_index)
    )
    return moved.first() is not None


async def _count_result(
    conn: AsyncConnection, result: NewResult, *, is_failed: bool, now: datetime
) -> int | None:
    """Add one result to the job's counters; the result that completes an open job makes it
    terminal: `succeeded` when any item succeeded, else `failed` when any failed, else
    `cancelled`. Returns the job's api key id."""
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
            started_at=func.coalesce(job.started_at, _at(now)),
            finished_at=case((completes, _at(now)), else_=job.finished_at),
        )
        .returning(job.api_key_id)
    )
    api_key_id: int | None = counted.scalar_one()
    return api_key_id


# --- reads -----------------------------------------------------------------------------------


async def get_job(
    conn: AsyncConnection, *, job_id: str, api_key_id: int | None = None
) -> JobRecord | None:
    """The job, or None; with `api_key_id`, only a job created with that key."""
    query = select(*_JOB).where(db.jobs.c.id == job_id)
    if api_key_id is not None:
        query = query.where(db.jobs.c.api_key_id == api_key_id)
    row = (await conn.execute(query)).first()
    return None if row is None else JobRecord(*row)


async def get_items(conn: AsyncConnection, *, job_id: str) -> list[ItemRecord]:
    query = select(*_ITEM).where(db.job_items.c.job_id == job_id)
    return as_records(ItemRecord, await conn.execute(query.order_by(db.job_items.c.item_index)))


async def get_results(
    conn: AsyncConnection, *, job_id: str, item_indexes: Sequence[int] | None = None
) -> list[ResultRecord]:
    """The job's results in item order; with `item_indexes`, only those items'."""
    results = db.results.c
    query = select(*_RESULT).where(results.job_id == job_id)
    if item_indexes is not None:
        query = query.where(results.item_index.in_(item_indexes))
    return as_records(ResultRecord, await conn.execute(query.order_by(results.item_index)))


async def get_result(conn: AsyncConnection, *, job_id: str, item_index: int) -> ResultRecord | None:
    results = db.results.c
    query = select(*_RESULT).where(results.job_id == job_id, results.item_index == item_index)
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
    query: Select[Any] = select(*_JOB)
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
        select(*_ITEM)
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


# --- cancel and retention --------------------------------------------------------------------


async def cancel_job(conn: AsyncConnection, *, job_id: str) -> list[str] | None:
    """Cancel a job and its unfinished items; returns those items' request ids (to abort in the
    transport), [] when the job had already finished (nothing changes), None when there is no
    such job."""
    job = db.jobs.c
    row = (await conn.execute(select(job.status).where(job.id == job_id).with_for_update())).first()
    if row is None:
        return None
    if row.status in TERMINAL_STATUSES:
        return []
    now = utc_now()
    await conn.execute(
        update(db.jobs).where(job.id == job_id).values(status="cancelled", finished_at=now)
    )
    items = db.job_items.c
    cancelled = await conn.execute(
        update(db.job_items)
        .where(items.job_id == job_id, items.status.in_(OPEN_STATUSES))
        .values(status="cancelled", finished_at=now)
        .returning(items.item_index, items.request_id)
    )
    return [request_id for _, request_id in sorted(cancelled.all())]


async def fail_jobs(conn: AsyncConnection, *, job_ids: Sequence[str], error: str) -> list[str]:
    """Fail the open ones of these jobs with their open items, without result rows (nothing
    ran, or what runs is withdrawn: a later result for them is not written); returns the
    request ids of the items failed. For interactive requests answered 503 after their rows
    were committed, and for interactive items the transport lost."""
    job, items = db.jobs.c, db.job_items.c
    locked = await _lock_jobs(
        conn, and_(job.id.in_(sorted(set(job_ids))), job.status.in_(OPEN_STATUSES))
    )
    if not locked:
        return []
    now = utc_now()
    await conn.execute(
        update(db.jobs)
        .where(job.id.in_(locked))
        .values(status="failed", finished_at=now, error=storable(error))
    )
    failed = await conn.execute(
        update(db.job_items)
        .where(items.job_id.in_(locked), items.status.in_(OPEN_STATUSES))
        .values(status="failed", finished_at=now)
        .returning(items.request_id)
    )
    return sorted(failed.scalars())


async def delete_finished_before(conn: AsyncConnection, *, before: datetime) -> int:
    """Delete jobs that finished before `before`, with their items, results and usage; returns
    how many jobs."""
    job = db.jobs.c
    finished = and_(job.status.in_(TERMINAL_STATUSES), job.finished_at < before)
    job_ids = await _lock_jobs(conn, finished)
    if not job_ids:
        return 0
    await conn.execute(delete(db.jobs).where(job.id.in_(job_ids)))
    return len(job_ids)
