"""The hand-written migration chain that came before Alembic, kept only to adopt its files.

Before the inventory moved to SQLAlchemy and Alembic, a SQLite file recorded its schema version
in ``schema_migrations``, one row per entry of ``MIGRATIONS`` below. Alembic's baseline revision
calls ``adopt_legacy_file``: such a file is brought to ``LATEST_VERSION`` (its rows kept) and
``schema_migrations`` is dropped, so from then on ``inventory_alembic_version`` is the one record
of the schema. An older build opening an adopted file fails at start rather than writing into a
schema it does not know. Never edit an entry: files in the field have run them.
"""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from accelmesh.errors import FailedPrecondition

LEGACY_TABLE = "schema_migrations"

MIGRATIONS: tuple[tuple[int, tuple[str, ...]], ...] = (
    (
        1,
        (
            """CREATE TABLE nodes (
                node_id TEXT PRIMARY KEY,          -- the address the poller dials, host:port
                address TEXT NOT NULL,
                ip TEXT NOT NULL,
                hostname TEXT NOT NULL DEFAULT '',
                state TEXT NOT NULL DEFAULT 'active' CHECK (state IN ('active', 'lost')),
                registered_at REAL NOT NULL,
                last_seen_at REAL,
                missed_polls INTEGER NOT NULL DEFAULT 0,
                last_error TEXT NOT NULL DEFAULT ''
            )""",
            """CREATE TABLE devices (
                id TEXT PRIMARY KEY,               -- "<node ip>/<platform>:<local index>"
                node_id TEXT NOT NULL REFERENCES nodes(node_id) ON DELETE CASCADE,
                node_ip TEXT NOT NULL,             -- as the device reported it; node.ip may differ behind NAT
                local_index INTEGER NOT NULL,
                platform TEXT NOT NULL,
                kind TEXT NOT NULL,
                type TEXT NOT NULL,
                compute_capability TEXT NOT NULL DEFAULT '',
                capabilities TEXT NOT NULL DEFAULT '[]',   -- JSON list, sorted
                performance TEXT NOT NULL DEFAULT '{}',    -- JSON object of Performance
                emulated INTEGER NOT NULL DEFAULT 0,
                execution_device TEXT NOT NULL DEFAULT '',
                health TEXT NOT NULL DEFAULT 'healthy' CHECK (health IN ('healthy', 'lost')),
                first_seen_at REAL NOT NULL,
                updated_at REAL NOT NULL
            )""",
            "CREATE INDEX devices_node ON devices(node_id)",
            # Clustered on (device_id, ts): the latest sample and retention pruning are
            # both range seeks on this key, so neither scans the table.
            """CREATE TABLE status_samples (
                device_id TEXT NOT NULL REFERENCES devices(id) ON DELETE CASCADE,
                ts REAL NOT NULL,
                memory_total INTEGER NOT NULL,
                memory_used INTEGER NOT NULL,
                utilization REAL NOT NULL DEFAULT 0,
                temperature_c REAL,
                power_w REAL,
                PRIMARY KEY (device_id, ts)
            ) WITHOUT ROWID""",
            """CREATE TABLE reservations (
                job_id TEXT NOT NULL,
                device_id TEXT NOT NULL REFERENCES devices(id) ON DELETE CASCADE,
                memory_bytes INTEGER NOT NULL,
                compute_fraction REAL NOT NULL,
                created_at REAL NOT NULL,
                expires_at REAL NOT NULL,
                PRIMARY KEY (job_id, device_id)
            )""",
            "CREATE INDEX reservations_device ON reservations(device_id, expires_at)",
            "CREATE INDEX reservations_expiry ON reservations(expires_at)",
        ),
    ),
    (
        2,
        (
            # A node has one name, the address the poller dials: version 1 kept it twice
            # (node_id and address, always equal) and devices called it node_id.
            "ALTER TABLE nodes DROP COLUMN address",
            "ALTER TABLE nodes RENAME COLUMN node_id TO address",
            "ALTER TABLE devices RENAME COLUMN node_id TO node_address",
        ),
    ),
)

LATEST_VERSION = MIGRATIONS[-1][0]


def adopt_legacy_file(connection: Connection) -> bool:
    """Bring a pre-Alembic file to the last hand-written version; False when ``connection`` has none."""
    if not sa.inspect(connection).has_table(LEGACY_TABLE):
        return False
    found = connection.execute(sa.text(f"SELECT COALESCE(MAX(version), 0) FROM {LEGACY_TABLE}")).scalar_one()
    if found > LATEST_VERSION:
        # Written by a build whose chain went further than the one that ended here.
        raise FailedPrecondition(
            f"database is at hand-written schema version {found} but this build of accelmesh only adopts "
            f"versions up to {LATEST_VERSION}; run the accelmesh that wrote it or point the inventory at another "
            "database"
        )
    for version, statements in MIGRATIONS:
        if found < version:
            for statement in statements:
                connection.exec_driver_sql(statement)
    connection.exec_driver_sql(f"DROP TABLE {LEGACY_TABLE}")
    return True
