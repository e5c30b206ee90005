"""The change feed: what each write did to the devices, for the other replicas on the database.

Every write that changes a device (a poll's new samples and added, updated, lost or recovered
devices; a reservation made, renewed or released) adds a row here in its own transaction
(``inventory_svc/changes.py``). Each replica reads the rows of the others to keep its device
index (ScoreDevices) and its WatchDevices streams current. On PostgreSQL each row carries its
transaction's id (``pg_current_xact_id()``), by which readers page: rows of transactions older
than every transaction still running can no longer appear behind a reader's back. SQLite's
writers take turns, so its rows are numbered in commit order and ``seq`` pages them (never reused:
AUTOINCREMENT). Spelt out here rather than taken from ``inventory_svc.tables``, as the baseline is.

Revision ID: 0003
Revises: 0002
Create Date: 2025-03-01 00:00:00
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

# revision identifiers, used by Alembic.
revision: str = "0003"
down_revision: str | Sequence[str] | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Upgrade schema."""
    postgres = op.get_bind().dialect.name == "postgresql"
    # xid8 as text as bigint: a 64-bit transaction id that never wraps around.
    txid_default = sa.text("CAST(CAST(pg_current_xact_id() AS text) AS bigint)") if postgres else None
    op.create_table(
        "inventory_changes",
        sa.Column("seq", sa.BigInteger().with_variant(sa.Integer, "sqlite"), primary_key=True, autoincrement=True),
        sa.Column("txid", sa.BigInteger, server_default=txid_default),
        sa.Column("writer", sa.Text, nullable=False),
        sa.Column("written_at", sa.Double, nullable=False),
        sa.Column("events", sa.Text, nullable=False, server_default="[]"),
        sa.Column("samples", sa.Text, nullable=False, server_default="[]"),
        sa.Column("reserved", sa.Text, nullable=False, server_default="[]"),
        sqlite_autoincrement=True,
    )
    op.create_index("inventory_changes_txid", "inventory_changes", ["txid"])
    op.create_index("inventory_changes_written", "inventory_changes", ["written_at"])


def downgrade() -> None:
    """Downgrade schema."""
    op.drop_table("inventory_changes")
