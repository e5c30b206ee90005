"""The inventory's tables as SQLAlchemy Core objects: one schema for SQLite and PostgreSQL.

What the store's statements are built from, and what Alembic's revisions
(``schema/versions/``: the baseline ``0001``, the poll leases of ``0002``, the change feed of
``0003``, the suspect marks of ``0004``) create. Byte counts are BigInteger (an 80 GB device is
far past 2**31); times are Unix seconds as doubles; ``capabilities`` and ``performance`` are JSON
text written canonically (sorted) so that equal specs store equal strings. Changing a table here
needs a new Alembic revision: databases in the field only ever move forward through revisions.
"""

from __future__ import annotations

import sqlalchemy as sa

metadata = sa.MetaData()

nodes = sa.Table(
    "nodes", metadata,
    sa.Column("address", sa.Text, primary_key=True),  # the one name of a node: the host:port the poller dials
    sa.Column("ip", sa.Text, nullable=False),
    sa.Column("hostname", sa.Text, nullable=False, server_default=""),
    sa.Column("state", sa.Text, nullable=False, server_default="active"),
    sa.Column("registered_at", sa.Double, nullable=False),
    sa.Column("last_seen_at", sa.Double),
    sa.Column("missed_polls", sa.Integer, nullable=False, server_default="0"),
    sa.Column("last_error", sa.Text, nullable=False, server_default=""),
    # Which inventory replica polls the node, until when (polls.py, claim_nodes); NULL: no one yet.
    sa.Column("poller", sa.Text),
    sa.Column("poll_lease_until", sa.Double),
    # Set while the node is suspect (suspects.py): when a spot check found its outputs wrong, and why.
    sa.Column("suspect_at", sa.Double),
    sa.Column("suspect_reason", sa.Text, nullable=False, server_default=""),
    sa.CheckConstraint("state IN ('active', 'lost')", name="nodes_state"),
    sa.Index("nodes_poller", "poller"),
)

# The inventory replicas polling this database, each live until ``live_until`` unless it claims
# again: what a replica's fair share of the nodes is counted from.
inventory_replicas = sa.Table(
    "inventory_replicas", metadata,
    sa.Column("id", sa.Text, primary_key=True),  # uuid4 hex, chosen at the replica's start
    sa.Column("seen_at", sa.Double, nullable=False),
    sa.Column("live_until", sa.Double, nullable=False),
)

devices = sa.Table(
    "devices", metadata,
    sa.Column("id", sa.Text, primary_key=True),  # "<node ip>/<platform>:<local index>"
    sa.Column("node_address", sa.Text, sa.ForeignKey("nodes.address", ondelete="CASCADE"), nullable=False),
    sa.Column("node_ip", sa.Text, nullable=False),  # as the device reported it; the node's ip may differ behind NAT
    sa.Column("local_index", sa.Integer, nullable=False),
    sa.Column("platform", sa.Text, nullable=False),
    sa.Column("kind", sa.Text, nullable=False),
    sa.Column("type", sa.Text, nullable=False),
    sa.Column("compute_capability", sa.Text, nullable=False, server_default=""),
    sa.Column("capabilities", sa.Text, nullable=False, server_default="[]"),  # JSON list, sorted
    sa.Column("performance", sa.Text, nullable=False, server_default="{}"),  # JSON object of Performance
    sa.Column("emulated", sa.Boolean(create_constraint=False), nullable=False, server_default=sa.false()),
    sa.Column("execution_device", sa.Text, nullable=False, server_default=""),
    sa.Column("health", sa.Text, nullable=False, server_default="healthy"),
    sa.Column("first_seen_at", sa.Double, nullable=False),
    sa.Column("updated_at", sa.Double, nullable=False),
    sa.CheckConstraint("health IN ('healthy', 'lost')", name="devices_health"),
    sa.Index("devices_node", "node_address"),
)

# Keyed (clustered, on SQLite: WITHOUT ROWID) on (device_id, ts): the latest sample and retention
# pruning are both range seeks on this key, so neither scans the table.
status_samples = sa.Table(
    "status_samples", metadata,
    sa.Column("device_id", sa.Text, sa.ForeignKey("devices.id", ondelete="CASCADE"), primary_key=True),
    sa.Column("ts", sa.Double, primary_key=True),
    sa.Column("memory_total", sa.BigInteger, nullable=False),
    sa.Column("memory_used", sa.BigInteger, nullable=False),
    sa.Column("utilization", sa.Double, nullable=False, server_default="0"),
    sa.Column("temperature_c", sa.Double),
    sa.Column("power_w", sa.Double),
    sqlite_with_rowid=False,
)

reservations = sa.Table(
    "reservations", metadata,
    sa.Column("job_id", sa.Text, primary_key=True),
    sa.Column("device_id", sa.Text, sa.ForeignKey("devices.id", ondelete="CASCADE"), primary_key=True),
    sa.Column("memory_bytes", sa.BigInteger, nullable=False),
    sa.Column("compute_fraction", sa.Double, nullable=False),
    sa.Column("created_at", sa.Double, nullable=False),
    sa.Column("expires_at", sa.Double, nullable=False),
    sa.Index("reservations_device", "device_id", "expires_at"),
    sa.Index("reservations_expiry", "expires_at"),
)

# The change feed (changes.py): one row per write that changed devices, so every replica keeps
# its device index and its watchers current with what the others wrote. ``txid`` is the writing
# transaction's id on PostgreSQL (its server default, set by revision 0003), which readers page
# by: rows of transactions older than every running one are final, whatever order they committed
# in. SQLite, whose writers take turns, pages by ``seq``. Rows are dropped after CHANGE_RETENTION_S.
inventory_changes = sa.Table(
    "inventory_changes", metadata,
    sa.Column("seq", sa.BigInteger().with_variant(sa.Integer, "sqlite"), primary_key=True, autoincrement=True),
    sa.Column("txid", sa.BigInteger),
    sa.Column("writer", sa.Text, nullable=False),  # the store that wrote it (SqlStore.writer): it skips its own
    sa.Column("written_at", sa.Double, nullable=False),
    sa.Column("events", sa.Text, nullable=False, server_default="[]"),  # JSON [[kind, device id], ...]
    sa.Column("samples", sa.Text, nullable=False, server_default="[]"),  # JSON [[device id, ts, total, used, ...]]
    sa.Column("reserved", sa.Text, nullable=False, server_default="[]"),  # JSON [device id, ...]
    sa.Index("inventory_changes_txid", "txid"),
    sa.Index("inventory_changes_written", "written_at"),
    sqlite_autoincrement=True,  # a seq is never handed out twice, even once every row is pruned
)
