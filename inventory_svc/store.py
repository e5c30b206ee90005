"""The inventory database: nodes, their devices, status samples and reservations (MISSION A1, A2, B1, B5).

``Store`` is the narrow interface the servicer, poller and planner use; ``SqliteStore`` is the
one implementation today, applying within its transactions the rules of ``reservations.py`` (what
a job may claim) and ``polls.py`` (what a node's report writes). Everything crossing the interface
is a plain dataclass, and every method that depends on the clock takes ``now`` so callers (and
tests) decide what time it is.
"""

from __future__ import annotations

import math
import sqlite3
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Protocol

from accelmesh.errors import FailedPrecondition, InvalidArgument, NotFound
from accelmesh.hardware.model import DeviceSample, NodeDescription
from inventory_svc.filtering import DeviceFilter
from inventory_svc.migrations import apply_migrations
from inventory_svc.polls import node_record, prune_samples, upsert_device
from inventory_svc.records import DeviceChange, DeviceRecord, NodeRecord, Reservation
from inventory_svc.reservations import RESERVATION_COLUMNS, check_claims, check_ttl, renew_leases, reserve_one
from inventory_svc.rows import DEVICE_SELECT, NODE_SELECT, SAMPLE_COLUMNS, device_record, pushdown, sample

MAX_SAMPLES_PER_DEVICE = 720  # one hour at a 5 s poll interval
SAMPLE_RETENTION_S = 3600.0
DEFAULT_PAGE_SIZE = 100
MAX_PAGE_SIZE = 1000


