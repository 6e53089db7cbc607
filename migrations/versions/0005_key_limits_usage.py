"""Per-key policy and usage by model: each API key's limits (requests and tokens per minute,
concurrent requests, queued jobs; NULL: none), the priority it may ask for at most and the LoRA
adapters it may use (NULL: any); each usage
row's model and cached prompt tokens, indexed by key and day for `/v1/usage`; open jobs by key,
for the queued-jobs limit.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-07
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision = "0005"
down_revision: str | None = "0004"
branch_labels: str | None = None
depends_on: str | None = None

JSON = sa.JSON().with_variant(JSONB(), "postgresql")
LIMIT_COLUMNS = ("rpm", "tpm", "max_concurrent", "max_queued_jobs")


def upgrade() -> None:
    with op.batch_alter_table("api_keys") as keys:
        for name in LIMIT_COLUMNS:
            keys.add_column(sa.Column(name, sa.Integer()))
        keys.add_column(sa.Column("priority", sa.Text()))
        keys.add_column(sa.Column("adapters", JSON))
    with op.batch_alter_table("usage") as usage:
        usage.add_column(sa.Column("model", sa.Text()))
        usage.add_column(
            sa.Column("cached_tokens", sa.Integer(), nullable=False, server_default="0")
        )
    op.create_index("ix_usage_api_key_id_created_at", "usage", ["api_key_id", "created_at"])
    op.create_index("ix_jobs_api_key_id_status", "jobs", ["api_key_id", "status"])


def downgrade() -> None:
    op.drop_index("ix_jobs_api_key_id_status", "jobs")
    op.drop_index("ix_usage_api_key_id_created_at", "usage")
    with op.batch_alter_table("usage") as usage:
        usage.drop_column("cached_tokens")
        usage.drop_column("model")
    with op.batch_alter_table("api_keys") as keys:
        keys.drop_column("adapters")
        keys.drop_column("priority")
        for name in reversed(LIMIT_COLUMNS):
            keys.drop_column(name)
