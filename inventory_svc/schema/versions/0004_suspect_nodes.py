"""Suspect nodes: when a dispatcher's spot check found a node's outputs wrong, and why.

A node is suspect while ``suspect_at`` is set (``inventory_svc/suspects.py``); the nodes already
registered are trusted (NULL, and an empty reason). Spelt out here rather than taken from
``inventory_svc.tables``, as the baseline is.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-07 00:00:00
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

# revision identifiers, used by Alembic.
revision: str = "0004"
down_revision: str | Sequence[str] | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Upgrade schema."""
    op.add_column("nodes", sa.Column("suspect_at", sa.Double))
    op.add_column("nodes", sa.Column("suspect_reason", sa.Text, nullable=False, server_default=""))


def downgrade() -> None:
    """Downgrade schema."""
    with op.batch_alter_table("nodes") as batch:  # SQLite: the table is copied without the columns
        batch.drop_column("suspect_reason")
        batch.drop_column("suspect_at")