class Store(Protocol):
    def upsert_node(self, address: str, ip: str, hostname: str, now: float) -> NodeRecord: ...
    def get_node(self, address: str) -> NodeRecord: ...
    def list_nodes(self) -> list[NodeRecord]: ...
    def record_poll_success(self, address: str, description: NodeDescription, now: float) -> list[DeviceChange]: ...
    def record_poll_failure(self, address: str, error: str, now: float, lost_after: int) -> list[str]: ...
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
    def renew(
        self, job_id: str, device_ids: Sequence[str] | None, ttl_s: float, now: float
    ) -> list[Reservation]: ...
    def release(self, job_id: str, device_ids: Sequence[str] | None = None) -> int: ...
    def reservations(
        self, device_id: str | None = None, job_id: str | None = None, now: float | None = None
    ) -> list[Reservation]: ...
    def expire_reservations(self, now: float) -> int: ...
    def close(self) -> None: ...


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
                "INSERT INTO nodes (address, ip, hostname, registered_at) VALUES (?, ?, ?, ?) "
                "ON CONFLICT(address) DO UPDATE SET ip = excluded.ip, hostname = excluded.hostname",
                (address, ip, hostname, now),
            )
            return node_record(conn, address)

    def get_node(self, address: str) -> NodeRecord:
        with self._lock:
            return node_record(self._conn, address)

    def list_nodes(self) -> list[NodeRecord]:
        with self._lock:
            return [NodeRecord(*row) for row in self._conn.execute(NODE_SELECT + " ORDER BY address")]

    def record_poll_success(self, address: str, description: NodeDescription, now: float) -> list[DeviceChange]:
        """Store what a node reported; return what changed. Devices it no longer reports become lost."""
        changes: list[DeviceChange] = []
        with self._tx() as conn:
            node_record(conn, address)
            conn.execute(
                "UPDATE nodes SET ip = ?, hostname = ?, state = 'active', last_seen_at = ?, missed_polls = 0, "
                "last_error = '' WHERE address = ?",
                (description.ip, description.hostname, now, address),
            )
            reported = {spec.id for spec in description.devices}
            for spec in description.devices:
                changes.extend(upsert_device(conn, address, spec, now))
            for (gone,) in conn.execute(
                "SELECT id FROM devices WHERE node_address = ? AND health = 'healthy' ORDER BY id", (address,)
            ).fetchall():
                if gone not in reported:
                    conn.execute("UPDATE devices SET health = 'lost', updated_at = ? WHERE id = ?", (now, gone))
                    changes.append(DeviceChange("lost", gone))
            sampled = set()
            for sample in description.samples:
                if sample.device_id in reported:  # a sample for an unreported device has no row to belong to
                    conn.execute(
                        f"INSERT OR REPLACE INTO status_samples (device_id, {SAMPLE_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?)",
                        (sample.device_id, sample.timestamp, sample.memory_total_bytes, sample.memory_used_bytes,
                         sample.utilization, sample.temperature_c, sample.power_w),
                    )
                    sampled.add(sample.device_id)
            for device in sampled:
                prune_samples(conn, device, cutoff=now - self._retention_s, keep=self._max_samples)
        return changes

    def record_poll_failure(self, address: str, error: str, now: float, lost_after: int) -> list[str]:
        """Count a missed poll; after ``lost_after`` in a row the node and its devices are lost."""
        if lost_after < 1:
            raise InvalidArgument(f"lost_after must be >= 1, got {lost_after}")
        with self._tx() as conn:
            node_record(conn, address)
            conn.execute(
                "UPDATE nodes SET missed_polls = missed_polls + 1, last_error = ? WHERE address = ?", (error, address)
            )
            (missed,) = conn.execute("SELECT missed_polls FROM nodes WHERE address = ?", (address,)).fetchone()
            if missed < lost_after:
                return []
            conn.execute("UPDATE nodes SET state = 'lost' WHERE address = ?", (address,))
            lost = [row[0] for row in conn.execute(
                "SELECT id FROM devices WHERE node_address = ? AND health = 'healthy' ORDER BY id", (address,)
            )]
            conn.execute(
                "UPDATE devices SET health = 'lost', updated_at = ? WHERE node_address = ? AND health = 'healthy'",
                (now, address),
            )
            return lost

    # -- devices and samples ---------------------------------------------------------------

    def get_device(self, device_id: str, now: float | None = None) -> DeviceRecord:
        with self._lock:
            row = self._conn.execute(
                DEVICE_SELECT + " WHERE d.id = :id", {"id": device_id, "now": _now(now)}
            ).fetchone()
        if row is None:
            raise NotFound(f"device {device_id!r} is not in the inventory; list devices with ListDevices")
        return device_record(row)

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
        clauses, params = pushdown(flt)
        batch = page_size + 1  # one extra row tells whether another page follows
        sql = DEVICE_SELECT + " WHERE " + " AND ".join([*clauses, "d.id > :after"]) + " ORDER BY d.id LIMIT :limit"
        params.update(now=_now(now), limit=batch)
        found: list[DeviceRecord] = []
        cursor = after_id or ""
        with self._tx(write=False) as conn:  # one snapshot across batches
            while len(found) <= page_size:
                rows = conn.execute(sql, {**params, "after": cursor}).fetchall()
                for row in rows:
                    # SQL narrows the rows; matches() stays the one definition of the filter.
                    record = device_record(row)
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
                f"SELECT {SAMPLE_COLUMNS} FROM status_samples WHERE device_id = ? ORDER BY ts DESC LIMIT 1",
                (device_id,),
            ).fetchone()
        return sample(device_id, row) if row else None

    def samples(self, device_id: str, since: float | None = None) -> list[DeviceSample]:
        """Samples of ``device_id`` newer than ``since``, oldest first."""
        with self._lock:
            rows = self._conn.execute(
                f"SELECT {SAMPLE_COLUMNS} FROM status_samples WHERE device_id = ? AND ts > ? ORDER BY ts",
                (device_id, -math.inf if since is None else since),
            ).fetchall()
        return [sample(device_id, row) for row in rows]

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
        check_claims(job_id, claims, ttl_s)
        with self._tx() as conn:
            return [reserve_one(conn, job_id, *claim, ttl_s, now) for claim in claims]

    def renew(
        self, job_id: str, device_ids: Sequence[str] | None, ttl_s: float, now: float
    ) -> list[Reservation]:
        """Extend the job's live leases (on ``device_ids``, or all) to ``now + ttl_s``; all or none."""
        if not job_id:
            raise InvalidArgument("job_id must not be empty; pass the id of the job whose reservations to renew")
        check_ttl(ttl_s)
        with self._tx() as conn:
            return renew_leases(conn, job_id, device_ids, ttl_s, now)

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
                f"SELECT {RESERVATION_COLUMNS} FROM reservations WHERE {' AND '.join(clauses)} "
                "ORDER BY job_id, device_id",
                params,
            ).fetchall()
        return [Reservation(*row) for row in rows]

    def expire_reservations(self, now: float) -> int:
        with self._tx() as conn:
            return conn.execute("DELETE FROM reservations WHERE expires_at <= ?", (now,)).rowcount


def _now(now: float | None) -> float:
    return time.time() if now is None else now
