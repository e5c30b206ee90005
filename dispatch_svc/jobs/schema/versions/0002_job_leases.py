"""Job leases: which dispatch replica runs each unfinished job, until when it holds it, whether
its inputs are stored whole (so another replica can take it over), and a cancel asked through
another replica.

The replica running a job renews its lease while the job runs (dispatch_svc/execution/takeover.py); once
a lease has run out, another replica claims the job in one UPDATE and takes it over, or ends it
FAILED when it cannot. Jobs already in the book get no runner: a book's unfinished jobs from
before this revision are those a restart ends, as before.

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-01
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Nullable or defaulted columns: a plain ALTER TABLE ... ADD COLUMN on both engines.
    op.add_column("jobs", sa.Column("runner", sa.Text, nullable=False, server_default=""))
    op.add_column("jobs", sa.Column("runner_until", sa.Float))
    op.add_column("jobs", sa.Column("inputs_stored", sa.Boolean, nullable=False, server_default=sa.false()))
    op.add_column("jobs", sa.Column("cancel_requested", sa.Text))
    # What the takeover scan reads: the leases of unfinished jobs (a finished job's is NULL).
    op.create_index("jobs_by_lease", "jobs", ["runner_until"],
                    sqlite_where=sa.text("runner_until IS NOT NULL"),
                    postgresql_where=sa.text("runner_until IS NOT NULL"))


def downgrade() -> None:
    op.drop_index("jobs_by_lease", table_name="jobs")
    with op.batch_alter_table("jobs") as batch:  # SQLite: the table is copied without the columns
        for name in ("cancel_requested", "inputs_stored", "runner_until", "runner"):
            batch.drop_column(name)
