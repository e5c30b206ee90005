"""The job book's tables, as SQLAlchemy Core sees them (the migrations in versions/ create them).

A record and an event are the JSON of codec.py. What a listing or a read of an oversized
record needs without parsing megabytes is kept beside it, written when the record is: `summary`
(the record without its per-shard lists, only when the record is longer than a listing reads) and
`program`, so no query needs an engine's JSON functions.
"""

import sqlalchemy as sa

metadata = sa.MetaData()

jobs = sa.Table(
    "jobs", metadata,
    sa.Column("job_id", sa.Text, primary_key=True),
    sa.Column("created", sa.Float, nullable=False),
    sa.Column("state", sa.Text, nullable=False),
    sa.Column("record", sa.Text, nullable=False),
    sa.Column("expires", sa.Float),  # when its results are deleted; NULL while it runs
    sa.Column("owner", sa.Text, nullable=False, server_default=""),
    sa.Column("program", sa.Text, nullable=False, server_default=""),
    sa.Column("summary", sa.Text),
    sa.Column("request_id", sa.Text),  # the client's (AIP-155), unique per owner; NULL for none
    # The dispatch replica running the job, and until when its lease holds (NULL once final);
    # whether its inputs are stored whole, so another replica can take it over; a cancel asked
    # through a replica that does not run it (the reason), for the runner to act on.
    sa.Column("runner", sa.Text, nullable=False, server_default=""),
    sa.Column("runner_until", sa.Float),
    sa.Column("inputs_stored", sa.Boolean, nullable=False, server_default=sa.false()),
    sa.Column("cancel_requested", sa.Text),
    # The queue (dispatch_svc/admission/queue.py): a QUEUED job's priority, when it was first queued (its
    # place, kept when it is tried again and queued anew), when it gives up, and why it waits.
    sa.Column("priority", sa.Integer, nullable=False, server_default="0"),
    sa.Column("queued_at", sa.Float),
    sa.Column("queue_deadline", sa.Float),
    sa.Column("queue_reason", sa.Text),
    # What a job that was admitted holds, for its owner's quota: devices and reserved bytes
    # (0 before it reserved and once it ended). A job holding no devices that has a place in the
    # queue keeps in held_bytes the bytes its stored inputs take, for its owner's queue bound.
    sa.Column("held_devices", sa.Integer, nullable=False, server_default="0"),
    sa.Column("held_bytes", sa.BigInteger, nullable=False, server_default="0"),
)

# Per-tenant quotas an operator sets (SetQuota); NULL: no limit. Tenant "*" applies to every
# tenant without a row of its own.
quotas = sa.Table(
    "quotas", metadata,
    sa.Column("tenant", sa.Text, primary_key=True),
    sa.Column("max_jobs", sa.Integer),
    sa.Column("max_devices", sa.Integer),
    sa.Column("max_memory_bytes", sa.BigInteger),
    sa.Column("max_priority", sa.Integer),
)

events = sa.Table(
    "events", metadata,
    sa.Column("job_id", sa.Text, primary_key=True),
    sa.Column("idx", sa.Integer, primary_key=True, autoincrement=False),
    sa.Column("event", sa.Text, nullable=False),
    sa.Column("brief", sa.Text),  # the event without its plan, when the event is too long to send
    sqlite_with_rowid=False,
)
