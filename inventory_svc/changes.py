"""The change feed: what each write did to the devices, written in the write's own transaction
and read by every other replica on the database (its device index, its WatchDevices streams).

A change names the devices added, updated, lost, recovered or removed (the watchers' events),
carries the status samples the write stored, and names the devices whose reservations changed.
Readers page with a cursor that only moves forward:

- PostgreSQL: by transaction id. A reader takes the oldest transaction id still running (the
  snapshot's xmin) as its horizon and reads the rows of transactions from its cursor up to it;
  every transaction below the horizon has ended, so no row can later appear below it, whatever
  order concurrent writers committed in (sequence numbers would not say that: a lower one can
  commit after a higher one was read). The horizon becomes the next cursor. A long transaction
  on the cluster holds the horizon back: changes are then seen late, never missed.
- SQLite: writers take turns on the file's lock, so ``seq`` is commit order and is the cursor.

Rows older than CHANGE_RETENTION_S are pruned by the poll cycles; a reader that has not read
for RESYNC_AFTER_S (a replica stalled or cut off from the database) reloads everything instead.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from accelmesh.hardware.model import DeviceSample
from inventory_svc.records import DeviceChange
from inventory_svc.tables import inventory_changes

CHANGE_RETENTION_S = 60.0  # how long a change row is kept for readers that fell behind
RESYNC_AFTER_S = CHANGE_RETENTION_S / 2  # a reader idle longer may have lost rows: it reloads (clock skew margin)

_c = inventory_changes.c
_INSERT = sa.insert(inventory_changes)
_PG_HORIZON = sa.text("SELECT CAST(CAST(pg_snapshot_xmin(pg_current_snapshot()) AS text) AS bigint)")
_COLUMNS = (_c.writer, _c.written_at, _c.events, _c.samples, _c.reserved)
_PG_READ = (
    sa.select(*_COLUMNS)
    .where(_c.txid >= sa.bindparam("cursor"), _c.txid < sa.bindparam("horizon"), _c.writer != sa.bindparam("me"))
    .order_by(_c.txid, _c.seq)
)
_SQLITE_READ = (
    sa.select(*_COLUMNS)
    .where(_c.seq > sa.bindparam("cursor"), _c.seq <= sa.bindparam("horizon"), _c.writer != sa.bindparam("me"))
    .order_by(_c.seq)
)
_OLD = (
    sa.select(_c.seq).where(_c.written_at < sa.bindparam("before"))
    .with_for_update(skip_locked=True).scalar_subquery()
)
_PRUNE = sa.delete(inventory_changes).where(_c.seq.in_(_OLD))


@dataclass(frozen=True)
class Change:
    """What one write transaction did to the devices."""

    writer: str  # SqlStore.writer of the store that wrote it
    written_at: float  # the writer's clock
    events: tuple[DeviceChange, ...] = ()  # added / updated / lost / recovered / removed
    samples: tuple[DeviceSample, ...] = ()  # the status samples it stored
    reserved: tuple[str, ...] = ()  # devices whose reservations it made, renewed or released

    def __bool__(self) -> bool:
        return bool(self.events or self.samples or self.reserved)


def write_change(conn: Connection, change: Change) -> None:
    """Add ``change`` to the feed, inside the transaction that made it; nothing for an empty one."""
    if change:
        conn.execute(_INSERT, {
            "writer": change.writer, "written_at": change.written_at,
            "events": json.dumps([[e.kind, e.device_id] for e in change.events]),
            "samples": json.dumps([_sample_row(s) for s in change.samples]),
            "reserved": json.dumps(list(change.reserved)),
        })


def horizon(conn: Connection) -> int:
    """The cursor that reads everything committed from now on (and perhaps a little before)."""
    if conn.dialect.name == "postgresql":
        return conn.execute(_PG_HORIZON).scalar_one()
    return conn.execute(sa.select(sa.func.coalesce(sa.func.max(_c.seq), 0))).scalar_one()


def read_changes(conn: Connection, cursor: int, me: str) -> tuple[list[Change], int]:
    """The changes of writers other than ``me`` past ``cursor``, in order; and the next cursor.
    On SQLite ``conn`` must hold one read transaction across both statements (the store's reads do)."""
    upto = horizon(conn)
    statement = _PG_READ if conn.dialect.name == "postgresql" else _SQLITE_READ
    rows = conn.execute(statement, {"cursor": cursor, "horizon": upto, "me": me}).all()
    return [_change(row) for row in rows], max(cursor, upto)


def prune_changes(conn: Connection, before: float) -> int:
    """Drop change rows written before ``before``. Rows another replica is pruning at this moment
    are skipped (SKIP LOCKED), so two replicas pruning never wait on each other."""
    return conn.execute(_PRUNE, {"before": before}).rowcount


def _sample_row(s: DeviceSample) -> list:
    return [s.device_id, s.timestamp, s.memory_total_bytes, s.memory_used_bytes, s.utilization,
            s.temperature_c, s.power_w]


def _change(row: Sequence) -> Change:
    writer, written_at, events, samples, reserved = row
    return Change(
        writer, written_at,
        tuple(DeviceChange(kind, device_id) for kind, device_id in json.loads(events)),
        tuple(DeviceSample(*values) for values in json.loads(samples)),
        tuple(json.loads(reserved)),
    )
