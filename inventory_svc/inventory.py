"""The inventory's behaviour, apart from gRPC: registration, polling, refresh, listing, scoring,
reservations. The servicer translates protos to calls on `Inventory`; the poller drives
`poll_all` and `take_over`; nodes are reached through an injected `describe(address, device_ids)`.
Replicas sharing one database each poll the nodes they hold a lease on (`Store.claim_nodes`),
and each keeps a device index (`index.py`) that ScoreDevices ranks from: `follow` (before every
ranking, and every follow interval on the follower's thread) brings it, and this replica's
watchers, up to the changes the other replicas wrote. How long a replica's leases on its nodes
last is the poller's (``poller.LEASE_PER_INTERVAL``); ListDevices' page tokens are ``paging.py``'s,
a reservation's lease bounds ``reservations.py``'s, the account of the weights ``scoring.py``'s.
"""

from __future__ import annotations

import contextvars
import logging
import re
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from opentelemetry import trace

from accelmesh import errors
from accelmesh.hardware.model import NodeDescription, parse_device_id
from accelmesh.runtime import attributes as attr
from inventory_svc import events as ev
from inventory_svc.changes import CHANGE_RETENTION_S
from inventory_svc.filtering import DeviceFilter, parse_filter
from inventory_svc.index import DeviceIndex
from inventory_svc.paging import decode_page_token, encode_page_token
from inventory_svc.poller import LEASE_PER_INTERVAL
from inventory_svc.records import DeviceRecord, NodeRecord, RemovedNode, Reservation
from inventory_svc.reservations import lease_seconds
from inventory_svc.scoring import ScoredDevice, TaskProfile, Weights, explain_weights
from inventory_svc.store_port import Store

log = logging.getLogger(__name__)

Describe = Callable[[str, Sequence[str]], NodeDescription]

ADDRESS = re.compile(r"^(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9_.\-]+):(\d{1,5})$")


def check_node_address(address: str) -> None:
    if not ADDRESS.match(address or ""):
        raise errors.InvalidArgument(f"address {address!r} is not 'host:port'; pass the worker's gRPC address")


MAX_RENEWED_IDS = 10_000  # device ids one RenewReservations may name
POLL_WORKERS = 32
MAX_SCORED_IDS = 10_000  # device ids one ScoreDevices may name

DEFAULT_POLL_INTERVAL_S = 5.0
# A lost node is removed once it has not answered for this long (config forget_lost_after_s): an
# hour rides out a reboot, a maintenance window or a partition, and still keeps the nodes of
# workers restarted on new ports (every `accelmesh up`) from piling up in the inventory, each
# polled in vain every interval. A forgotten worker that comes back registers again at its start.
DEFAULT_FORGET_LOST_AFTER_S = 3600.0


@dataclass(frozen=True)
class Claim:
    device_id: str
    memory_bytes: int
    compute_fraction: float


@dataclass(frozen=True)
class Ranking:
    devices: list[ScoredDevice]
    weights: Weights
    rule: str


