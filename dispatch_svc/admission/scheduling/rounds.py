"""The queue's scheduling round: when several queued jobs could start at once, which type of device
each one gets, by the dispatcher's policy (policy.py), from a throughput table of each program on
each device type.

A queue pass (queue.py) that has two or more jobs to try asks `Round.assign` first. The round sees
the pool as the inventory has it now: every healthy device that no reservation holds, counted by
type; and for each job, the devices its own constraints allow. It builds one policy problem
(problem.py) with a row per job (its program's rates on the types it may use: two jobs of one
program may allow different types), priority = spec.priority + 1 (the policies want a weight
> 0), arrival = when it was first queued, scale_factor = spec.constraints.max_devices (1 when the
job sets none: it can run on one device and uses more when it gets them). The policy's
Allocation becomes a `Narrowing` per job: the free devices it may plan on. They are scale_factor
devices of the type the policy gave it, the other free devices of that type shared out among the
jobs given it (in the policy's order), and every free device of a type the policy gave no job, to
the first job in that order that can run on it. The job's stored spec is not changed: the
narrowing is a hint to this one try of planning (data_parallel.start), and a job that goes back
to the queue is narrowed afresh at its next try; a job whose devices were taken meanwhile plans
on all its constraints allow. Jobs the round gives nothing are tried after the others,
unnarrowed, on what is left (first fit, so no device stays idle while a queued job could use
it). No job is preempted: a running job keeps its devices until it ends, and the policy only
decides which waiting job gets which of the free devices (bench/cluster.py's `queue` runs).

Throughputs, rows per second of one device, by what is known best:
1. the operator's table (ACCELMESH_SCHEDULING_THROUGHPUTS, a TOML file: a table per program name,
   device type = rows/s; profiled figures, as Gavel's throughput matrix is), for the programs and
   types it lists;
2. the rates measured from this dispatcher's shards (planner/throughput.py's fits), and for the
   types not measured yet the catalog's peak rate at the job's compute dtype scaled as the
   measured types compare with their own catalog figures (ThroughputModel.rates);
3. without either, the catalog's peak rates alone: a relative speed, which is all the policies
   need (each compares a job's rates with each other, never across programs in absolute units,
   except min_total_time's finish time, which then ranks by relative speed).

`min_total_time` (the default) gives each type to the jobs it speeds up most, `max_min_fairness`
is Gavel's heterogeneity-aware max-min fairness, `fifo` the baseline (each job its fastest type,
by priority then arrival); `first_fit` (ACCELMESH_SCHEDULING_POLICY=first_fit) turns rounds off:
every job is tried on every device its constraints allow, in priority order, as a pass does for
a lone job.
"""

from __future__ import annotations

import logging
import math
import tomllib
from collections.abc import Callable, Mapping, Sequence, Set
from dataclasses import dataclass
from pathlib import Path

from accelmesh import errors
from accelmesh.errors import quoted
from dispatch_svc.admission.scheduling.policy import POLICIES
from dispatch_svc.admission.scheduling.problem import Job
from dispatch_svc.jobs import records as m
from dispatch_svc.planner import Target, ThroughputModel
from dispatch_svc.ports import Inventory, JobDevice

log = logging.getLogger(__name__)

FIRST_FIT = "first_fit"
POLICY_NAMES = (FIRST_FIT, *POLICIES)
# Without preemption (a running job keeps its devices), bench/cluster.py's "queue" runs measure the
# greedy ahead: on Gavel's trace at 0.7 jobs/h it cuts the mean completion time to 0.79 of FIFO's
# and the worst slowdown from 254x to 158x, where max-min fairness, whose shares assume time
# slicing, gives 0.97 and 290x (preemptive rounds: 0.57 both).
DEFAULT_POLICY = "min_total_time"


