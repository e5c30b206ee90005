"""What a scheduling policy is asked and what it answers: the jobs, the pool, the throughput table,
their checks, and the allocation a policy returns.

Every policy (policy.py) takes the same three inputs: the jobs that want devices now (queued and
running alike: each round reallocates the whole pool, as Gavel's rounds do), the pool (devices of
each type that this round may hand out) and a throughput table (job type -> device type -> the
job's steps/s on `scale_factor` devices of that type). They are checked here once, with errors
that name the field and the fix, and turned into numpy arrays (`Problem`) in one canonical order,
jobs by (arrival, id) and device types by name, so that a policy's answer depends on the inputs
and never on the order they were listed in.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from accelmesh.errors import InvalidArgument, quoted

# A job type's steps/s on each device type; a device type a row leaves out is one it cannot use.
Throughputs = Mapping[str, Mapping[str, float]]


class InvalidSchedulingInput(InvalidArgument, ValueError):
    """A job, the pool or the throughput table is malformed: INVALID_ARGUMENT at the service's
    edge, and a ValueError to plain Python callers."""


@dataclass(frozen=True)
class Job:
    """One job that wants devices this round."""

    id: str
    job_type: str  # a row of the throughput table
    scale_factor: int = 1  # devices of one type it runs on at once (all or none)
    priority: float = 1.0  # > 0; larger is more important (how each policy uses it: policy.py)
    arrival_s: float = 0.0  # when it was submitted, on any clock every job shares
    remaining_steps: float = math.inf  # work left; inf when unknown (min_total_time ranks by it)
    rounds_seen: int = 0  # rounds it has been in the cluster so far, run or not (max-min's rounding)
    rounds_received: Mapping[str, int] = field(default_factory=dict)  # rounds it ran on each device type


@dataclass(frozen=True)
class Assignment:
    """What a job gets this round: `count` devices of one type."""

    device_type: str
    count: int


@dataclass
class Allocation:
    """A policy's answer for one round.

    `assignments` has every job's id, in the canonical order (arrival, then id): its Assignment, or
    None when it waits this round. `shares` is the fraction of time on each device type the policy
    aims to give the job over many rounds: the LP's X for max-min fairness, 1.0 on the type given
    for the greedy policies (types with no share are left out)."""

    policy: str
    assignments: dict[str, Assignment | None]
    shares: dict[str, dict[str, float]]

    def assigned(self) -> dict[str, Assignment]:
        return {job: a for job, a in self.assignments.items() if a is not None}

    def devices_used(self) -> dict[str, int]:
        used: dict[str, int] = {}
        for a in self.assigned().values():
            used[a.device_type] = used.get(a.device_type, 0) + a.count
        return used


@dataclass
class Problem:
    """The checked inputs as arrays; row j is job `ids[j]`, column k is device type `types[k]`."""

    ids: tuple[str, ...]
    types: tuple[str, ...]
    counts: np.ndarray  # (K,) int: devices of each type this round
    rates: np.ndarray  # (J, K) steps/s; 0 where the table gives no figure
    usable: np.ndarray  # (J, K) bool: a figure, and at least scale_factor devices of the type
    scale: np.ndarray  # (J,) int
    weight: np.ndarray  # (J,) priority
    arrival: np.ndarray  # (J,)
    remaining: np.ndarray  # (J,) steps; inf when unknown
    seen: np.ndarray  # (J,) rounds_seen
    received: np.ndarray  # (J, K) rounds_received

    def allocation(self, policy: str, chosen: np.ndarray, shares: np.ndarray) -> Allocation:
        """The Allocation for `chosen` (J,) type index per job, -1 for none, and `shares` (J, K)."""
        assignments = {job: None if k < 0 else Assignment(self.types[k], int(self.scale[j]))
                       for j, (job, k) in enumerate(zip(self.ids, chosen.tolist()))}
        share_rows = {job: {self.types[k]: float(shares[j, k]) for k in np.flatnonzero(shares[j] > 0).tolist()}
                      for j, job in enumerate(self.ids)}
        return Allocation(policy, assignments, share_rows)


def build_problem(jobs: Sequence[Job], pool: Mapping[str, int], throughputs: Throughputs) -> Problem:
    """Check the inputs (InvalidSchedulingInput naming the field and the fix) and lay them out."""
    types = tuple(sorted(pool))
    column = {t: k for k, t in enumerate(types)}
    counts = np.array([_count(pool[t], f"pool[{quoted(t)}]") for t in types], np.int64)
    _check_table(throughputs, column)
    ordered = _ordered_jobs(jobs)
    n, k = len(ordered), len(types)
    rates = np.zeros((n, k))
    received = np.zeros((n, k))
    for j, (index, job) in enumerate(ordered):
        where = f"jobs[{index}]"
        row = throughputs.get(job.job_type)
        if row is None:
            raise _bad(f"{where}.job_type {quoted(job.job_type)} has no row in the throughput table; add its "
                       f"steps/s on each device type it can run on", f"{where}.job_type")
        for device_type, steps_per_s in row.items():
            rates[j, column[device_type]] = steps_per_s
        for device_type, rounds in job.rounds_received.items():
            if device_type not in column:
                raise _bad(f"{where}.rounds_received names device type {quoted(device_type)}, which the pool "
                           f"lacks; list it in the pool (0 when none are free)", f"{where}.rounds_received")
            received[j, column[device_type]] = _count(rounds, f"{where}.rounds_received[{quoted(device_type)}]")
    scale = np.array([job.scale_factor for _, job in ordered], np.int64).reshape(n)
    return Problem(
        ids=tuple(job.id for _, job in ordered), types=types, counts=counts, rates=rates,
        usable=(rates > 0) & (scale[:, None] <= counts[None, :]), scale=scale,
        weight=np.array([job.priority for _, job in ordered], float).reshape(n),
        arrival=np.array([job.arrival_s for _, job in ordered], float).reshape(n),
        remaining=np.array([job.remaining_steps for _, job in ordered], float).reshape(n),
        seen=np.array([job.rounds_seen for _, job in ordered], float).reshape(n),
        received=received,
    )


def _ordered_jobs(jobs: Sequence[Job]) -> list[tuple[int, Job]]:
    seen: set[str] = set()
    for index, job in enumerate(jobs):
        where = f"jobs[{index}]"
        if not isinstance(job.id, str) or not job.id:
            raise _bad(f"{where}.id is {quoted(job.id)}: give every job a non-empty string id", f"{where}.id")
        if job.id in seen:
            raise _bad(f"{where}.id {quoted(job.id)} is listed twice: list each job once", f"{where}.id")
        seen.add(job.id)
        if isinstance(job.scale_factor, bool) or not isinstance(job.scale_factor, (int, np.integer)) \
                or job.scale_factor < 1:
            raise _bad(f"{where}.scale_factor is {quoted(job.scale_factor)}: give the whole number of devices "
                       f"(>= 1) the job runs on", f"{where}.scale_factor")
        if not (math.isfinite(job.priority) and job.priority > 0):
            raise _bad(f"{where}.priority is {quoted(job.priority)}: give a finite weight > 0 (1 for a normal "
                       f"job)", f"{where}.priority")
        if not math.isfinite(job.arrival_s):
            raise _bad(f"{where}.arrival_s is {quoted(job.arrival_s)}: give the finite time the job was "
                       f"submitted", f"{where}.arrival_s")
        if math.isnan(job.remaining_steps) or job.remaining_steps < 0:
            raise _bad(f"{where}.remaining_steps is {quoted(job.remaining_steps)}: give the steps left (>= 0), "
                       f"or inf when unknown", f"{where}.remaining_steps")
        _count(job.rounds_seen, f"{where}.rounds_seen")
    return sorted(enumerate(jobs), key=lambda item: (item[1].arrival_s, item[1].id))


def _check_table(throughputs: Throughputs, column: Mapping[str, int]) -> None:
    for job_type, row in throughputs.items():
        where = f"throughputs[{quoted(job_type)}]"
        if not row:
            raise _bad(f"{where} is empty: give the job type's steps/s on at least one device type, or drop "
                       f"the row", where)
        for device_type, steps_per_s in row.items():
            at = f"{where}[{quoted(device_type)}]"
            if device_type not in column:
                raise _bad(f"{at}: device type {quoted(device_type)} is not in the pool; list it in the pool "
                           f"(0 when none are free) or drop it from the table", at)
            if isinstance(steps_per_s, bool) or not isinstance(steps_per_s, (int, float, np.number)) \
                    or not (math.isfinite(steps_per_s) and steps_per_s > 0):
                raise _bad(f"{at} is {quoted(steps_per_s)}: give a finite steps/s > 0, or leave the device type "
                           f"out of the row if the job type cannot run on it", at)


def _count(value: object, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise _bad(f"{where} is {quoted(value)}: a count must be a whole number >= 0", where)
    return int(value)


def _bad(message: str, where: str) -> InvalidSchedulingInput:
    return InvalidSchedulingInput(message, field=where)