class Inventory:
    def __init__(
        self,
        store: Store,
        describe: Describe,
        *,
        lost_after_polls: int = 3,
        hub: ev.EventHub | None = None,
        clock: Callable[[], float] = time.time,
        poll_workers: int = POLL_WORKERS,
        tracer: trace.Tracer | None = None,
        poll_interval_s: float = DEFAULT_POLL_INTERVAL_S,
        replica_id: str | None = None,
        forget_lost_after_s: float = DEFAULT_FORGET_LOST_AFTER_S,
    ):
        if lost_after_polls < 1:
            raise errors.InvalidArgument(f"lost_after_polls must be >= 1, got {lost_after_polls}")
        if poll_interval_s <= 0:
            raise errors.InvalidArgument(f"poll_interval_s must be positive, got {poll_interval_s}")
        if not forget_lost_after_s >= 0:
            raise errors.InvalidArgument(
                f"forget_lost_after_s must be >= 0 (0: never forget), got {forget_lost_after_s}")
        self.store = store
        self._forget_after_s = forget_lost_after_s
        # One id per process start: a restarted replica is a new one, its predecessor's leases lapse.
        self.replica_id = replica_id or uuid.uuid4().hex
        self.lease_s = LEASE_PER_INTERVAL * poll_interval_s
        self._polling: frozenset[str] = frozenset()  # the nodes held at the last claim
        # Counted live from the start, so replicas already polling give up a share to this one
        # before its first cycle rather than after it.
        store.heartbeat(self.replica_id, clock(), self.lease_s)
        self.hub = hub or ev.EventHub()
        self._describe = describe
        self._lost_after = lost_after_polls
        self._clock = clock
        self._pool = ThreadPoolExecutor(max_workers=poll_workers, thread_name_prefix="poll")
        self._tracer = tracer or trace.NoOpTracer()
        self.index = DeviceIndex(store)
        self._following = threading.Lock()  # the followed changes reach the watchers in feed order

    def close(self) -> None:
        """Hand this replica's nodes back, so the others take them at their next claim rather
        than when the leases lapse; then stop the poll workers."""
        try:
            self.store.release_nodes(self.replica_id)
        except errors.AccelmeshError as exc:  # the database is gone: the leases lapse on their own
            log.warning("could not hand back the nodes of inventory replica %s: %s", self.replica_id, exc)
        self._pool.shutdown(wait=True)

    # -- nodes and polling ---------------------------------------------------------------

    def register_node(self, address: str) -> tuple[NodeRecord, list[DeviceRecord]]:
        check_node_address(address)
        description = self._describe(address, ())  # Unavailable propagates: nothing to register
        self._check_ids_are_free(address, description)
        now = self._clock()
        node = self.store.upsert_node(address, description.ip, description.hostname, now)
        self._publish(self.store.record_poll_success(node.address, description, now), now)
        return self.store.get_node(node.address), [self.store.get_device(d.id) for d in description.devices]

    def remove_node(self, address: str, force: bool = False) -> RemovedNode:
        """Forget a node and its devices (an operator's act): no replica polls it any more, and
        watchers see its devices REMOVED. Refused while jobs hold its devices, unless ``force``."""
        now = self._clock()
        removed = self.store.remove_node(address, now, force)
        self._publish_removed(removed, now)
        log.info("node %s removed with %d devices%s", address, len(removed.devices), _ended(removed))
        return removed

    def mark_suspect(self, address: str, reason: str) -> NodeRecord:
        """A dispatcher's spot check found the node's outputs wrong: its devices stop being candidates."""
        now = self._clock()
        node, changes = self.store.mark_suspect(address, reason, now)
        self._publish([(ev.UPDATED, c.device_id) for c in changes], now)  # watchers: no longer candidates
        log.warning("node %s is suspect: %s", address, node.suspect_reason)
        return node

    def trust_node(self, address: str) -> NodeRecord:
        """An operator clears the node's suspect mark."""
        now = self._clock()
        node, changes = self.store.trust_node(address, now)
        self._publish([(ev.UPDATED, c.device_id) for c in changes], now)
        log.info("node %s is trusted again", address)
        return node

    def forget_lost_nodes(self) -> list[RemovedNode]:
        """Remove (as ``remove_node`` with force) the lost nodes silent for longer than
        ``forget_lost_after_s``; nothing when that is 0. Every replica's poll cycle runs it: a
        node is removed once, by whichever gets there first (``Store.forget_lost_nodes``)."""
        if not self._forget_after_s:
            return []
        now = self._clock()
        forgotten = self.store.forget_lost_nodes(now - self._forget_after_s, now)
        for removed in forgotten:
            self._publish_removed(removed, now)
            log.warning("forgot node %s: lost and silent for more than %g s (forget_lost_after_s); %d devices "
                        "removed%s", removed.node.address, self._forget_after_s, len(removed.devices),
                        _ended(removed))
        return forgotten

    def _publish_removed(self, removed: RemovedNode, now: float) -> None:
        last_known = {record.id: record for record in removed.devices}
        self._publish([(ev.REMOVED, device_id) for device_id in last_known], now, last_known.get)

    def _check_ids_are_free(self, address: str, description: NodeDescription) -> None:
        for spec in description.devices:
            try:
                owner = self.store.get_device(spec.id).node_address
            except errors.NotFound:
                continue
            if owner == address or self.store.get_node(owner).state != "active":
                continue
            if self._answers(owner):
                raise errors.FailedPrecondition(
                    f"device {spec.id} is already reported by node {owner}; run one worker per node IP, "
                    f"or give this worker its own IP with --advertise-ip"
                )
            # The owner is gone without being noticed yet (a worker restarted on a new port):
            # it is lost now, and the node registering takes its devices over.
            now = self._clock()
            lost = self.store.record_poll_failure(
                owner, f"did not answer when {address} registered its devices", now, lost_after=1)
            self._publish([(ev.LOST, device_id) for device_id in lost], now)

    def _answers(self, address: str) -> bool:
        try:
            self._describe(address, ())
        except Exception:  # noqa: BLE001 - any failure means it does not answer
            return False
        return True

    def poll_node(self, node: NodeRecord, reason: str = "interval") -> bool:
        """Describe one node and record the outcome; True when it answered."""
        with self._tracer.start_as_current_span("inventory.poll_node") as span:
            span.set_attribute(attr.NODE_ADDRESS, node.address)
            span.set_attribute(attr.POLL_REASON, reason)
            try:
                description = self._describe(node.address, ())
                now = self._clock()
                changes = self.store.record_poll_success(node.address, description, now)
            except Exception as exc:  # noqa: BLE001 - a node's failure is data, never a crash
                now = self._clock()
                reason = str(exc) if isinstance(exc, errors.AccelmeshError) else f"{type(exc).__name__}: {exc}"
                span.set_attribute(attr.POLL_OUTCOME, reason)
                try:
                    lost = self.store.record_poll_failure(node.address, reason, now, self._lost_after)
                except errors.NotFound:  # removed while it was being polled: nothing left to record
                    return False
                self._publish([(ev.LOST, device_id) for device_id in lost], now)
                return False
            span.set_attribute(attr.POLL_OUTCOME, "ok")
            span.set_attribute(attr.DEVICE_COUNT, len(description.devices))
            self._publish(changes, now)
            return True

    def poll_all(self) -> dict[str, bool]:
        """One poll cycle, in parallel, over the nodes this replica claims (renewing its leases; a
        replica alone on its database claims every node); then forgets the nodes lost for too long
        (``forget_lost_nodes``) and lets unrenewed reservations lapse."""
        with self._tracer.start_as_current_span("inventory.poll_cycle") as span:
            span.set_attribute(attr.POLL_REASON, "interval")
            nodes = self.store.claim_nodes(self.replica_id, self._clock(), self.lease_s)
            self._polling = frozenset(n.address for n in nodes)
            outcomes = dict(zip((n.address for n in nodes), self._map_in_context(self.poll_node, nodes)))
            self.forget_lost_nodes()
            now = self._clock()
            self.store.expire_reservations(now)
            self.store.prune_changes(now - CHANGE_RETENTION_S)
            return outcomes

    def take_over(self) -> dict[str, bool]:
        """Between poll cycles: take the nodes whose replica stopped renewing (up to this one's
        share, without renewing its own) and poll at once those it did not hold before."""
        nodes = self.store.claim_nodes(self.replica_id, self._clock(), self.lease_s, renew=False)
        gained = [n for n in nodes if n.address not in self._polling]
        self._polling = frozenset(n.address for n in nodes)
        if not gained:
            return {}
        with self._tracer.start_as_current_span("inventory.poll_cycle") as span:
            span.set_attribute(attr.POLL_REASON, "takeover")
            return dict(zip((n.address for n in gained),
                            self._map_in_context(lambda n: self.poll_node(n, "takeover"), gained)))

    def _map_in_context(self, fn, items) -> list:
        """Pool map that carries the caller's trace context into each task (threads do not inherit it)."""
        calls = [(contextvars.copy_context(), item) for item in items]
        return list(self._pool.map(lambda call: call[0].run(fn, call[1]), calls))

    def refresh_devices(self, device_ids: Sequence[str]) -> list[DeviceRecord]:
        """Real-time refresh: poll the nodes holding these devices now, return fresh records."""
        if not device_ids:
            raise errors.InvalidArgument("device_ids is empty; name the devices to refresh")
        records = [self.get_device(device_id) for device_id in device_ids]
        nodes = {r.node_address: self.store.get_node(r.node_address) for r in records}
        answered = dict(zip(nodes, self._map_in_context(lambda n: self.poll_node(n, "refresh"), list(nodes.values()))))
        silent = [r.id for r in records if not answered[r.node_address]]
        if silent:
            reasons = "; ".join(f"{n}: {self.store.get_node(n).last_error}" for n, ok in answered.items() if not ok)
            raise errors.Unavailable(f"could not refresh {', '.join(silent)}: {reasons}")
        return [self.store.get_device(device_id) for device_id in device_ids]

    def _publish(self, changes, now: float,
                 last_known: Callable[[str], DeviceRecord | None] = lambda device_id: None) -> None:
        """Tell the watchers; a removed device's event carries ``last_known(id)``, its rows being gone."""
        if changes:
            self.hub.publish([
                ev.DeviceEvent(kind, device_id, now, last_known(device_id) if kind == ev.REMOVED else None)
                for kind, device_id in changes
            ])

    def follow(self) -> int:
        """Apply what other replicas committed since the last call to the device index, and tell
        this replica's watchers; how many changes that was."""
        with self._following:
            changes = self.index.follow()
            if changes is None:  # reloaded after falling behind: the events in between are unknown
                self.hub.drop_all("the inventory replica fell behind the others' changes")
                return 0
            for change in changes:
                self._publish(change.events, change.written_at, self.index.removed_record)
            return len(changes)

    # -- reading -------------------------------------------------------------------------

    def get_device(self, device_id: str) -> DeviceRecord:
        try:
            parse_device_id(device_id)
        except ValueError as exc:
            raise errors.InvalidArgument(f"device_id: {exc}") from None
        return self.store.get_device(device_id, self._clock())

    def list_devices(self, filter_text: str, page_size: int, page_token: str) -> tuple[list[DeviceRecord], str]:
        if page_size < 0:
            raise errors.InvalidArgument(f"page_size is {page_size}; use 0 for the default or a positive number")
        flt = parse_filter(filter_text)
        after = decode_page_token(page_token, filter_text)
        records, last = self.store.list_devices(flt, page_size, after, self._clock())
        return records, encode_page_token(last, filter_text) if last else ""

    def device_counts(self) -> dict[str, int]:
        """Devices (lost ones too) per node address."""
        self.follow()
        return self.index.device_counts()

    def all_devices(self, flt: DeviceFilter) -> list[DeviceRecord]:
        found, after = [], ""
        while True:
            page, after = self.store.list_devices(flt, 1000, after, self._clock())
            found.extend(page)
            if not after:
                return found

    def score(self, profile: TaskProfile, filter_text: str, limit: int, device_ids: Sequence[str] = ()) -> Ranking:
        """Rank the devices the filter matches, or exactly `device_ids` among them."""
        if limit < 0:
            raise errors.InvalidArgument(f"limit is {limit}; use 0 for all devices or a positive number")
        if len(device_ids) > MAX_SCORED_IDS:
            raise errors.InvalidArgument(f"device_ids lists {len(device_ids)} devices; score at most {MAX_SCORED_IDS} "
                                         "at a time, or narrow the candidates with filter instead")
        flt = parse_filter(filter_text)
        named = list(dict.fromkeys(device_ids))
        for device_id in named:
            try:
                parse_device_id(device_id)
            except ValueError as exc:
                raise errors.InvalidArgument(f"device_id: {exc}") from None
        self.follow()
        ranked, weights = self.index.score(profile, flt, limit, self._clock(), named)
        return Ranking(ranked, weights, explain_weights(profile, weights))

    # -- reservations --------------------------------------------------------------------

    def reserve(self, job_id: str, claims: Sequence[Claim], ttl_s: float) -> list[Reservation]:
        if not job_id:
            raise errors.InvalidArgument("job_id is empty; name the job that holds the reservation")
        if not claims:
            raise errors.InvalidArgument("claims is empty; list at least one device to reserve")
        ttl_s = lease_seconds(ttl_s)
        for i, claim in enumerate(claims):
            self.get_device(claim.device_id)
            if claim.memory_bytes < 0:
                raise errors.InvalidArgument(f"claims[{i}].memory_bytes is negative ({claim.memory_bytes})")
            if not 0.0 <= claim.compute_fraction <= 1.0:
                raise errors.InvalidArgument(f"claims[{i}].compute_fraction {claim.compute_fraction} is outside 0..1")
        now = self._clock()
        return self.store.reserve_many(
            job_id, [(c.device_id, c.memory_bytes, c.compute_fraction) for c in claims], ttl_s, now
        )

    def renew(self, job_id: str, device_ids: Sequence[str], ttl_s: float) -> list[Reservation]:
        """Extend a job's live leases (on `device_ids`, or all) to `ttl_s` from now, amounts
        unchanged, all or none. A lease that lapsed or was released is NOT_FOUND, never revived."""
        if not job_id:
            raise errors.InvalidArgument("job_id is empty; name the job whose reservations to renew", field="job_id")
        if len(device_ids) > MAX_RENEWED_IDS:
            raise errors.InvalidArgument(f"device_ids lists {len(device_ids)} devices; renew at most {MAX_RENEWED_IDS} "
                                         "at a time, or leave it empty to renew all of the job's", field="device_ids")
        return self.store.renew(job_id, list(device_ids) or None, lease_seconds(ttl_s), self._clock())

    def release(self, job_id: str, device_ids: Sequence[str]) -> int:
        if not job_id:
            raise errors.InvalidArgument("job_id is empty; name the job whose reservations end")
        return self.store.release(job_id, list(device_ids) or None)

    def reservations(self, job_id: str = "", device_id: str = "") -> list[Reservation]:
        self.store.expire_reservations(self._clock())
        return self.store.reservations(device_id=device_id or None, job_id=job_id or None)


def _ended(removed: RemovedNode) -> str:
    """For the log: the jobs whose reservations a removal ended."""
    return f", ending the reservations of {sorted({r.job_id for r in removed.released})}" if removed.released else ""
