"""Jobs, items and results as records: the statuses, the frozen records that reads return and
writes take, the columns a record is selected by, and how a value is made storable.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from datetime import UTC, datetime
from typing import Any, TypeVar

from sqlalchemy import ColumnElement, Table
from sqlalchemy.engine import Result

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


JOB_COLUMNS = record_columns(db.jobs, JobRecord)
ITEM_COLUMNS = record_columns(db.job_items, ItemRecord)
RESULT_COLUMNS = record_columns(db.results, ResultRecord)


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


def as_records(make: Callable[..., R], result: Result[Any]) -> list[R]:
    return [make(*row) for row in result]
