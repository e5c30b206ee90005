"""The inventory database: nodes, their devices, status samples and reservations (MISSION A1, A2, B1, B5).

``Store`` is the narrow interface the servicer, poller and planner use; ``SqliteStore`` is the
one implementation today. Everything crossing the interface is a plain dataclass, and every
method that depends on the clock takes ``now`` so callers (and tests) decide what time it is.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import sqlite3
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Protocol

from accelmesh.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from accelmesh.hardware.model import DeviceSample, DeviceSpec, NodeDescription, Performance, free_memory_bytes
from inventory_svc.filtering import DeviceFilter
from inventory_svc.records import DeviceChange, DeviceRecord, NodeRecord, Reservation
from inventory_svc.migrations import apply_migrations

MAX_SAMPLES_PER_DEVICE = 720  # one hour at a 5 s poll interval
SAMPLE_RETENTION_S = 3600.0
DEFAULT_PAGE_SIZE = 100
MAX_PAGE_SIZE = 1000


class Store(Protocol):
    def upsert_node(self, address: str, ip: str, hostname: str, now: float) -> NodeRecord: ...
    def get_node(self, node_id: str) -> NodeRecord: ...
    def list_nodes(self) -> list[NodeRecord]: ...
    def record_poll_success(self, node_id: str, description: NodeDescription, now: float) -> list[DeviceChange]: ...
    def record_poll_failure(self, node_id: str, error: str, now: float, lost_after: int) -> list[str]: ...
    def get_device(self, device_id: str, now: float | None = None) -> DeviceRecord: ...
    def list_devices(
        self, filter: DeviceFilter | None = None, page_size: int = DEFAULT_PAGE_SIZE, after_id: str = "",
        now: float | None = None,
    ) -> tuple[list[DeviceRecord], str]: ...
    def latest_sample(self, device_id: str) -> DeviceSample | None: ...
    def samples(self, device_id: str, since: float | None = None) -> list[DeviceSample]: ...
    def reserve(
        self, job_id: str, device_id: str, memory_bytes: int, compute_fraction: float, ttl_s: float, now: float
    ) -> Reservation: ...
    def reserve_many(
        self, job_id: str, claims: Sequence[tuple[str, int, float]], ttl_s: float, now: float
    ) -> list[Reservation]: ...
    def release(self, job_id: str, device_ids: Sequence[str] | None = None) -> int: ...
    def reservations(
        self, device_id: str | None = None, job_id: str | None = None, now: float | None = None
    ) -> list[Reservation]: ...
    def expire_reservations(self, now: float) -> int: ...
    def close(self) -> None: ...


_SPEC_COLUMNS = (
    "node_ip", "local_index", "platform", "kind", "type", "compute_capability",
    "capabilities", "performance", "emulated", "execution_device",
)
_SAMPLE_COLUMNS = "ts, memory_total, memory_used, utilization, temperature_c, power_w"
_RESERVED_SQL = (
    "(SELECT COALESCE(SUM({column}), {zero}) FROM reservations r WHERE r.device_id = d.id AND r.expires_at > :now)"
)
# Mirrors accelmesh.hardware.model.free_memory_bytes so free-memory filters run in SQL rather than
# decoding every row in Python (a filter matching nothing would otherwise scan 10,000 rows).
_FREE_MEMORY_SQL = (
    "MAX(0, COALESCE(s.memory_total, json_extract(d.performance, '$.memory_bytes')) - COALESCE(s.memory_used, 0) - "
    + _RESERVED_SQL.format(column="memory_bytes", zero=0)
    + ")"
)
# One row per device with its latest sample and live reservation sums: every lookup is an
# index seek, which keeps a 100-row page over 10,000 devices at a few milliseconds.
_DEVICE_SELECT = f"""
SELECT d.id, {', '.join('d.' + c for c in _SPEC_COLUMNS)}, d.node_id, d.health, d.first_seen_at, d.updated_at,
       {', '.join('s.' + c.strip() for c in _SAMPLE_COLUMNS.split(','))},
       {_RESERVED_SQL.format(column="memory_bytes", zero=0)},
       {_RESERVED_SQL.format(column="compute_fraction", zero=0.0)}
