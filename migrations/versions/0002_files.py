"""Uploaded files (the Files API); an index for scanning open job items oldest first.

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-03
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision: str | None = "0001"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    op.create_table(
        "files",
        sa.Column("id", sa.Text(), primary_key=True),
        sa.Column("purpose", sa.Text(), nullable=False),
        sa.Column("filename", sa.Text(), nullable=False),
        sa.Column("bytes", sa.BigInteger(), nullable=False),
        sa.Column("num_lines", sa.Integer(), nullable=False),
        sa.Column("status", sa.Text(), nullable=False),
        sa.Column("api_key_id", sa.Integer()),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("deleted_at", sa.DateTime(timezone=True)),
        sa.Column("storage_key", sa.Text(), nullable=False),
        sa.ForeignKeyConstraint(["api_key_id"], ["api_keys.id"], name="fk_files_api_key_id"),
    )
    op.create_index("ix_files_api_key_id_created_at", "files", ["api_key_id", "created_at"])
    op.create_index("ix_job_items_status_created_at", "job_items", ["status", "created_at"])


def downgrade() -> None:
    op.drop_index("ix_job_items_status_created_at", table_name="job_items")
    op.drop_index("ix_files_api_key_id_created_at", table_name="files")
    op.drop_table("files")
