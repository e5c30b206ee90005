"""Baseline: nodes, devices, status samples and reservations; a file of the hand-written chain adopted.

A SQLite file written before Alembic (it has ``schema_migrations``) is brought to the last
hand-written version and keeps its rows; every other database gets the tables created. The
tables are spelt out here rather than taken from ``inventory_svc.tables``, so this revision
creates the same schema however the current one later changes.

Revision ID: 0001
Revises:
Create Date: 2025-01-01 00:00:00
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from inventory_svc.migrations import adopt_legacy_file

# revision identifiers, used by Alembic.
revision: str = "0001"
down_revision: str | Sequence[str] | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Upgrade schema."""
    if adopt_legacy_file(op.get_bind()):
        return
    op.create_table(
        "nodes",
        sa.Column("address", sa.Text, primary_key=True),
        sa.Column("ip", sa.Text, nullable=False),
        sa.Column("hostname", sa.Text, nullable=False, server_default=""),
        sa.Column("state", sa.Text, nullable=False, server_default="active"),
        sa.Column("registered_at", sa.Double, nullable=False),
        sa.Column("last_seen_at", sa.Double),
        sa.Column("missed_polls", sa.Integer, nullable=False, server_default="0"),
        sa.Column("last_error", sa.Text, nullable=False, server_default=""),
        sa.CheckConstraint("state IN ('active', 'lost')", name="nodes_state"),
    )
    op.create_table(
        "devices",
        sa.Column("id", sa.Text, primary_key=True),
        sa.Column("node_address", sa.Text, sa.ForeignKey("nodes.address", ondelete="CASCADE"), nullable=False),
        sa.Column("node_ip", sa.Text, nullable=False),
        sa.Column("local_index", sa.Integer, nullable=False),
        sa.Column("platform", sa.Text, nullable=False),
        sa.Column("kind", sa.Text, nullable=False),
        sa.Column("type", sa.Text, nullable=False),
        sa.Column("compute_capability", sa.Text, nullable=False, server_default=""),
        sa.Column("capabilities", sa.Text, nullable=False, server_default="[]"),
        sa.Column("performance", sa.Text, nullable=False, server_default="{}"),
        sa.Column("emulated", sa.Boolean(create_constraint=False), nullable=False, server_default=sa.false()),
        sa.Column("execution_device", sa.Text, nullable=False, server_default=""),
        sa.Column("health", sa.Text, nullable=False, server_default="healthy"),
        sa.Column("first_seen_at", sa.Double, nullable=False),
        sa.Column("updated_at", sa.Double, nullable=False),
        sa.CheckConstraint("health IN ('healthy', 'lost')", name="devices_health"),
    )
    op.create_index("devices_node", "devices", ["node_address"])
    op.create_table(
        "status_samples",
        sa.Column("device_id", sa.Text, sa.ForeignKey("devices.id", ondelete="CASCADE"), primary_key=True),
        sa.Column("ts", sa.Double, primary_key=True),
        sa.Column("memory_total", sa.BigInteger, nullable=False),
        sa.Column("memory_used", sa.BigInteger, nullable=False),
        sa.Column("utilization", sa.Double, nullable=False, server_default="0"),
        sa.Column("temperature_c", sa.Double),
        sa.Column("power_w", sa.Double),
        sqlite_with_rowid=False,
    )
    op.create_table(
        "reservations",
        sa.Column("job_id", sa.Text, primary_key=True),
        sa.Column("device_id", sa.Text, sa.ForeignKey("devices.id", ondelete="CASCADE"), primary_key=True),
        sa.Column("memory_bytes", sa.BigInteger, nullable=False),
        sa.Column("compute_fraction", sa.Double, nullable=False),
        sa.Column("created_at", sa.Double, nullable=False),
        sa.Column("expires_at", sa.Double, nullable=False),
    )
    op.create_index("reservations_device", "reservations", ["device_id", "expires_at"])
    op.create_index("reservations_expiry", "reservations", ["expires_at"])


def downgrade() -> None:
    """Downgrade schema."""
    for table in ("reservations", "status_samples", "devices", "nodes"):
        op.drop_table(table)
