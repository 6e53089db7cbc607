"""The schema as SQLAlchemy Core tables: the metadata Alembic compares with the database.

Migrations create the schema (`migrations/versions/`); these tables describe the same thing for
queries. Timestamps are UTC, set by the code, never by the database, so SQLite and Postgres agree.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Column,
    DateTime,
    Dialect,
    ForeignKey,
    ForeignKeyConstraint,
    Index,
    Integer,
    MetaData,
    PrimaryKeyConstraint,
    Table,
    Text,
    TypeDecorator,
    UniqueConstraint,
)
from sqlalchemy.dialects.postgresql import JSONB

metadata = MetaData()

# Plain JSON everywhere, JSONB on Postgres.
Json = JSON().with_variant(JSONB(), "postgresql")


class UtcDateTime(TypeDecorator[datetime]):
    """`timestamptz` on Postgres; on SQLite (which keeps no offset) values are stored in UTC and
    read back as aware UTC datetimes, so both databases return the same values."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError(f"naive datetime {value!r}: pass an aware UTC datetime")
        return value.astimezone(UTC)

    def process_result_value(self, value: Any, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


def _counter(name: str) -> Column[int]:
    return Column(name, Integer, nullable=False, server_default="0")


api_keys = Table(
    "api_keys",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("name", Text, nullable=False),
    Column("key_hash", Text, nullable=False),
    Column("key_prefix", Text, nullable=False),
    Column("created_at", UtcDateTime, nullable=False),
    Column("revoked_at", UtcDateTime),
    Column("last_used_at", UtcDateTime),
    # The key's limits (None: none) and the highest priority it may ask for (`api/key_policy.py`)
    Column("rpm", Integer),
    Column("tpm", Integer),
    Column("max_concurrent", Integer),
    Column("max_queued_jobs", Integer),
    Column("priority", Text),
    Column("adapters", Json),  # the model names (LoRA adapters, the base) it may use; None: any
    UniqueConstraint("key_hash", name="uq_api_keys_key_hash"),
)

jobs = Table(
    "jobs",
    metadata,
    Column("id", Text, primary_key=True),
    Column("kind", Text, nullable=False),
    Column("route", Text),
    Column("status", Text, nullable=False),
    Column("priority", Integer),
    Column("model", Text),
    Column("params", Json),
    Column("num_items", Integer),
    _counter("num_items_done"),
    _counter("num_items_failed"),
    _counter("prompt_tokens"),
    _counter("completion_tokens"),
    Column("idempotency_scope", Text, nullable=False, server_default=""),
    Column("idempotency_key", Text),
    Column("idempotency_fingerprint", Text),
    Column("api_key_id", Integer, ForeignKey("api_keys.id", name="fk_jobs_api_key_id")),
    Column("deadline", UtcDateTime),
    Column("created_at", UtcDateTime, nullable=False),
    Column("started_at", UtcDateTime),
    Column("finished_at", UtcDateTime),
    Column("error", Text),
    Column("metadata", Json),
    UniqueConstraint("idempotency_scope", "idempotency_key", name="uq_jobs_idempotency"),
    Index("ix_jobs_status_created_at", "status", "created_at"),
    Index("ix_jobs_api_key_id_status", "api_key_id", "status"),
)

job_items = Table(
    "job_items",
    metadata,
    Column(
        "job_id",
        Text,
        ForeignKey("jobs.id", ondelete="CASCADE", name="fk_job_items_job_id"),
        nullable=False,
    ),
    Column("item_index", Integer, nullable=False),
    Column("request_id", Text, nullable=False),
    Column("prompt_token_ids", Json, nullable=False),
    Column("status", Text, nullable=False),
    _counter("attempts"),
    Column("created_at", UtcDateTime, nullable=False),
    Column("finished_at", UtcDateTime),
    Column("params", Json),  # the item's own parameters (a batch line's); None: the job's
    PrimaryKeyConstraint("job_id", "item_index", name="pk_job_items"),
    UniqueConstraint("request_id", name="uq_job_items_request_id"),
    Index("ix_job_items_status_created_at", "status", "created_at"),
)

results = Table(
    "results",
    metadata,
    Column("job_id", Text, nullable=False),
    Column("item_index", Integer, nullable=False),
    Column("request_id", Text, nullable=False),
    Column("text", Text),
    Column("token_ids", Json, nullable=False),
    Column("logprobs", Json),
    Column("finish_reason", Text, nullable=False),
    Column("finish_detail", Text),
    Column("num_prompt_tokens", Integer, nullable=False),
    Column("num_output_tokens", Integer, nullable=False),
    Column("num_cached_tokens", Integer, nullable=False),
    Column("attempt", Integer, nullable=False),
    Column("batcher_id", Text, nullable=False),
    Column("created_at", UtcDateTime, nullable=False),
    PrimaryKeyConstraint("job_id", "item_index", name="pk_results"),
    ForeignKeyConstraint(
        ["job_id", "item_index"],
        ["job_items.job_id", "job_items.item_index"],
        ondelete="CASCADE",
        name="fk_results_job_item",
    ),
)

# The unique (job_id, item_index) index also serves lookups by job_id.
usage = Table(
    "usage",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column(
        "job_id",
        Text,
        ForeignKey("jobs.id", ondelete="CASCADE", name="fk_usage_job_id"),
        nullable=False,
    ),
    Column("item_index", Integer, nullable=False),
    Column("api_key_id", Integer),
    Column("model", Text),
    Column("prompt_tokens", Integer, nullable=False),
    Column("completion_tokens", Integer, nullable=False),
    _counter("cached_tokens"),
    Column("created_at", UtcDateTime, nullable=False),
    UniqueConstraint("job_id", "item_index", name="uq_usage_job_item"),
    Index("ix_usage_api_key_id_created_at", "api_key_id", "created_at"),
)

# Uploaded files (OpenAI's Files API); the bytes are in the file storage under `storage_key`.
# A delete sets `deleted_at` (the row stays: batches will refer to their input files).
files = Table(
    "files",
    metadata,
    Column("id", Text, primary_key=True),
    Column("purpose", Text, nullable=False),
    Column("filename", Text, nullable=False),
    Column("bytes", BigInteger, nullable=False),
    Column("num_lines", Integer, nullable=False),
    Column("status", Text, nullable=False),
    Column("api_key_id", Integer, ForeignKey("api_keys.id", name="fk_files_api_key_id")),
    Column("created_at", UtcDateTime, nullable=False),
    Column("deleted_at", UtcDateTime),
    Column("storage_key", Text, nullable=False),
    Index("ix_files_api_key_id_created_at", "api_key_id", "created_at"),
)


def _moment(name: str) -> Column[datetime]:
    return Column(name, UtcDateTime)


batches = Table(
    "batches",
    metadata,
    Column("id", Text, primary_key=True),
    Column("status", Text, nullable=False),
    Column("endpoint", Text, nullable=False),
    Column("input_file_id", Text, nullable=False),
    Column("completion_window", Text, nullable=False),
    Column("job_id", Text),  # the job whose items are the batch's valid lines
    Column("output_file_id", Text),
    Column("error_file_id", Text),
    _counter("num_total"),
    _counter("num_completed"),
    _counter("num_failed"),
    Column("metadata", Json),
    Column("error", Text),
    Column("api_key_id", Integer, ForeignKey("api_keys.id", name="fk_batches_api_key_id")),
    Column("created_at", UtcDateTime, nullable=False),
    Column("expires_at", UtcDateTime, nullable=False),
    _moment("in_progress_at"),
    _moment("finalizing_at"),
    _moment("completed_at"),
    _moment("failed_at"),
    _moment("expired_at"),
    _moment("cancelling_at"),
    _moment("cancelled_at"),
    # The runner driving the batch holds it until `lease_until` (renewed as it goes); a batch
    # whose lease ran out is resumed by another. `finalizing_to`: the status finalizing ends in.
    Column("runner_id", Text),
    _moment("lease_until"),
    Column("finalizing_to", Text),
    Index("ix_batches_api_key_id_created_at", "api_key_id", "created_at"),
)

# One per input line: its custom_id, and either the job item that runs it or why it cannot run.
batch_lines = Table(
    "batch_lines",
    metadata,
    Column(
        "batch_id",
        Text,
        ForeignKey("batches.id", ondelete="CASCADE", name="fk_batch_lines_batch_id"),
        nullable=False,
    ),
    Column("line_index", Integer, nullable=False),
    Column("custom_id", Text, nullable=False),
    Column("item_index", Integer),
    Column("error", Text),
    PrimaryKeyConstraint("batch_id", "line_index", name="pk_batch_lines"),
    UniqueConstraint("batch_id", "custom_id", name="uq_batch_lines_custom_id"),
)