FROM devices d
LEFT JOIN status_samples s ON s.device_id = d.id AND s.ts = (SELECT MAX(ts) FROM status_samples WHERE device_id = d.id)
"""
_PUSHDOWN_COLUMNS = {
    "platform": "d.platform", "type": "d.type", "kind": "d.kind", "node": "d.node_id",
    "health": "d.health", "emulated": "d.emulated", "free_memory_bytes": _FREE_MEMORY_SQL,
}
_SQL_OPERATORS = frozenset({"=", "!=", "<", "<=", ">", ">="})


class SqliteStore:
    """A SQLite file in WAL mode behind one connection and a lock (readers are cheap; writes are small)."""

    def __init__(
        self,
        path: str | Path,
        max_samples_per_device: int = MAX_SAMPLES_PER_DEVICE,
        retention_s: float = SAMPLE_RETENTION_S,
    ) -> None:
        self._path = str(path)
        self._max_samples = max(1, int(max_samples_per_device))
        self._retention_s = float(retention_s)
        self._lock = threading.RLock()
        if self._path != ":memory:":
            Path(self._path).parent.mkdir(parents=True, exist_ok=True)  # the default lives in .accelmesh/
        self._conn = sqlite3.connect(self._path, isolation_level=None, check_same_thread=False)
        try:
            self._conn.execute("PRAGMA journal_mode=WAL")
            self._conn.execute("PRAGMA synchronous=NORMAL")  # with WAL: survives process crashes, cheap commits
            self._conn.execute("PRAGMA foreign_keys=ON")
            self._conn.execute("PRAGMA busy_timeout=5000")
            self.schema_version = apply_migrations(self._conn, repr(self._path))
        except sqlite3.DatabaseError as exc:
            self._conn.close()
            raise FailedPrecondition(
                f"database {self._path!r} cannot be opened ({exc}); point the inventory at a SQLite file it may write"
            ) from exc
        except BaseException:
            self._conn.close()
            raise

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    @contextmanager
    def _tx(self, write: bool = True) -> Iterator[sqlite3.Connection]:
        with self._lock:
            self._conn.execute("BEGIN IMMEDIATE" if write else "BEGIN")
            try:
                yield self._conn
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise
            self._conn.execute("COMMIT")

    # -- nodes -----------------------------------------------------------------------------

    def upsert_node(self, address: str, ip: str, hostname: str, now: float) -> NodeRecord:
        if not address:
            raise InvalidArgument("address must not be empty; pass the worker's host:port")
        with self._tx() as conn:
            conn.execute(
                "INSERT INTO nodes (node_id, address, ip, hostname, registered_at) VALUES (?, ?, ?, ?, ?) "
                "ON CONFLICT(node_id) DO UPDATE SET ip = excluded.ip, hostname = excluded.hostname",
                (address, address, ip, hostname, now),
            )
            return self._node(conn, address)

    def get_node(self, node_id: str) -> NodeRecord:
        with self._lock:
            return self._node(self._conn, node_id)

    def list_nodes(self) -> list[NodeRecord]:
        with self._lock:
            return [NodeRecord(*row) for row in self._conn.execute(_NODE_SELECT + " ORDER BY node_id")]

    def record_poll_success(self, node_id: str, description: NodeDescription, now: float) -> list[DeviceChange]:
        """Store what a node reported; return what changed. Devices it no longer reports become lost."""
        changes: list[DeviceChange] = []
        with self._tx() as conn:
            self._node(conn, node_id)
            conn.execute(
                "UPDATE nodes SET ip = ?, hostname = ?, state = 'active', last_seen_at = ?, missed_polls = 0, "
                "last_error = '' WHERE node_id = ?",
                (description.ip, description.hostname, now, node_id),
            )
            reported = {spec.id for spec in description.devices}
            for spec in description.devices:
                changes.extend(self._upsert_device(conn, node_id, spec, now))
            for (gone,) in conn.execute(
                "SELECT id FROM devices WHERE node_id = ? AND health = 'healthy' ORDER BY id", (node_id,)
            ).fetchall():
                if gone not in reported:
                    conn.execute("UPDATE devices SET health = 'lost', updated_at = ? WHERE id = ?", (now, gone))
                    changes.append(DeviceChange("lost", gone))
            sampled = set()
            for sample in description.samples:
                if sample.device_id in reported:  # a sample for an unreported device has no row to belong to
                    conn.execute(
                        f"INSERT OR REPLACE INTO status_samples (device_id, {_SAMPLE_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?)",
                        (sample.device_id, sample.timestamp, sample.memory_total_bytes, sample.memory_used_bytes,
                         sample.utilization, sample.temperature_c, sample.power_w),
                    )
                    sampled.add(sample.device_id)
            for device in sampled:
                self._prune_samples(conn, device, now)
        return changes

    def record_poll_failure(self, node_id: str, error: str, now: float, lost_after: int) -> list[str]:
        """Count a missed poll; after ``lost_after`` in a row the node and its devices are lost."""
        if lost_after < 1:
            raise InvalidArgument(f"lost_after must be >= 1, got {lost_after}")
        with self._tx() as conn:
            self._node(conn, node_id)
            conn.execute(
                "UPDATE nodes SET missed_polls = missed_polls + 1, last_error = ? WHERE node_id = ?", (error, node_id)
            )
            (missed,) = conn.execute("SELECT missed_polls FROM nodes WHERE node_id = ?", (node_id,)).fetchone()
            if missed < lost_after:
                return []
            conn.execute("UPDATE nodes SET state = 'lost' WHERE node_id = ?", (node_id,))
            lost = [row[0] for row in conn.execute(
                "SELECT id FROM devices WHERE node_id = ? AND health = 'healthy' ORDER BY id", (node_id,)
            )]
            conn.execute(
                "UPDATE devices SET health = 'lost', updated_at = ? WHERE node_id = ? AND health = 'healthy'",
                (now, node_id),
            )
            return lost

    # -- devices and samples ---------------------------------------------------------------

    def get_device(self, device_id: str, now: float | None = None) -> DeviceRecord:
        with self._lock:
            row = self._conn.execute(
                _DEVICE_SELECT + " WHERE d.id = :id", {"id": device_id, "now": _now(now)}
            ).fetchone()
        if row is None:
            raise NotFound(f"device {device_id!r} is not in the inventory; list devices with ListDevices")
        return _device_record(row)

    def list_devices(
        self,
        filter: DeviceFilter | None = None,
        page_size: int = DEFAULT_PAGE_SIZE,
        after_id: str = "",
        now: float | None = None,
    ) -> tuple[list[DeviceRecord], str]:
        """One page ordered by id, starting after ``after_id``; the second value is the next ``after_id`` or ""."""
        if page_size < 0:
            raise InvalidArgument(f"page_size must be >= 0 (0 means {DEFAULT_PAGE_SIZE}), got {page_size}")
        page_size = min(page_size or DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE)
        flt = filter or DeviceFilter()
        clauses, params = _pushdown(flt)
        batch = page_size + 1  # one extra row tells whether another page follows
        sql = _DEVICE_SELECT + " WHERE " + " AND ".join([*clauses, "d.id > :after"]) + " ORDER BY d.id LIMIT :limit"
        params.update(now=_now(now), limit=batch)
        found: list[DeviceRecord] = []
        cursor = after_id or ""
        with self._tx(write=False) as conn:  # one snapshot across batches
            while len(found) <= page_size:
                rows = conn.execute(sql, {**params, "after": cursor}).fetchall()
                for row in rows:
                    # SQL narrows the rows; matches() stays the one definition of the filter.
                    record = _device_record(row)
                    if flt.matches(record):
                        found.append(record)
                        if len(found) > page_size:
                            break
                if len(rows) < batch:
                    break
                cursor = rows[-1][0]
        if len(found) > page_size:
            return found[:page_size], found[page_size - 1].id
        return found, ""

    def latest_sample(self, device_id: str) -> DeviceSample | None:
        with self._lock:
            row = self._conn.execute(
                f"SELECT {_SAMPLE_COLUMNS} FROM status_samples WHERE device_id = ? ORDER BY ts DESC LIMIT 1",
                (device_id,),
            ).fetchone()
        return _sample(device_id, row) if row else None

    def samples(self, device_id: str, since: float | None = None) -> list[DeviceSample]:
        """Samples of ``device_id`` newer than ``since``, oldest first."""
        with self._lock:
            rows = self._conn.execute(
                f"SELECT {_SAMPLE_COLUMNS} FROM status_samples WHERE device_id = ? AND ts > ? ORDER BY ts",
                (device_id, -math.inf if since is None else since),
            ).fetchall()
        return [_sample(device_id, row) for row in rows]

    # -- reservations ----------------------------------------------------------------------

    def reserve(
        self, job_id: str, device_id: str, memory_bytes: int, compute_fraction: float, ttl_s: float, now: float
    ) -> Reservation:
        """Reserve (or re-reserve: amounts replaced, lease extended) memory and compute for a job."""
        return self.reserve_many(job_id, [(device_id, memory_bytes, compute_fraction)], ttl_s, now)[0]

    def reserve_many(
        self, job_id: str, claims: Sequence[tuple[str, int, float]], ttl_s: float, now: float
    ) -> list[Reservation]:
        """``reserve`` for several (device_id, memory_bytes, compute_fraction) claims: all or none."""
        for _, memory_bytes, compute_fraction in claims:
            _check_reservation(job_id, memory_bytes, compute_fraction, ttl_s)
        devices = [claim[0] for claim in claims]
        repeated = sorted({d for d in devices if devices.count(d) > 1})
        if repeated:
            raise InvalidArgument(f"claims name device {repeated[0]!r} more than once; combine them into one claim")
        with self._tx() as conn:
            return [self._reserve_one(conn, job_id, *claim, ttl_s, now) for claim in claims]

    def release(self, job_id: str, device_ids: Sequence[str] | None = None) -> int:
        with self._tx() as conn:
            if device_ids is None:
                return conn.execute("DELETE FROM reservations WHERE job_id = ?", (job_id,)).rowcount
            return sum(
                conn.execute(
                    "DELETE FROM reservations WHERE job_id = ? AND device_id = ?", (job_id, device)
                ).rowcount
                for device in set(device_ids)
            )

    def reservations(
        self, device_id: str | None = None, job_id: str | None = None, now: float | None = None
    ) -> list[Reservation]:
        """Reservations matching the given keys; with ``now``, only leases still live at that time."""
        clauses, params = ["1"], []
        for clause, value in (("device_id = ?", device_id), ("job_id = ?", job_id), ("expires_at > ?", now)):
            if value is not None:
                clauses.append(clause)
                params.append(value)
        with self._lock:
            rows = self._conn.execute(
                f"SELECT {_RESERVATION_COLUMNS} FROM reservations WHERE {' AND '.join(clauses)} "
                "ORDER BY job_id, device_id",
                params,
            ).fetchall()
        return [Reservation(*row) for row in rows]

    def expire_reservations(self, now: float) -> int:
        with self._tx() as conn:
            return conn.execute("DELETE FROM reservations WHERE expires_at <= ?", (now,)).rowcount

    # -- helpers ---------------------------------------------------------------------------

    def _node(self, conn: sqlite3.Connection, node_id: str) -> NodeRecord:
        row = conn.execute(_NODE_SELECT + " WHERE node_id = ?", (node_id,)).fetchone()
        if row is None:
            raise NotFound(f"node {node_id!r} is not registered; register the node before reporting on it")
        return NodeRecord(*row)

    def _upsert_device(
        self, conn: sqlite3.Connection, node_id: str, spec: DeviceSpec, now: float
    ) -> list[DeviceChange]:
        values = _spec_values(spec)
        row = conn.execute(
            f"SELECT {', '.join(_SPEC_COLUMNS)}, node_id, health FROM devices WHERE id = ?", (spec.id,)
        ).fetchone()
        assignments = ", ".join(f"{column} = ?" for column in _SPEC_COLUMNS)
        if row is None:
            conn.execute(
                f"INSERT INTO devices (id, node_id, {', '.join(_SPEC_COLUMNS)}, first_seen_at, updated_at) "
                f"VALUES (?, ?, {', '.join('?' * len(_SPEC_COLUMNS))}, ?, ?)",
                (spec.id, node_id, *values, now, now),
            )
            return [DeviceChange("added", spec.id)]
        owner = row[-2]
        if owner != node_id and self._node(conn, owner).state == "active":
            # Two live workers claiming one id would flip the row between them on every poll.
            raise FailedPrecondition(
                f"device {spec.id} is already reported by node {owner}; run one worker per node IP, "
                f"or give this worker its own IP with --advertise-ip"
            )
        changes = []
        if tuple(row[: len(_SPEC_COLUMNS)]) != values or owner != node_id:
            conn.execute(
                f"UPDATE devices SET {assignments}, node_id = ?, updated_at = ? WHERE id = ?",
                (*values, node_id, now, spec.id),
            )
            changes.append(DeviceChange("updated", spec.id))
        if row[-1] != "healthy":
            conn.execute("UPDATE devices SET health = 'healthy', updated_at = ? WHERE id = ?", (now, spec.id))
            changes.append(DeviceChange("recovered", spec.id))
        return changes

    def _reserve_one(
        self, conn: sqlite3.Connection, job_id: str, device_id: str, memory_bytes: int, compute_fraction: float,
        ttl_s: float, now: float,
    ) -> Reservation:
        row = conn.execute(_DEVICE_SELECT + " WHERE d.id = :id", {"id": device_id, "now": now}).fetchone()
        if row is None:
            raise NotFound(f"device {device_id!r} is not in the inventory; list devices with ListDevices")
        record = _device_record(row)
        if record.health != "healthy":
            raise FailedPrecondition(f"device {device_id!r} is lost; reserve a healthy device instead")
        # The job's own earlier claim is being replaced, so only other jobs' claims count.
        (others,) = conn.execute(
            "SELECT COALESCE(SUM(memory_bytes), 0) FROM reservations "
            "WHERE device_id = ? AND job_id != ? AND expires_at > ?",
            (device_id, job_id, now),
        ).fetchone()
        free = free_memory_bytes(record.memory_total_bytes, record.memory_used_bytes, others)
        if memory_bytes > free:
            raise ResourceExhausted(
                f"memory_bytes: requested {memory_bytes} bytes on device {device_id!r} but only {free} bytes "
                f"are free after other jobs' reservations; request less or choose another device"
            )
        # A row whose lease already lapsed is a new reservation, so it gets a new created_at.
        conn.execute(
            "INSERT INTO reservations (job_id, device_id, memory_bytes, compute_fraction, created_at, expires_at) "
            "VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT(job_id, device_id) DO UPDATE SET "
            "memory_bytes = excluded.memory_bytes, compute_fraction = excluded.compute_fraction, "
            "created_at = CASE WHEN reservations.expires_at <= excluded.created_at "
            "THEN excluded.created_at ELSE reservations.created_at END, expires_at = excluded.expires_at",
            (job_id, device_id, int(memory_bytes), float(compute_fraction), now, now + ttl_s),
        )
        row = conn.execute(
            f"SELECT {_RESERVATION_COLUMNS} FROM reservations WHERE job_id = ? AND device_id = ?", (job_id, device_id)
        ).fetchone()
        return Reservation(*row)

    def _prune_samples(self, conn: sqlite3.Connection, device_id: str, now: float) -> None:
        # Seeks on the (device_id, ts) key only: the age cut-off, and the ts of the Nth newest
        # sample (NULL while a device has fewer than N, which deletes nothing). The newest
        # sample always stays: it is the device's current status, even from a skewed clock.
        conn.execute(
            "DELETE FROM status_samples WHERE device_id = :d "
            "AND ts < (SELECT MAX(ts) FROM status_samples WHERE device_id = :d) AND (ts < :cutoff OR ts < ("
            "SELECT ts FROM status_samples WHERE device_id = :d ORDER BY ts DESC LIMIT 1 OFFSET :keep))",
            {"d": device_id, "cutoff": now - self._retention_s, "keep": self._max_samples - 1},
        )


_RESERVATION_COLUMNS = "job_id, device_id, memory_bytes, compute_fraction, created_at, expires_at"
_NODE_SELECT = (
    "SELECT node_id, address, ip, hostname, state, registered_at, last_seen_at, missed_polls, last_error FROM nodes"
)


def _now(now: float | None) -> float:
    return time.time() if now is None else now


def _check_reservation(job_id: str, memory_bytes: int, compute_fraction: float, ttl_s: float) -> None:
    if not job_id:
        raise InvalidArgument("job_id must not be empty; pass the id of the job that holds the reservation")
    if isinstance(memory_bytes, bool) or not isinstance(memory_bytes, int) or memory_bytes < 0:
        raise InvalidArgument(f"memory_bytes must be a whole number >= 0, got {memory_bytes!r}")
    if not (isinstance(compute_fraction, (int, float)) and 0.0 <= compute_fraction <= 1.0):
        raise InvalidArgument(f"compute_fraction must be between 0 and 1, got {compute_fraction!r}")
    if not (isinstance(ttl_s, (int, float)) and math.isfinite(ttl_s) and ttl_s > 0):
        raise InvalidArgument(f"ttl_s must be a finite number of seconds > 0, got {ttl_s!r}")


def _pushdown(flt: DeviceFilter) -> tuple[list[str], dict[str, object]]:
    clauses: list[str] = [] if flt.include_lost else ["d.health = 'healthy'"]
    params: dict[str, object] = {}
    for i, term in enumerate(flt.terms):
        key = f"p{i}"
        if term.op == ":":
            clauses.append(f"EXISTS (SELECT 1 FROM json_each(d.capabilities) WHERE value = :{key})")
        elif term.field in _PUSHDOWN_COLUMNS and term.op in _SQL_OPERATORS:
            clauses.append(f"{_PUSHDOWN_COLUMNS[term.field]} {term.op} :{key}")
        else:  # a hand-built term the SQL does not know: matches() still applies it
            continue
        params[key] = int(term.value) if isinstance(term.value, bool) else term.value
    return clauses, params


def _spec_values(spec: DeviceSpec) -> tuple:
    """Column values of ``spec`` in _SPEC_COLUMNS order; JSON is canonical so equal specs compare equal."""
    return (
        spec.node_ip, spec.local_index, spec.platform, spec.kind, spec.type, spec.compute_capability,
        json.dumps(sorted(spec.capabilities)),
        json.dumps(_performance_dict(spec.performance), sort_keys=True),
        int(spec.emulated), spec.execution_device,
    )


def _performance_dict(perf: Performance) -> dict:
    # Coerced so 312 and 312.0 from two polls do not read as a changed spec.
    return {
        **dataclasses.asdict(perf),
        "peak_tflops": {name: float(rate) for name, rate in perf.peak_tflops.items()},
        "memory_bytes": int(perf.memory_bytes),
        "memory_bandwidth_gbps": float(perf.memory_bandwidth_gbps),
        "interconnect_bandwidth_gbps": float(perf.interconnect_bandwidth_gbps),
    }


def _sample(device_id: str, row: Sequence) -> DeviceSample:
    ts, total, used, utilization, temperature, power = row
    return DeviceSample(device_id, ts, total, used, utilization, temperature, power)


# Devices of one type store the same JSON text, so a large inventory decodes a handful of
# distinct values; both results are immutable and safe to share.
@functools.lru_cache(maxsize=4096)
def _capabilities(text: str) -> frozenset[str]:
    return frozenset(json.loads(text))


@functools.lru_cache(maxsize=4096)
def _performance(text: str) -> Performance:
    return Performance(**json.loads(text))


def _device_record(row: Sequence) -> DeviceRecord:
    n = len(_SPEC_COLUMNS)
    device_id = row[0]
    node_ip, local_index, platform, kind, type_, cc, caps, perf, emulated, execution = row[1 : n + 1]
    node_id, health, first_seen, updated = row[n + 1 : n + 5]
    sample_row, reserved_memory, reserved_compute = row[n + 5 : n + 11], row[n + 11], row[n + 12]
    spec = DeviceSpec(
        id=device_id, node_ip=node_ip, local_index=local_index, platform=platform, kind=kind, type=type_,
        capabilities=_capabilities(caps), compute_capability=cc,
        performance=_performance(perf), emulated=bool(emulated), execution_device=execution,
    )
    latest = _sample(device_id, sample_row) if sample_row[0] is not None else None
    return DeviceRecord(spec, node_id, health, latest, reserved_memory, reserved_compute, first_seen, updated)
