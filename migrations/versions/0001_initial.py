"""Initial schema: jobs, their items and results, api keys, usage.

Revision ID: 0001
Revises:
Create Date: 2025-12-02
"""

from __future__ import annotations

from datetime import datetime

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision = "0001"
down_revision: str | None = None
branch_labels: str | None = None
depends_on: str | None = None

JSON = sa.JSON().with_variant(JSONB(), "postgresql")


def _timestamp(name: str, *, nullable: bool = True) -> sa.Column[datetime]:
    return sa.Column(name, sa.DateTime(timezone=True), nullable=nullable)


def _counter(name: str) -> sa.Column[int]:
    return sa.Column(name, sa.Integer(), nullable=False, server_default="0")


def upgrade() -> None:
    op.create_table(
        "api_keys",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column("key_hash", sa.Text(), nullable=False),
        sa.Column("key_prefix", sa.Text(), nullable=False),
        _timestamp("created_at", nullable=False),
        _timestamp("revoked_at"),
        _timestamp("last_used_at"),
        sa.UniqueConstraint("key_hash", name="uq_api_keys_key_hash"),
    )
    op.create_table(
        "jobs",
        sa.Column("id", sa.Text(), primary_key=True),
        sa.Column("kind", sa.Text(), nullable=False),
        sa.Column("route", sa.Text()),
        sa.Column("status", sa.Text(), nullable=False),
        sa.Column("priority", sa.Integer()),
        sa.Column("model", sa.Text()),
        sa.Column("params", JSON),
        sa.Column("num_items", sa.Integer()),
        _counter("num_items_done"),
        _counter("num_items_failed"),
        _counter("prompt_tokens"),
        _counter("completion_tokens"),
        sa.Column("idempotency_scope", sa.Text(), nullable=False, server_default=""),
        sa.Column("idempotency_key", sa.Text()),
        sa.Column("idempotency_fingerprint", sa.Text()),
        sa.Column("api_key_id", sa.Integer()),
        _timestamp("deadline"),
        _timestamp("created_at", nullable=False),
        _timestamp("started_at"),
        _timestamp("finished_at"),
        sa.Column("error", sa.Text()),
        sa.Column("metadata", JSON),
        sa.ForeignKeyConstraint(["api_key_id"], ["api_keys.id"], name="fk_jobs_api_key_id"),
        sa.UniqueConstraint("idempotency_scope", "idempotency_key", name="uq_jobs_idempotency"),
    )
    op.create_index("ix_jobs_status_created_at", "jobs", ["status", "created_at"])
    op.create_table(
        "job_items",
        sa.Column("job_id", sa.Text(), nullable=False),
        sa.Column("item_index", sa.Integer(), nullable=False),
        sa.Column("request_id", sa.Text(), nullable=False),
        sa.Column("prompt_token_ids", JSON, nullable=False),
        sa.Column("status", sa.Text(), nullable=False),
        _counter("attempts"),
        _timestamp("created_at", nullable=False),
        _timestamp("finished_at"),
        sa.PrimaryKeyConstraint("job_id", "item_index", name="pk_job_items"),
        sa.ForeignKeyConstraint(
            ["job_id"], ["jobs.id"], ondelete="CASCADE", name="fk_job_items_job_id"
        ),
        sa.UniqueConstraint("request_id", name="uq_job_items_request_id"),
    )
    op.create_table(
        "results",
        sa.Column("job_id", sa.Text(), nullable=False),
        sa.Column("item_index", sa.Integer(), nullable=False),
        sa.Column("request_id", sa.Text(), nullable=False),
        sa.Column("text", sa.Text()),
        sa.Column("token_ids", JSON, nullable=False),
        sa.Column("logprobs", JSON),
        sa.Column("finish_reason", sa.Text(), nullable=False),
        sa.Column("finish_detail", sa.Text()),
        sa.Column("num_prompt_tokens", sa.Integer(), nullable=False),
        sa.Column("num_output_tokens", sa.Integer(), nullable=False),
        sa.Column("num_cached_tokens", sa.Integer(), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("batcher_id", sa.Text(), nullable=False),
        _timestamp("created_at", nullable=False),
        sa.PrimaryKeyConstraint("job_id", "item_index", name="pk_results"),
        sa.ForeignKeyConstraint(
            ["job_id", "item_index"],
            ["job_items.job_id", "job_items.item_index"],
            ondelete="CASCADE",
            name="fk_results_job_item",
        ),
    )
    op.create_table(
        "usage",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("job_id", sa.Text(), nullable=False),
        sa.Column("item_index", sa.Integer(), nullable=False),
        sa.Column("api_key_id", sa.Integer()),
        sa.Column("prompt_tokens", sa.Integer(), nullable=False),
        sa.Column("completion_tokens", sa.Integer(), nullable=False),
        _timestamp("created_at", nullable=False),
        sa.ForeignKeyConstraint(
            ["job_id"], ["jobs.id"], ondelete="CASCADE", name="fk_usage_job_id"
        ),
        sa.UniqueConstraint("job_id", "item_index", name="uq_usage_job_item"),
    )


def downgrade() -> None:
    for table in ("usage", "results", "job_items", "jobs", "api_keys"):
        op.drop_table(table)
