"""The inventory database: nodes, their devices, status samples and reservations (requirements A1, A2, B1, B5).

``Store`` (``store_port.py``) is the narrow interface the servicer, poller and planner use;
``SqlStore`` is its one implementation, on SQLite (a file, the embedded default) or PostgreSQL
(shared by replicas), applying within its transactions the rules of ``reservations.py`` (what a job may claim),
``polls.py`` (what a node's report writes, and which replica polls which node), ``removal.py``
(what removing a node deletes, and when it is refused) and ``paging.py`` (a page of devices); a
database is brought to this build's schema at open (``schema``, Alembic). Every write that
changes a device also adds its ``Change`` to the feed (``changes.py``) in the same transaction,
and hands it to the store's listeners once committed (this replica's device index); the other
replicas read it from the feed. Everything crossing the interface is a plain dataclass, and
every method that depends on the clock takes ``now`` so callers (and tests) decide what time it
is. The engine plumbing (pool, timeouts, retries of serialisation failures, a lost database
answering UNAVAILABLE) is ``accelmesh.runtime.database``'s.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from accelmesh.errors import InvalidArgument, NotFound
from accelmesh.hardware.model import DeviceSample, NodeDescription
from accelmesh.runtime.database import connected, is_postgres, open_engine, transaction, upsert
from inventory_svc import schema
from inventory_svc.changes import Change, horizon, prune_changes, read_changes, write_change
from inventory_svc.filtering import DeviceFilter
from inventory_svc.paging import DEFAULT_PAGE_SIZE, device_page
from inventory_svc.polls import claim_nodes, heartbeat, node_record, record_miss, record_report, release_nodes
from inventory_svc.records import DeviceChange, DeviceRecord, NodeRecord, RemovedNode, Reservation
from inventory_svc.removal import lost_since, remove_node
from inventory_svc.reservations import check_claims, check_ttl, lock_devices, renew_leases, reserve_one
from inventory_svc.rows import (
    DEVICE_BY_ID,
    DEVICES_BY_IDS,
    NODE_SELECT,
    RESERVATION_COLUMNS,
    SAMPLE_COLUMNS,
    device_record,
    sample,
)
from inventory_svc.store_port import Listener
from inventory_svc.suspects import mark_suspect, trust_node
from inventory_svc.tables import nodes, reservations, status_samples

MAX_SAMPLES_PER_DEVICE = 720  # one hour at a 5 s poll interval
SAMPLE_RETENTION_S = 3600.0
T = TypeVar("T")

log = logging.getLogger(__name__)

_SAMPLES = sa.select(*(status_samples.c[c] for c in SAMPLE_COLUMNS))


def _node_update(new: sa.ColumnCollection) -> dict:
    return {"ip": new.ip, "hostname": new.hostname}  # a re-registration keeps registered_at and the poll counts


class SqlStore:
    """The inventory on a SQLite file or a PostgreSQL database, named by a path or URL.

    Each write is one transaction (``transaction``: PostgreSQL's serialisation failures are
    retried); reads take a pooled connection. Several stores, in one process or many, may share
    the database: writers serialise on SQLite's file lock, and on PostgreSQL on the rows they claim.
    """

    def __init__(
        self,
        target: str | Path,
        max_samples_per_device: int = MAX_SAMPLES_PER_DEVICE,
        retention_s: float = SAMPLE_RETENTION_S,
    ) -> None:
        self._max_samples = max(1, int(max_samples_per_device))
        self._retention_s = float(retention_s)
        self._engine: Engine = open_engine(target, service="inventory")
        # SQLite: this process's writers queue on a lock rather than on the file's, whose busy
        # handler sleeps in milliseconds (32 poll workers would spend the cycle asleep). Other
        # processes still serialise on the file; PostgreSQL writers need neither.
        self._writing = contextlib.nullcontext() if is_postgres(self._engine) else threading.Lock()
        # This store's name in the change feed: the rows it wrote its listeners heard already.
        self.writer = uuid.uuid4().hex
        self._listeners: list[Listener] = []
        try:
            self.schema_version = schema.migrate(self._engine)
        except BaseException:
            self._engine.dispose()
            raise

    @property
    def engine(self) -> Engine:
        return self._engine

    def close(self) -> None:
        self._engine.dispose()

    def _read(self):
        return connected(self._engine)

    def _write(self, work: Callable[[Connection], T]) -> T:
        with self._writing:
            return transaction(self._engine, work)

    def _write_change(self, work: Callable[[Connection], tuple[T, Change]]) -> T:
        """``work`` returns its result and the Change it wrote to the feed; once committed the
        listeners hear the change, in the writing thread, before the result is returned."""
        result, change = self._write(work)
        if change:
            for listener in list(self._listeners):
                try:
                    listener(change)
                except Exception:  # a listener's bug must not undo a committed write
                    log.exception("a listener of the inventory's changes failed")
        return result

    def add_listener(self, listener: Listener) -> None:
        """Call ``listener(change)`` after each write of this store that changed a device."""
        self._listeners.append(listener)

    # -- nodes -----------------------------------------------------------------------------

    def upsert_node(self, address: str, ip: str, hostname: str, now: float) -> NodeRecord:
        if not address:
            raise InvalidArgument("address must not be empty; pass the worker's host:port")

        def work(conn: Connection) -> NodeRecord:
            conn.execute(
                upsert(conn, nodes, _node_update),
                {"address": address, "ip": ip, "hostname": hostname, "registered_at": now},
            )
            return node_record(conn, address)

        return self._write(work)

    def get_node(self, address: str) -> NodeRecord:
        with self._read() as conn:
            return node_record(conn, address)

    def list_nodes(self) -> list[NodeRecord]:
        with self._read() as conn:
            return [NodeRecord(*row) for row in conn.execute(NODE_SELECT.order_by(nodes.c.address))]

    def record_poll_success(self, address: str, description: NodeDescription, now: float) -> list[DeviceChange]:
        """Store what a node reported; return what changed. Devices it no longer reports become lost."""

        def work(conn: Connection) -> tuple[list[DeviceChange], Change]:
            return record_report(conn, self.writer, address, description, now,
                                 retention_s=self._retention_s, keep=self._max_samples)

        return self._write_change(work)

    def record_poll_failure(self, address: str, error: str, now: float, lost_after: int) -> list[str]:
        """Count a missed poll; after ``lost_after`` in a row the node and its devices are lost."""
        if lost_after < 1:
            raise InvalidArgument(f"lost_after must be >= 1, got {lost_after}")

        return self._write_change(lambda conn: record_miss(conn, self.writer, address, error, now, lost_after))

    def remove_node(self, address: str, now: float, force: bool = False) -> RemovedNode:
        """Delete a node with its devices, their samples and reservations; the feed says each
        device was removed. Refused (FailedPrecondition naming the jobs) while a job holds a live
        reservation on one of its devices, unless ``force``: then those reservations go too."""
        if not address:
            raise InvalidArgument("address must not be empty; name the node as ListNodes shows it (host:port)",
                                  field="address")
        return self._write_change(lambda conn: remove_node(conn, self.writer, address, now, force))

    def mark_suspect(self, address: str, reason: str, now: float) -> tuple[NodeRecord, list[DeviceChange]]:
        """Mark the node suspect (its first reason and time kept); NotFound if it is not registered.
        The changes: its devices UPDATED, when it was not suspect before."""
        return self._write_change(lambda conn: mark_suspect(conn, self.writer, address, reason, now))

    def trust_node(self, address: str, now: float) -> tuple[NodeRecord, list[DeviceChange]]:
        return self._write_change(lambda conn: trust_node(conn, self.writer, address, now))

    def forget_lost_nodes(self, silent_since: float, now: float) -> list[RemovedNode]:
        """Remove, as ``remove_node(force=True)``, every lost node that has not answered a poll
        since before ``silent_since`` (or, never having answered, was registered before it).

        Each node goes in its own transaction, which checks the condition again under the node's
        row lock: a node that answered meanwhile stays, and replicas forgetting at once each
        remove a node at most once (the others find it gone)."""
        with self._read() as conn:
            candidates = lost_since(conn, silent_since)
        forgotten = []
        for address in candidates:
            removed = self._write_change(
                lambda conn, address=address: remove_node(conn, self.writer, address, now, True, silent_since))
            if removed is not None:
                forgotten.append(removed)
        return forgotten

    # -- which replica polls which node ----------------------------------------------------

    def heartbeat(self, replica: str, now: float, lease_s: float) -> None:
        """``replica`` is live until ``now + lease_s``: counted in every replica's fair share."""
        _check_lease(replica, lease_s)
        self._write(lambda conn: heartbeat(conn, replica, now, lease_s))

    def claim_nodes(self, replica: str, now: float, lease_s: float, renew: bool = True) -> list[NodeRecord]:
        """The nodes ``replica`` polls from ``now``, by address: those it holds (renewed with
        ``renew``, down to its fair share) and free ones taken up to that share (polls.claim_nodes)."""
        _check_lease(replica, lease_s)
        return self._write(lambda conn: claim_nodes(conn, replica, now, lease_s, renew))

    def release_nodes(self, replica: str) -> int:
        """Give back every node ``replica`` holds (a clean shutdown); how many it held."""
        return self._write(lambda conn: release_nodes(conn, replica))

    # -- devices and samples ---------------------------------------------------------------

    def get_device(self, device_id: str, now: float | None = None) -> DeviceRecord:
        with self._read() as conn:
            row = conn.execute(DEVICE_BY_ID, {"id": device_id, "now": _now(now)}).first()
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
        with self._read() as conn:
            return device_page(conn, filter or DeviceFilter(), page_size, after_id, _now(now))

    def latest_sample(self, device_id: str) -> DeviceSample | None:
        query = _SAMPLES.where(status_samples.c.device_id == device_id).order_by(status_samples.c.ts.desc()).limit(1)
        with self._read() as conn:
            row = conn.execute(query).first()
        return sample(device_id, row) if row else None

    def samples(self, device_id: str, since: float | None = None) -> list[DeviceSample]:
        """Samples of ``device_id`` newer than ``since``, oldest first."""
        query = _SAMPLES.where(status_samples.c.device_id == device_id)
        if since is not None:
            query = query.where(status_samples.c.ts > since)
        with self._read() as conn:
            rows = conn.execute(query.order_by(status_samples.c.ts)).all()
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
        """``reserve`` for several (device_id, memory_bytes, compute_fraction) claims: all or none.

        Decided in one transaction that no other claim on these devices interleaves with, in this
        process or another replica's (``lock_devices``): of two jobs reaching for the last free
        bytes of a device, exactly one gets them."""
        check_claims(job_id, claims, ttl_s)

        def work(conn: Connection) -> tuple[list[Reservation], Change]:
            lock_devices(conn, [claim[0] for claim in claims])
            made = [reserve_one(conn, job_id, *claim, ttl_s, now) for claim in claims]
            change = Change(self.writer, now, reserved=tuple(claim[0] for claim in claims))
            write_change(conn, change)
            return made, change

        return self._write_change(work)

    def renew(
        self, job_id: str, device_ids: Sequence[str] | None, ttl_s: float, now: float
    ) -> list[Reservation]:
        """Extend the job's live leases (on ``device_ids``, or all) to ``now + ttl_s``; all or none."""
        if not job_id:
            raise InvalidArgument("job_id must not be empty; pass the id of the job whose reservations to renew")
        check_ttl(ttl_s)

        def work(conn: Connection) -> tuple[list[Reservation], Change]:
            renewed = renew_leases(conn, job_id, device_ids, ttl_s, now)
            change = Change(self.writer, now, reserved=tuple(r.device_id for r in renewed))
            write_change(conn, change)
            return renewed, change

        return self._write_change(work)

    def release(self, job_id: str, device_ids: Sequence[str] | None = None) -> int:
        statement = sa.delete(reservations).where(reservations.c.job_id == job_id)
        if device_ids is not None:
            statement = statement.where(reservations.c.device_id.in_(sorted(set(device_ids))))
        statement = statement.returning(reservations.c.device_id)

        def work(conn: Connection) -> tuple[int, Change]:
            released = list(conn.execute(statement).scalars())
            change = Change(self.writer, time.time(), reserved=tuple(sorted(set(released))))
            write_change(conn, change)
            return len(released), change

        return self._write_change(work)

    def reservations(
        self, device_id: str | None = None, job_id: str | None = None, now: float | None = None
    ) -> list[Reservation]:
        """Reservations matching the given keys; with ``now``, only leases still live at that time."""
        query = sa.select(*RESERVATION_COLUMNS)
        if device_id is not None:
            query = query.where(reservations.c.device_id == device_id)
        if job_id is not None:
            query = query.where(reservations.c.job_id == job_id)
        if now is not None:
            query = query.where(reservations.c.expires_at > now)
        with self._read() as conn:
            rows = conn.execute(query.order_by(reservations.c.job_id, reservations.c.device_id)).all()
        return [Reservation(*row) for row in rows]

    def expire_reservations(self, now: float) -> int:
        # No change to the feed: a lapsed lease stopped counting at its expiry, in every reader.
        statement = sa.delete(reservations).where(reservations.c.expires_at <= now)
        return self._write(lambda conn: conn.execute(statement).rowcount)

    # -- the change feed and the device index's reads ---------------------------------------

    def change_cursor(self) -> int:
        """A cursor from which ``read_changes`` returns every change committed after this call."""
        with self._read() as conn:
            return horizon(conn)

    def read_changes(self, cursor: int) -> tuple[list[Change], int]:
        """Other stores' changes past ``cursor``, in order, and the cursor to read on from."""
        with self._read() as conn:
            return read_changes(conn, cursor, self.writer)

    def prune_changes(self, before: float) -> int:
        """Drop the feed's rows written before ``before`` (every replica's poll cycle does)."""
        return self._write(lambda conn: prune_changes(conn, before))

    def device_records(self, device_ids: Sequence[str]) -> list[DeviceRecord]:
        """The named devices that exist, as of now, in no particular order."""
        if not device_ids:
            return []
        with self._read() as conn:
            rows = conn.execute(DEVICES_BY_IDS, {"ids": list(device_ids), "now": time.time()}).all()
        return [device_record(row) for row in rows]

    def reservations_on(self, device_ids: Sequence[str] | None) -> list[Reservation]:
        """Every reservation row (lapsed ones too, until expired) on ``device_ids``, or on all devices."""
        query = sa.select(*RESERVATION_COLUMNS)
        if device_ids is not None:
            query = query.where(reservations.c.device_id.in_(list(device_ids)))
        with self._read() as conn:
            return [Reservation(*row) for row in conn.execute(query)]


def _check_lease(replica: str, lease_s: float) -> None:
    if not replica:
        raise InvalidArgument("replica must not be empty; pass the inventory replica's id")
    if not lease_s > 0:
        raise InvalidArgument(f"lease_s must be positive, got {lease_s}; derive it from the poll interval")


def _now(now: float | None) -> float:
    return time.time() if now is None else now
