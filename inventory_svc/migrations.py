"""Versioned schema of the inventory database and the code that brings a file up to date.

Each migration is (version, statements). Versions only ever grow: to change the schema,
append a new entry; never edit one that has shipped, because databases in the field have
already recorded it in ``schema_migrations`` and will not run it again.
"""

from __future__ import annotations

import sqlite3
import time

from accelmesh.errors import FailedPrecondition

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


def current_version(conn: sqlite3.Connection) -> int:
    row = conn.execute("SELECT COALESCE(MAX(version), 0) FROM schema_migrations").fetchone()
    return int(row[0])


def apply_migrations(
    conn: sqlite3.Connection,
    where: str,
    migrations: tuple[tuple[int, tuple[str, ...]], ...] = MIGRATIONS,
) -> int:
    """Apply the migrations ``conn`` lacks, each in its own transaction; return the final version.

    ``conn`` must be in autocommit mode (isolation_level=None) so the explicit BEGIN here
    is the only transaction. ``where`` names the database in error messages.
    """
    conn.execute(
        "CREATE TABLE IF NOT EXISTS schema_migrations (version INTEGER PRIMARY KEY, applied_at REAL NOT NULL)"
    )
    known = migrations[-1][0] if migrations else 0
    found = current_version(conn)
    if found > known:
        # An older build must not write into a schema it does not understand.
        raise FailedPrecondition(
            f"database {where} is at schema version {found} but this build of accelmesh only knows "
            f"versions up to {known}; run a newer accelmesh or point the inventory at another database file"
        )
    for version, statements in migrations:
        # BEGIN IMMEDIATE takes the write lock before re-reading the version, so two
        # processes opening the same fresh file cannot both apply one migration.
        conn.execute("BEGIN IMMEDIATE")
        try:
            if current_version(conn) < version:
                for statement in statements:
                    conn.execute(statement)
                conn.execute(
                    "INSERT INTO schema_migrations (version, applied_at) VALUES (?, ?)",
                    (version, time.time()),
                )
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise
    return current_version(conn)