@dataclass(frozen=True)
class Narrowing:
    """What a round gave a job: these free devices (`device_ids`), of the types in `types` (type,
    count), by `policy`. Planning keeps to them (data_parallel.plan's `only`)."""

    device_ids: frozenset[str]
    types: tuple[tuple[str, int], ...]
    policy: str

    @property
    def device_type(self) -> str:
        """The type the policy chose (the first; the others are types no job was given)."""
        return self.types[0][0]

    def describe(self) -> str:
        given = " and ".join(f"{count} {device_type}" for device_type, count in self.types)
        return f"the queue's {self.policy} policy gave it {given} device(s)"


@dataclass(frozen=True)
class Waiting:
    """A queued job as a round sees it."""

    job_id: str
    spec: m.JobSpec
    since: float  # when it was first queued


def check_policy(name: str) -> str:
    if name not in POLICY_NAMES:
        raise errors.InvalidArgument(f"scheduling policy {quoted(name)} is not one of {', '.join(POLICY_NAMES)}; "
                                     "set ACCELMESH_SCHEDULING_POLICY to one of them", field="scheduling_policy")
    return name


def load_throughputs(path: str | Path) -> dict[str, dict[str, float]]:
    """The operator's table: `[program]` tables of `device-type = rows/s`, each > 0."""
    try:
        with open(path, "rb") as f:
            doc = tomllib.load(f)
    except OSError as exc:
        raise errors.InvalidArgument(f"ACCELMESH_SCHEDULING_THROUGHPUTS: cannot read {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise errors.InvalidArgument(f"ACCELMESH_SCHEDULING_THROUGHPUTS: {path} is not TOML: {exc}") from None
    table: dict[str, dict[str, float]] = {}
    for program, row in doc.items():
        if not isinstance(row, dict) or not row:
            raise errors.InvalidArgument(
                f"ACCELMESH_SCHEDULING_THROUGHPUTS: {path}: [{program}] must be a table of device-type = rows/s, "
                f'e.g. [{program}] followed by a100-80gb = 1200.0')
        for device_type, rate in row.items():
            if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not (math.isfinite(rate) and rate > 0):
                raise errors.InvalidArgument(
                    f"ACCELMESH_SCHEDULING_THROUGHPUTS: {path}: [{program}] {device_type} is {rate!r}; give the "
                    "program's rows/s on one device of that type, a number > 0")
        table[program] = {str(t): float(r) for t, r in row.items()}
    return table


class Round:
    """One dispatcher's scheduling rounds (see the module)."""

    def __init__(self, policy: str, inventory: Inventory, throughput: ThroughputModel, reserved: Callable[[], Set[str]],
                 table: Mapping[str, Mapping[str, float]] | None = None):
        """`reserved()`: the ids of the devices a reservation holds now (GrpcInventory.reserved_device_ids)."""
        self.policy = check_policy(policy)
        self._inventory, self._throughput, self._reserved = inventory, throughput, reserved
        self._table = dict(table or {})

    def assign(self, jobs: Sequence[Waiting]) -> list[tuple[str, Narrowing | None]]:
        """The jobs in the order to try them, each with its narrowing (None: unnarrowed, after the
        others). The order is the policy's for the jobs it gave a type, then the queue's."""
        if self.policy == FIRST_FIT or len(jobs) < 2:
            return [(job.job_id, None) for job in jobs]
        narrowed = [job for job in jobs if job.spec.placement is None]  # a pipeline places itself across types
        busy = self._reserved()
        allowed: dict[m.Constraints, list[JobDevice]] = {}
        for job in narrowed:
            if job.spec.constraints not in allowed:
                allowed[job.spec.constraints] = [d for d in self._inventory.candidate_devices(job.spec.constraints)
                                                 if d.id not in busy]
        # Every free device some job may use, once, by id; their types make the pool.
        free = sorted({d.id: d for devices in allowed.values() for d in devices}.values(), key=lambda d: d.id)
        pool: dict[str, int] = {}
        free_ids: dict[str, list[str]] = {}
        specimen: dict[str, JobDevice] = {}  # a device of each type: its catalog figures price the type
        for d in free:
            pool[d.spec.type] = pool.get(d.spec.type, 0) + 1
            free_ids.setdefault(d.spec.type, []).append(d.id)
            specimen.setdefault(d.spec.type, d)
        table: dict[str, dict[str, float]] = {}
        policy_jobs = []
        for job in narrowed:
            kinds = {d.spec.type for d in allowed[job.spec.constraints]}
            row = {t: r for t, r in self._rates(job.spec, {t: specimen[t] for t in kinds}).items() if r > 0}
            if not row:
                continue
            job_type = job.job_id  # one row per job: two jobs of one program may allow different types
            table[job_type] = row
            policy_jobs.append(Job(job.job_id, job_type, scale_factor=max(1, job.spec.constraints.max_devices),
                                   priority=job.spec.priority + 1.0, arrival_s=job.since))
        if len(policy_jobs) < 2:
            return [(job.job_id, None) for job in jobs]
        allocation = POLICIES[self.policy](policy_jobs, pool, table)
        given = allocation.assigned()
        counts = {job: a.count for job, a in given.items()}
        on_type: dict[str, list[str]] = {}
        for job, a in given.items():
            on_type.setdefault(a.device_type, []).append(job)
        for device_type, holders in on_type.items():  # the type's spare devices, shared out in the policy's order
            spare = pool[device_type] - sum(given[job].count for job in holders)
            for i in range(spare):
                counts[holders[i % len(holders)]] += 1
        spec_of = {job.job_id: job.spec for job in narrowed}
        ids: dict[str, list[str]] = {job: [] for job in given}
        types: dict[str, list[tuple[str, int]]] = {job: [] for job in given}

        def hand_out(job: str, device_type: str, count: int) -> None:
            mine = {d.id for d in allowed[spec_of[job].constraints]}
            taken = [i for i in free_ids[device_type] if i in mine][:count]
            free_ids[device_type] = [i for i in free_ids[device_type] if i not in taken]
            ids[job] += taken
            if taken:
                types[job].append((device_type, len(taken)))
        for job, a in given.items():
            hand_out(job, a.device_type, counts[job])
        for device_type in sorted(set(pool) - set(on_type)):  # a type no job was given: to the first that can use it
            for job in given:
                if device_type in table[job]:
                    hand_out(job, device_type, pool[device_type])
                    break
        log.info("scheduling round (%s) over %d queued jobs and %s free: %s", self.policy, len(policy_jobs), pool,
                 {job: types[job] for job in given})
        first = [(job, Narrowing(frozenset(ids[job]), tuple(types[job]), self.policy)) for job in given if ids[job]]
        placed = {job for job, _ in first}
        return first + [(job.job_id, None) for job in jobs if job.job_id not in placed]

    def _rates(self, spec: m.JobSpec, types: Mapping[str, JobDevice]) -> dict[str, float]:
        """The program's rows/s on one device of each type (see the module for the sources)."""
        listed = self._table.get(spec.program, {})
        measured = self._throughput.by_device_type(spec.program)
        dtype = "fp32" if spec.constraints.precision == "fp32" else None
        targets, ref = [], spec.program
        for device_type, device in types.items():
            key = measured.get(device_type)
            if key is not None:
                ref = key[0]
            compute = dtype or _fastest_dtype(device)
            targets.append(Target(key[1] if key else f"{device_type}[{compute}]", device.spec.performance, compute))
        rates = {}
        try:
            costs = self._throughput.rates(ref, targets)
        except errors.InvalidArgument:  # a device without a published peak: the table alone prices it
            costs = {}
        for (device_type, _), target in zip(types.items(), targets):
            if device_type in listed:
                rates[device_type] = listed[device_type]
            elif target.target_type in costs:
                rates[device_type] = costs[target.target_type].rows_per_second
        return rates


def _fastest_dtype(device: JobDevice) -> str:
    """The compute dtype a rule would most likely build for the device: bf16 where it has it."""
    return "bf16" if "bf16" in device.spec.capabilities else "fp32"


__all__ = ["DEFAULT_POLICY", "FIRST_FIT", "POLICY_NAMES", "Narrowing", "Round", "Waiting", "check_policy",
           "load_throughputs"]
