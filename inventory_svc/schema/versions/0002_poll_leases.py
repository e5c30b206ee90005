"""Poll leases: which inventory replica polls each node, and the table of live replicas.

Several replicas on one database split the nodes between them (``inventory_svc/polls.py``,
``claim_nodes``): a node row names its poller and until when that one holds it, and each replica
records until when it counts as live, from which the fair shares are computed. The new columns
are NULL on the nodes already registered: no one polls them until the first replica claims them.
Spelt out here rather than taken from ``inventory_svc.tables``, as the baseline is.

Revision ID: 0002
Revises: 0001
Create Date: 2025-02-01 00:00:00
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

# revision identifiers, used by Alembic.
revision: str = "0002"
down_revision: str | Sequence[str] | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Upgrade schema."""
    # Nullable columns without a default: a plain ALTER TABLE ... ADD COLUMN on both engines.
    op.add_column("nodes", sa.Column("poller", sa.Text))
    op.add_column("nodes", sa.Column("poll_lease_until", sa.Double))
    op.create_index("nodes_poller", "nodes", ["poller"])
    op.create_table(
        "inventory_replicas",
        sa.Column("id", sa.Text, primary_key=True),
        sa.Column("seen_at", sa.Double, nullable=False),
        sa.Column("live_until", sa.Double, nullable=False),
    )


def downgrade() -> None:
    """Downgrade schema."""
    op.drop_table("inventory_replicas")
    op.drop_index("nodes_poller", table_name="nodes")
    with op.batch_alter_table("nodes") as batch:  # SQLite: the table is copied without the columns
        batch.drop_column("poll_lease_until")
        batch.drop_column("poller")
