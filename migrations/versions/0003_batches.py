"""Batches over uploaded files (the Batches API): one row per batch, one per input line.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-03
"""

from __future__ import annotations

from datetime import datetime

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision = "0003"
down_revision: str | None = "0002"
branch_labels: str | None = None
depends_on: str | None = None
JSON = sa.JSON().with_variant(JSONB(), "postgresql")


def _moment(name: str) -> sa.Column[datetime]:
    return sa.Column(name, sa.DateTime(timezone=True))


def upgrade() -> None:
    op.create_table(
        "batches",
        sa.Column("id", sa.Text(), primary_key=True),
        sa.Column("status", sa.Text(), nullable=False),
        sa.Column("endpoint", sa.Text(), nullable=False),
        sa.Column("input_file_id", sa.Text(), nullable=False),
        sa.Column("completion_window", sa.Text(), nullable=False),
        sa.Column("job_id", sa.Text()),
        sa.Column("output_file_id", sa.Text()),
        sa.Column("error_file_id", sa.Text()),
        sa.Column("num_total", sa.Integer(), nullable=False, server_default="0"),
        sa.Column("num_completed", sa.Integer(), nullable=False, server_default="0"),
        sa.Column("num_failed", sa.Integer(), nullable=False, server_default="0"),
        sa.Column("metadata", JSON),
        sa.Column("error", sa.Text()),
        sa.Column("api_key_id", sa.Integer()),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        _moment("in_progress_at"),
        _moment("finalizing_at"),
        _moment("completed_at"),
        _moment("failed_at"),
        _moment("expired_at"),
        _moment("cancelling_at"),
        _moment("cancelled_at"),
        sa.ForeignKeyConstraint(["api_key_id"], ["api_keys.id"], name="fk_batches_api_key_id"),
    )
    op.create_index("ix_batches_api_key_id_created_at", "batches", ["api_key_id", "created_at"])
    op.create_table(
        "batch_lines",
        sa.Column("batch_id", sa.Text(), nullable=False),
        sa.Column("line_index", sa.Integer(), nullable=False),
        sa.Column("custom_id", sa.Text(), nullable=False),
        sa.Column("item_index", sa.Integer()),
        sa.Column("error", sa.Text()),
        sa.PrimaryKeyConstraint("batch_id", "line_index", name="pk_batch_lines"),
        sa.UniqueConstraint("batch_id", "custom_id", name="uq_batch_lines_custom_id"),
        sa.ForeignKeyConstraint(
            ["batch_id"], ["batches.id"], ondelete="CASCADE", name="fk_batch_lines_batch_id"
        ),
    )


def downgrade() -> None:
    op.drop_table("batch_lines")
    op.drop_index("ix_batches_api_key_id_created_at", table_name="batches")
    op.drop_table("batches")
