"""Each replica's index of decoded device records, kept current from the change feed, so that
ScoreDevices filters and scores arrays (``ranking.py``) instead of reading and decoding every
device row per request (seconds at 80,000 devices).

What it holds: every device's spec, node, health and latest status sample, and its reservations
with their leases (one that lapses stops counting at its expiry, as the SQL's "as of now" sums
do); the figures scoring and filtering read are numpy columns, one slot per device.

How current it is:

- This replica's own writes reach it as each commits (the store's listener): a status sample
  is applied at once; a device added, updated, lost or recovered, or reservations changed, is
  read again from the database before the next ranking.
- Other replicas' writes arrive through the change feed (``changes.py``), read by ``follow``,
  which the inventory calls before every ranking and its follower thread calls every follow
  interval. So a ranking reflects every change committed before it began, once every
  transaction older than that change has ended too (PostgreSQL's horizon; SQLite: at once).

One thread at a time follows (``_following``): it alone moves the cursor and reads devices
again, so no entry is replaced by a read older than the one that last replaced it. Its reads of
the database happen outside the index's lock, which rankings and this replica's own writes take
only for the moment they read or change the arrays. A device changed by this replica while it is
being read again is marked again, and read again by the next follow (every ranking's first step);
a sample replaces the latest only if it is as new or newer. A replica that could not follow for
RESYNC_AFTER_S (the feed may have been pruned past it) loads everything again.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from accelmesh.errors import NotFound
from accelmesh.hardware.model import DeviceSample, DeviceSpec, Performance
from inventory_svc.changes import RESYNC_AFTER_S, Change
from inventory_svc.filtering import DeviceFilter
from inventory_svc.ranking import Columns, rank
from inventory_svc.records import DeviceRecord, Reservation
from inventory_svc.scoring import ScoredDevice, TaskProfile, Weights
from inventory_svc.store_port import Store

LOAD_BATCH = 1000  # devices read again per statement (an IN list)
FULL_LOAD_PAGE = 5000  # devices per page of the full load
# Devices removed from the index kept as last known, for the REMOVED events of watchers: another
# replica's RemoveNode reaches this one as ids, with the rows already gone. Removals are rare, and
# each is published within a follow interval of leaving the index.
REMOVED_KEPT = 10_000


@dataclass(frozen=True)
class _Entry:
    """What rarely changes about a device: replaced whole when it is read again."""

    spec: DeviceSpec
    node_address: str
    health: str
    first_seen_at: float
    updated_at: float


class DeviceIndex:
    def __init__(self, store: Store, *, resync_after_s: float = RESYNC_AFTER_S,
                 monotonic: Callable[[], float] = time.monotonic):
        self._store = store
        self._resync_after_s = resync_after_s
        self._monotonic = monotonic
        self._lock = threading.RLock()  # the arrays and entries
        self._following = threading.Lock()  # the cursor, and reading devices again
        self.columns = Columns()
        self._slots: dict[str, int] = {}
        self._entries: list[_Entry | None] = []
        self._latest: list[DeviceSample | None] = []
        self._leases: dict[int, dict[str, tuple[int, float, float]]] = {}  # slot -> job -> (bytes, compute, expiry)
        self._free_slots: list[int] = []
        self._dirty: set[str] = set()
        self._removed: OrderedDict[str, DeviceRecord] = OrderedDict()
        self._cursor = 0
        self._followed_at = monotonic()
        # Listening before the first load: a change this store commits meanwhile is then either
        # in the load or applied after it (re-reading a device is always safe).
        store.add_listener(self.apply)
        self.reload()

    # -- keeping current -------------------------------------------------------------------

    def reload(self) -> None:
        """Everything from the database; changes from then on come through ``follow``. Rankings
        wait for it: it runs at start, and after a replica lost touch with the database."""
        with self._following, self._lock:
            self._load()

    def _load(self) -> None:
        with self._lock:
            self._cursor = self._store.change_cursor()  # before reading: what commits meanwhile is replayed
            self._clear()
            after = ""
            while True:
                page, after = self._store.list_devices(DeviceFilter(include_lost=True), FULL_LOAD_PAGE, after)
                for record in page:
                    self._put(record)
                if not after:
                    break
            self._set_leases(self._store.reservations_on(None), self._slots)
            self._followed_at = self._monotonic()

    def apply(self, change: Change) -> None:
        """One change: samples at once, everything else read again before the next ranking."""
        with self._lock:
            for sample in change.samples:
                slot = self._slots.get(sample.device_id)
                if slot is None:
                    self._dirty.add(sample.device_id)
                else:
                    self._sample(slot, sample)
            self._dirty.update(event.device_id for event in change.events)
            self._dirty.update(change.reserved)

    def follow(self) -> list[Change] | None:
        """Apply the changes other replicas committed since the last call, then read again what
        they (and this replica) left to read; the changes read, or None after a full reload
        (which may have skipped some: a watcher cannot be told which)."""
        with self._following:
            if self._monotonic() - self._followed_at > self._resync_after_s:
                with self._lock:
                    self._load()
                return None
            changes, cursor = self._store.read_changes(self._cursor)
            for change in changes:
                self.apply(change)
            self._cursor, self._followed_at = cursor, self._monotonic()
            self._catch_up()
            return changes

    def _catch_up(self, extra: Iterable[str] = ()) -> None:
        """Read again the devices marked (and ``extra``); the caller holds ``_following``."""
        with self._lock:
            self._dirty.update(extra)
        while True:
            with self._lock:
                if not self._dirty:
                    return
                batch = [self._dirty.pop() for _ in range(min(LOAD_BATCH, len(self._dirty)))]
            found = {record.id: record for record in self._store.device_records(batch)}
            leases = self._store.reservations_on([d for d in batch if d in found])
            with self._lock:
                for device_id in batch:
                    if device_id in found:
                        self._put(found[device_id])
                    elif device_id in self._slots:
                        self._remove(device_id)
                slots = {d: self._slots[d] for d in batch if d in found}
                for slot in slots.values():
                    self._leases.pop(slot, None)
                self._set_leases(leases, slots)

    # -- reading ---------------------------------------------------------------------------

    def score(self, profile: TaskProfile, flt: DeviceFilter, limit: int, now: float,
              device_ids: Sequence[str] = ()) -> tuple[list[ScoredDevice], Weights]:
        """Rank the devices ``flt`` matches (among ``device_ids`` if given; NotFound for one not
        in the inventory) as ``scoring.score_devices`` would, best first, ``limit`` of them (0: all)."""
        missing = [d for d in device_ids if d not in self._slots]
        if missing:  # perhaps behind the horizon still: ask the database itself
            with self._following:
                self._catch_up(missing)
        with self._lock:
            within = None
            if device_ids:
                for device_id in device_ids:
                    if device_id not in self._slots:
                        raise NotFound(f"device {device_id!r} is not in the inventory; list devices with ListDevices")
                within = np.array([self._slots[d] for d in device_ids], np.int64)
            reserved_bytes, reserved_compute = self._reserved(now)
            ranked = rank(self.columns, flt, profile, limit, reserved_bytes, reserved_compute, within,
                          self._record_at)
            scored = [ScoredDevice(self._record(slot, int(reserved_bytes[slot]), float(reserved_compute[slot])),
                                   score, components, ranked.weights, status)
                      for slot, score, components, status in ranked.rows]
            return scored, ranked.weights

    def device_counts(self) -> dict[str, int]:
        """Devices per node address, lost ones included."""
        with self._lock:
            live = self.columns.live[: self.columns.size]
            counts = np.bincount(self.columns.node[: self.columns.size][live], minlength=len(self.columns.nodes.values))
            return {node: int(n) for node, n in zip(self.columns.nodes.values, counts) if n}

    def removed_record(self, device_id: str) -> DeviceRecord | None:
        """The device as it was when it left the index (its rows deleted), if it left recently."""
        with self._lock:
            return self._removed.get(device_id)

    def __len__(self) -> int:
        return len(self._slots)

    # -- slots -----------------------------------------------------------------------------

    def _clear(self) -> None:
        self.columns = Columns()
        self._slots, self._entries, self._latest = {}, [], []
        self._leases, self._free_slots, self._dirty = {}, [], set()

    def _put(self, record: DeviceRecord) -> None:
        slot = self._slots.get(record.id)
        if slot is None:
            slot = self._free_slots.pop() if self._free_slots else self.columns.grow()
            if slot == len(self._entries):
                self._entries.append(None)
                self._latest.append(None)
            self._slots[record.id] = slot
            self.columns.ids_changed()
        spec = record.spec
        self._entries[slot] = _Entry(spec, record.node_address, record.health, record.first_seen_at, record.updated_at)
        self.columns.set_static(slot, spec, record.node_address, record.health == "healthy",
                                _perf_key(spec.performance))
        current = self._latest[slot]
        if record.latest is not None and (current is None or record.latest.timestamp >= current.timestamp):
            self._sample(slot, record.latest)
        elif current is None:
            self._latest[slot] = None
            self.columns.set_sample(slot, spec.performance.memory_bytes, 0, 0.0)

    def _remove(self, device_id: str) -> None:
        self._removed[device_id] = self._record(self._slots[device_id], 0, 0.0)
        self._removed.move_to_end(device_id)
        while len(self._removed) > REMOVED_KEPT:
            self._removed.popitem(last=False)
        slot = self._slots.pop(device_id)
        self._entries[slot] = self._latest[slot] = None
        self._leases.pop(slot, None)
        self.columns.clear(slot)
        self._free_slots.append(slot)

    def _sample(self, slot: int, sample: DeviceSample) -> None:
        current = self._latest[slot]
        if current is None or sample.timestamp >= current.timestamp:
            self._latest[slot] = sample
            self.columns.set_sample(slot, sample.memory_total_bytes, sample.memory_used_bytes, sample.utilization)

    def _set_leases(self, rows: Sequence[Reservation], slots: dict[str, int]) -> None:
        for r in rows:
            slot = slots.get(r.device_id)
            if slot is not None:
                self._leases.setdefault(slot, {})[r.job_id] = (r.memory_bytes, r.compute_fraction, r.expires_at)

    def _reserved(self, now: float) -> tuple[np.ndarray, np.ndarray]:
        """Per slot: the bytes and compute fraction of leases live at ``now``. Lapsed ones are
        dropped: a lease never comes back once lapsed (renewal refuses it; a new one is a change)."""
        size = self.columns.size
        reserved_bytes, reserved_compute = np.zeros(size, np.int64), np.zeros(size)
        for slot in list(self._leases):
            leases = self._leases[slot]
            for job in [job for job, (_, _, expiry) in leases.items() if expiry <= now]:
                del leases[job]
            if not leases:
                del self._leases[slot]
                continue
            reserved_bytes[slot] = sum(b for b, _, _ in leases.values())
            reserved_compute[slot] = sum(c for _, c, _ in leases.values())
        return reserved_bytes, reserved_compute

    def _record(self, slot: int, reserved_bytes: int, reserved_compute: float) -> DeviceRecord:
        e = self._entries[slot]
        return DeviceRecord(e.spec, e.node_address, e.health, self._latest[slot], reserved_bytes, reserved_compute,
                            e.first_seen_at, e.updated_at)

    def _record_at(self, slot: int) -> DeviceRecord:
        """For filter terms the columns cannot answer (hand-built ones): the record, reservations left out."""
        return self._record(slot, 0, 0.0)


def _perf_key(perf: Performance) -> tuple:
    """What scoring reads of a device's datasheet: devices of one type share it."""
    return (tuple(sorted(perf.peak_tflops.items())), perf.memory_bytes, perf.memory_bandwidth_gbps)

