"""The job book: jobs and their events, with the indexes a listing (newest first, paged by
created time and id) and the expiry sweep read, and the client's request ids (AIP-155), unique
per owner, so a retried submit finds the job its first attempt created.

A book written before migrations existed (SQLite, tables made by CREATE IF NOT EXISTS, maybe
without the expires and owner columns) is brought to this schema in place, its records kept: the
new columns are filled from the records once, with SQLite's JSON functions (only SQLite books are
that old).

Revision ID: 0001
Revises:
Create Date: 2026-12-01
"""

import json

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

LISTING_DROPS = ("$.shards", "$.losses", "$.plan.shards", "$.plan.shard_runs", "$.plan.placement.layers")
LISTING_TRIM_CHARS = 64 * 1024  # as jobs.LISTING_TRIM_CHARS when this revision shipped
MAX_EVENT_CHARS = 4 * 1024 * 1024  # as jobs.MAX_RECORD_CHARS


def upgrade() -> None:
    tables = set(sa.inspect(op.get_bind()).get_table_names())
    if "jobs" in tables:
        _adopt_old_book()
    else:
        op.create_table(
            "jobs",
            sa.Column("job_id", sa.Text, primary_key=True),
            sa.Column("created", sa.Float, nullable=False),
            sa.Column("state", sa.Text, nullable=False),
            sa.Column("record", sa.Text, nullable=False),
            sa.Column("expires", sa.Float),
            sa.Column("owner", sa.Text, nullable=False, server_default=""),
            sa.Column("program", sa.Text, nullable=False, server_default=""),
            sa.Column("summary", sa.Text),
            sa.Column("request_id", sa.Text),
        )
        op.create_table(
            "events",
            sa.Column("job_id", sa.Text, primary_key=True),
            sa.Column("idx", sa.Integer, primary_key=True, autoincrement=False),
            sa.Column("event", sa.Text, nullable=False),
            sa.Column("brief", sa.Text),
            sqlite_with_rowid=False,
        )
    for index in ("jobs_by_created", "jobs_by_owner"):  # made by the version before migrations, on fewer columns
        op.drop_index(index, "jobs", if_exists=True)
    op.create_index("jobs_by_created", "jobs", ["created", "job_id"])
    op.create_index("jobs_by_owner", "jobs", ["owner", "created", "job_id"])
    op.create_index("jobs_by_request", "jobs", ["owner", "request_id"], unique=True,
                    sqlite_where=sa.text("request_id IS NOT NULL"), postgresql_where=sa.text("request_id IS NOT NULL"))
    op.create_index("jobs_by_expiry", "jobs", ["expires"], if_not_exists=True,
                    sqlite_where=sa.text("expires IS NOT NULL"), postgresql_where=sa.text("expires IS NOT NULL"))


def _adopt_old_book() -> None:
    bind = op.get_bind()
    columns = {c["name"] for c in sa.inspect(bind).get_columns("jobs")}
    for name, kind, default in (("expires", sa.Float, None), ("owner", sa.Text, ""), ("program", sa.Text, ""),
                                ("summary", sa.Text, None), ("request_id", sa.Text, None)):
        if name not in columns:
            op.add_column("jobs", sa.Column(name, kind, nullable=default is None,
                                            server_default=default if default is None else sa.text("''")))
    if "expires" not in columns or "owner" not in columns:  # before these were columns: only in the record
        for job_id, text in bind.execute(sa.text("SELECT job_id, record FROM jobs")).fetchall():
            try:
                record = json.loads(text)
            except ValueError:
                continue
            bind.execute(sa.text("UPDATE jobs SET expires = :e, owner = :o WHERE job_id = :j"),
                         {"e": record.get("expires"), "o": record.get("owner") or "", "j": job_id})
    drops = ", ".join(f"'{path}'" for path in LISTING_DROPS)
    bind.execute(sa.text(
        "UPDATE jobs SET program = CASE WHEN json_valid(record) THEN "
        "coalesce(substr(json_extract(record, '$.spec.program'), 1, 256), '') ELSE '' END, "
        f"summary = CASE WHEN length(record) > :trim AND json_valid(record) THEN json_remove(record, {drops}) END"),
        {"trim": LISTING_TRIM_CHARS})
    if "brief" not in {c["name"] for c in sa.inspect(bind).get_columns("events")}:
        op.add_column("events", sa.Column("brief", sa.Text))
    bind.execute(sa.text("UPDATE events SET brief = json_remove(event, '$.plan') "
                         "WHERE length(event) > :max AND json_valid(event)"), {"max": MAX_EVENT_CHARS})


def downgrade() -> None:
    op.drop_table("events")
    op.drop_table("jobs")
