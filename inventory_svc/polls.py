"""What a node's report writes, inside the store's transaction: each device it reports added,
updated or recovered (one id reported by two live nodes is refused), and the device's status
samples pruned to the newest few; and the lookup of the registered node every node write starts
from. Kept apart from ``store.py`` as ``reservations.py`` is: the store holds the transactions,
these the rules applied within them.
"""

from __future__ import annotations

import sqlite3

from accelmesh.errors import FailedPrecondition, NotFound
from accelmesh.hardware.model import DeviceSpec
from inventory_svc.records import DeviceChange, NodeRecord
from inventory_svc.rows import NODE_SELECT, SPEC_COLUMNS, spec_values


def node_record(conn: sqlite3.Connection, address: str) -> NodeRecord:
    row = conn.execute(NODE_SELECT + " WHERE address = ?", (address,)).fetchone()
    if row is None:
        raise NotFound(f"node {address!r} is not registered; register the node before reporting on it")
    return NodeRecord(*row)


def upsert_device(conn: sqlite3.Connection, address: str, spec: DeviceSpec, now: float) -> list[DeviceChange]:
    values = spec_values(spec)
    row = conn.execute(
        f"SELECT {', '.join(SPEC_COLUMNS)}, node_address, health FROM devices WHERE id = ?", (spec.id,)
    ).fetchone()
    assignments = ", ".join(f"{column} = ?" for column in SPEC_COLUMNS)
    if row is None:
        conn.execute(
            f"INSERT INTO devices (id, node_address, {', '.join(SPEC_COLUMNS)}, first_seen_at, updated_at) "
            f"VALUES (?, ?, {', '.join('?' * len(SPEC_COLUMNS))}, ?, ?)",
            (spec.id, address, *values, now, now),
        )
        return [DeviceChange("added", spec.id)]
    owner = row[-2]
    if owner != address and node_record(conn, owner).state == "active":
        # Two live workers claiming one id would flip the row between them on every poll.
        raise FailedPrecondition(
            f"device {spec.id} is already reported by node {owner}; run one worker per node IP, "
            f"or give this worker its own IP with --advertise-ip"
        )
    changes = []
    if tuple(row[: len(SPEC_COLUMNS)]) != values or owner != address:
        conn.execute(
            f"UPDATE devices SET {assignments}, node_address = ?, updated_at = ? WHERE id = ?",
            (*values, address, now, spec.id),
        )
        changes.append(DeviceChange("updated", spec.id))
    if row[-1] != "healthy":
        conn.execute("UPDATE devices SET health = 'healthy', updated_at = ? WHERE id = ?", (now, spec.id))
        changes.append(DeviceChange("recovered", spec.id))
    return changes


def prune_samples(conn: sqlite3.Connection, device_id: str, *, cutoff: float, keep: int) -> None:
    """Drop the device's samples older than `cutoff` or beyond its newest `keep`."""
    # Seeks on the (device_id, ts) key only: the age cut-off, and the ts of the Nth newest
    # sample (NULL while a device has fewer than N, which deletes nothing). The newest
    # sample always stays: it is the device's current status, even from a skewed clock.
    conn.execute(
        "DELETE FROM status_samples WHERE device_id = :d "
        "AND ts < (SELECT MAX(ts) FROM status_samples WHERE device_id = :d) AND (ts < :cutoff OR ts < ("
        "SELECT ts FROM status_samples WHERE device_id = :d ORDER BY ts DESC LIMIT 1 OFFSET :keep))",
        {"d": device_id, "cutoff": cutoff, "keep": keep - 1},
    )
