"""Batch runners: a batch's lease (which runner drives it, until when) and the status its
finalizing ends in; a job item's own parameters (a batch's lines each have theirs).

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-03
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision = "0004"
down_revision: str | None = "0003"
branch_labels: str | None = None
depends_on: str | None = None
JSON = sa.JSON().with_variant(JSONB(), "postgresql")


def upgrade() -> None:
    with op.batch_alter_table("batches") as batches:
        batches.add_column(sa.Column("runner_id", sa.Text()))
        batches.add_column(sa.Column("lease_until", sa.DateTime(timezone=True)))
        batches.add_column(sa.Column("finalizing_to", sa.Text()))
    with op.batch_alter_table("job_items") as items:
        items.add_column(sa.Column("params", JSON))


def downgrade() -> None:
    with op.batch_alter_table("job_items") as items:
        items.drop_column("params")
    with op.batch_alter_table("batches") as batches:
        batches.drop_column("finalizing_to")
        batches.drop_column("lease_until")
        batches.drop_column("runner_id")
