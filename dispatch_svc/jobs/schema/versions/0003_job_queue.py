"""The job queue and quotas: a QUEUED job's priority, place, deadline and reason; what an admitted
job holds (devices and reserved bytes) for its owner's quota; and the quotas operators set.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-04
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

_COLUMNS = ("priority", "queued_at", "queue_deadline", "queue_reason", "held_devices", "held_bytes")


def upgrade() -> None:
    op.add_column("jobs", sa.Column("priority", sa.Integer, nullable=False, server_default="0"))
    op.add_column("jobs", sa.Column("queued_at", sa.Float))
    op.add_column("jobs", sa.Column("queue_deadline", sa.Float))
    op.add_column("jobs", sa.Column("queue_reason", sa.Text))
    op.add_column("jobs", sa.Column("held_devices", sa.Integer, nullable=False, server_default="0"))
    op.add_column("jobs", sa.Column("held_bytes", sa.BigInteger, nullable=False, server_default="0"))
    # What the queue reads every pass: the queued jobs in the order they are tried.
    op.create_index("jobs_queued", "jobs", [sa.text("priority DESC"), "queued_at", "job_id"],
                    sqlite_where=sa.text("state = 'queued'"), postgresql_where=sa.text("state = 'queued'"))
    # What a quota check reads: an owner's jobs holding devices.
    op.create_index("jobs_holding", "jobs", ["owner"],
                    sqlite_where=sa.text("held_devices > 0"), postgresql_where=sa.text("held_devices > 0"))
    op.create_table(
        "quotas",
        sa.Column("tenant", sa.Text, primary_key=True),
        sa.Column("max_jobs", sa.Integer),
        sa.Column("max_devices", sa.Integer),
        sa.Column("max_memory_bytes", sa.BigInteger),
        sa.Column("max_priority", sa.Integer),
    )


def downgrade() -> None:
    op.drop_table("quotas")
    op.drop_index("jobs_holding", table_name="jobs")
    op.drop_index("jobs_queued", table_name="jobs")
    with op.batch_alter_table("jobs") as batch:  # SQLite: the table is copied without the columns
        for name in reversed(_COLUMNS):
            batch.drop_column(name)
