"""The admission gate (requirements D3): a planned job's claims (the devices its plan gives work
and the bytes each must hold) are checked against its owner's quota, then reserved on the
inventory, before the job's strategy reads a parameter, opens a device pool or sends a shard.
The gate answers with a `Grant` (the devices reserved, and leased while the job runs) or a
`Wait` saying why the job cannot start now, which the runner turns into a place in the queue.
A job that may not wait (spec.queue_timeout 0 s, or an owner with as many jobs queued as one
tenant may have) is refused with RESOURCE_EXHAUSTED instead.

Kueue admits a workload on its declared requests before any of it runs. A job here declares its
requests by being planned: which devices get rows, and what each stage of a placed model holds,
are the plan's answer (a device the plan gives no rows is not reserved, nor counted against the
quota). So planning comes first, read-only, and the gate decides before anything of the job runs.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from accelmesh import errors
from dispatch_svc.admission.quotas import OverQuota, Quotas
from dispatch_svc.admission.reservations import LeaseKeeper
from dispatch_svc.jobs import records as m
from dispatch_svc.jobs.limits import GIB, RESERVATION_TTL_S
from dispatch_svc.jobs.validation import input_bytes
from dispatch_svc.metrics import NO_METRICS, DispatchMetrics
from dispatch_svc.ports import Inventory, LiveJob

DEFAULT_QUEUE_TIMEOUT_S = 24 * 3600.0  # a job's wait when its spec says nothing (ACCELMESH_QUEUE_TIMEOUT_S)
# Jobs one tenant may have queued at once (ACCELMESH_MAX_QUEUED_PER_TENANT): each holds its inputs on
# the dispatch dir's disk while it waits (at most ACCELMESH_MAX_JOB_BYTES each) ...
DEFAULT_MAX_QUEUED = 100
# ... and the bytes their declared inputs take there together (ACCELMESH_MAX_QUEUED_BYTES_PER_TENANT).
DEFAULT_MAX_QUEUED_BYTES = 64 * GIB


@dataclass(frozen=True)
class Grant:
    """The job holds these claims (device id, bytes), leased by `lease` until the job ends."""

    claims: tuple[tuple[str, int], ...]
    lease: LeaseKeeper | None  # None: nothing claimed, nothing leased

    @property
    def device_ids(self) -> frozenset[str]:
        return frozenset(device for device, _ in self.claims)


@dataclass(frozen=True)
class Wait:
    """The job cannot start now, for `reason`: it waits in the queue."""

    reason: str


class NoCapacityNow(errors.ResourceExhausted):
    """A job's plan found no room in what the devices have free now, though the job fits them once
    other jobs let go (a placed model whose devices' compute is all reserved): the gate makes it
    wait (`AdmissionGate.wait_for_capacity`), as it does a job whose reservation is refused, rather
    than fail it as a job that can never fit."""


class AdmissionGate:
    """`quotas` None: a dispatcher without quotas or a queue (a strategy's unit tests), where a
    reservation the inventory refuses fails the job."""

    def __init__(self, inventory: Inventory, *, reservation_ttl_s: int = RESERVATION_TTL_S,
                 quotas: Quotas | None = None, queue_timeout_s: float = DEFAULT_QUEUE_TIMEOUT_S,
                 max_queued: int = DEFAULT_MAX_QUEUED, max_queued_bytes: int = DEFAULT_MAX_QUEUED_BYTES,
                 metrics: DispatchMetrics = NO_METRICS, clock: Callable[[], float] = time.time):
        if not queue_timeout_s > 0:
            raise errors.InvalidArgument(f"queue_timeout_s is {queue_timeout_s}; set ACCELMESH_QUEUE_TIMEOUT_S to a "
                                         "number of seconds > 0")
        if max_queued < 1:
            raise errors.InvalidArgument(f"max_queued is {max_queued}; set ACCELMESH_MAX_QUEUED_PER_TENANT to a "
                                         "number of jobs >= 1")
        if max_queued_bytes < 0:
            raise errors.InvalidArgument(f"max_queued_bytes is {max_queued_bytes}; set "
                                         "ACCELMESH_MAX_QUEUED_BYTES_PER_TENANT to a number of bytes >= 0")
        self._inventory, self._ttl_s, self.quotas = inventory, reservation_ttl_s, quotas
        self.queue_timeout_s, self.max_queued, self.max_queued_bytes = queue_timeout_s, max_queued, max_queued_bytes
        self._metrics, self._clock = metrics, clock

    def check_priority(self, owner: str, priority: int) -> None:
        """Before a job is stored: a priority above its owner's quota's top is refused."""
        if self.quotas is not None:
            self.quotas.check_priority(owner, priority)

    def admit(self, job: m.JobRecord, live: LiveJob, claims: Sequence[tuple[str, int]]) -> Grant | Wait:
        """The owner's quota takes the claims (recorded as the job's holding), then the inventory
        reserves them, all or none; granted, the reservations are renewed until the job is done. No
        claims (a job taken over with every shard finished: it only combines what they wrote): granted
        with nothing reserved and no lease, as the inventory reserves no empty set."""
        if not claims:
            return Grant((), None)
        reserved_at = time.monotonic()
        if self.quotas is not None:
            try:
                self.quotas.admit(job.job_id, job.owner, len(claims), sum(nbytes for _, nbytes in claims))
            except OverQuota as exc:
                return self._refused(job, f"quota: {exc}")
        try:
            self._inventory.reserve(job.job_id, claims, self._ttl_s)
        except errors.ResourceExhausted as exc:
            if self.quotas is None:
                raise
            return self._refused(job, f"devices: {exc}")
        if job.queue is not None:  # it waited in the queue: for how long
            self._metrics.queue_wait(time.time() - job.queue.since)
        live.lease = LeaseKeeper(self._inventory, job.job_id, [device for device, _ in claims], self._ttl_s, live,
                                 reserved_at=reserved_at)
        return Grant(tuple(claims), live.lease)

    def wait_for_capacity(self, job: m.JobRecord, exc: NoCapacityNow) -> Wait:
        """The job could not be planned on what is free now (`exc`): it waits in the queue, or,
        like a refused reservation, fails where it may not wait (no queue here, a queue_timeout of
        0 s, its owner's places in the queue all taken)."""
        if self.quotas is None:
            raise exc
        return self._refused(job, f"devices: {exc}")

    def _refused(self, job: m.JobRecord, reason: str) -> Wait:
        """Wait, or RESOURCE_EXHAUSTED for a job that may not wait or whose owner's places in the
        queue are all taken (jobs, or the bytes their inputs take). A job that was queued before goes
        back whatever the count: its place was granted once. A new job's place is taken here, in the
        job book's database (Quotas.take_queue_place), before its inputs are stored: every replica
        and thread counts every place taken before it, so the bound holds however many ask at once."""
        if job.spec.queue_timeout_s == 0:
            raise errors.ResourceExhausted(f"{reason} (the job was not queued: its spec.queue_timeout is 0 s)")
        if job.queue is None:
            nbytes = input_bytes(job.spec)
            taken = self.quotas.take_queue_place(job.job_id, job.owner, nbytes, self._clock(),
                                                 max_jobs=self.max_queued, max_bytes=self.max_queued_bytes)
            if taken is not None:
                raise self._queue_full(job, reason, nbytes, *taken)
        return Wait(reason)

    def _queue_full(self, job: m.JobRecord, reason: str, nbytes: int, places: int,
                    held: int) -> errors.ResourceExhausted:
        who = job.owner or "its owner"
        if places >= self.max_queued:
            why = (f"{who} has {places} jobs queued already, the most one tenant may "
                   f"(ACCELMESH_MAX_QUEUED_PER_TENANT={self.max_queued})")
        elif nbytes > self.max_queued_bytes:
            why = (f"its inputs take {nbytes:,} bytes, more than one tenant's queued jobs may take together "
                   f"(ACCELMESH_MAX_QUEUED_BYTES_PER_TENANT={self.max_queued_bytes:,}); submit it in smaller jobs")
        else:
            why = (f"{who}'s queued jobs' inputs take {held:,} bytes already and this job's {nbytes:,} more, past "
                   f"what one tenant's may take together (ACCELMESH_MAX_QUEUED_BYTES_PER_TENANT="
                   f"{self.max_queued_bytes:,})")
        return errors.ResourceExhausted(
            f"{reason}, and the job was not queued: {why}; wait for some of them to start, or cancel some "
            "(accelmesh jobs cancel)", reason=errors.QUEUE_FULL)

    def deadline(self, job: m.JobRecord, now: float) -> float:
        """When the job gives up waiting: its first queueing's deadline, kept when it is queued again."""
        if job.queue is not None:
            return job.queue.deadline
        timeout = job.spec.queue_timeout_s
        return now + (self.queue_timeout_s if timeout is None else timeout)
