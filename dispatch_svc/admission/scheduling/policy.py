"""Cross-job scheduling: which jobs get which type of device this round, when several jobs want one
heterogeneous pool (K80s beside V100s: a job may run 10x faster on one type and 1.1x on another).

Each policy is a pure, deterministic function of (jobs, pool, throughputs) (problem.py) returning
an Allocation: for every job, `scale_factor` devices of one type, or nothing this round. A
scheduler calls one every round (Gavel uses 6-minute rounds) with every job that wants devices,
running or queued, and the devices the round may hand out; a job is preempted when it gets
nothing or another type. None of them ever hands out more devices of a type than the pool has,
or a type the job has no throughput figure for.

- `fifo`: the baseline. Jobs by priority (higher first), then arrival, then id; each takes the
  fastest type (its own steps/s) with room for all its devices, ties to the first by name. A
  job that does not fit waits and later ones may take what is left (backfilling). O(J K + J log J).
- `max_min_fairness`: Gavel's heterogeneity-aware max-min fairness (its LAS policy). The LP of
  fair_shares.py gives each job the fraction X[j, k] of time it should spend on each type so as
  to maximise the worst job's throughput relative to an equal split of the pool, weighted by
  priority; `assign_by_shares` turns X into this round's integral assignment the way Gavel's
  round mechanism does: (job, type) pairs by X[j, k] over the fraction of rounds the job has
  received on k so far (never yet: first), ties by larger X, higher priority, then arrival and
  id; a pair is taken when the job has nothing yet and the type has room. Devices still free
  after that go to the waiting jobs in `fifo` order (work conservation: Gavel leaves them idle
  until its next allocation; here a job outside its share may borrow them for one round). The
  LP dominates the cost: two sparse LPs of up to J K + 1 variables and 2J + K rows (HiGHS), then
  O(J K log(J K)) for the rounding.
- `min_total_time`: a cheap greedy for throughput rather than fairness: (job, type) pairs by
  priority, then by the job's speed-up on the type over its slowest usable type (largest first:
  a type goes to the jobs it speeds up most), then by the time the job would need to finish
  there (shortest first), then arrival and id. Like `fifo` it may leave a slow-to-gain job
  waiting for as long as others gain more. O(J K log(J K)).

Priorities: `fifo` and `min_total_time` serve a higher priority strictly first; max-min fairness
weights the LP by it (a priority-2 job is owed twice the normalised throughput of a priority-1
job), as Gavel does.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np

from dispatch_svc.admission.scheduling.fair_shares import FairShares, max_min_shares
from dispatch_svc.admission.scheduling.problem import Allocation, Job, Problem, Throughputs, build_problem

FIFO, MAX_MIN_FAIRNESS, MIN_TOTAL_TIME = "fifo", "max_min_fairness", "min_total_time"

# A share below this is the LP's rounding noise, not time owed.
MIN_SHARE = 1e-6

Policy = Callable[[Sequence[Job], Mapping[str, int], Throughputs], Allocation]


def fifo(jobs: Sequence[Job], pool: Mapping[str, int], throughputs: Throughputs) -> Allocation:
    """By priority, then arrival: each job takes its fastest type with room (see the module)."""
    problem = build_problem(jobs, pool, throughputs)
    chosen = np.full(len(problem.ids), -1, np.int64)
    _fill_in_order(problem, chosen, problem.counts.copy())
    return problem.allocation(FIFO, chosen, _one_hot(problem, chosen))


def max_min_fairness(jobs: Sequence[Job], pool: Mapping[str, int], throughputs: Throughputs) -> Allocation:
    """Gavel's heterogeneity-aware max-min fairness, rounded to this round (see the module)."""
    problem = build_problem(jobs, pool, throughputs)
    return assign_by_shares(problem, max_min_shares(problem))


def min_total_time(jobs: Sequence[Job], pool: Mapping[str, int], throughputs: Throughputs) -> Allocation:
    """Each type to the jobs it speeds up most (see the module)."""
    problem = build_problem(jobs, pool, throughputs)
    pair_job, pair_type = np.nonzero(problem.usable)
    rates = problem.rates[pair_job, pair_type]
    slowest = np.where(problem.usable, problem.rates, np.inf).min(axis=1)
    speedup = rates / slowest[pair_job]
    finish_s = problem.remaining[pair_job] / rates
    order = np.lexsort((pair_type, pair_job, finish_s, -speedup, -problem.weight[pair_job]))
    chosen = np.full(len(problem.ids), -1, np.int64)
    _take_pairs(problem, chosen, problem.counts.copy(), pair_job[order], pair_type[order])
    return problem.allocation(MIN_TOTAL_TIME, chosen, _one_hot(problem, chosen))


def assign_by_shares(problem: Problem, fair: FairShares) -> Allocation:
    """This round's assignment from the LP's shares and the rounds each job has received (Gavel's
    priorities X / fraction received), then the free devices in `fifo` order."""
    shares = fair.shares
    pair_job, pair_type = np.nonzero(problem.usable & (shares > MIN_SHARE))
    owed = shares[pair_job, pair_type]
    seen = problem.seen[pair_job]
    received = np.divide(problem.received[pair_job, pair_type], seen, out=np.zeros(len(owed)), where=seen > 0)
    priority = np.divide(owed, received, out=np.full(len(owed), np.inf), where=received > 0)
    order = np.lexsort((pair_type, pair_job, -problem.weight[pair_job], -owed, -priority))
    chosen = np.full(len(problem.ids), -1, np.int64)
    free = problem.counts.copy()
    _take_pairs(problem, chosen, free, pair_job[order], pair_type[order])
    _fill_in_order(problem, chosen, free)
    return problem.allocation(MAX_MIN_FAIRNESS, chosen, shares)


POLICIES: dict[str, Policy] = {FIFO: fifo, MAX_MIN_FAIRNESS: max_min_fairness, MIN_TOTAL_TIME: min_total_time}


def _take_pairs(problem: Problem, chosen: np.ndarray, free: np.ndarray, jobs: np.ndarray, types: np.ndarray) -> None:
    """Walk (job, type) pairs in order: a job with nothing yet takes the type if it has room."""
    scale = problem.scale
    for j, k in zip(jobs.tolist(), types.tolist()):
        if chosen[j] < 0 and free[k] >= scale[j]:
            chosen[j] = k
            free[k] -= scale[j]


def _fill_in_order(problem: Problem, chosen: np.ndarray, free: np.ndarray) -> None:
    """Jobs with nothing yet, by priority then arrival: each takes its fastest type with room."""
    for j in np.lexsort((np.arange(len(problem.ids)), -problem.weight)).tolist():
        if chosen[j] >= 0:
            continue
        fits = problem.usable[j] & (free >= problem.scale[j])
        if fits.any():
            k = int(np.argmax(np.where(fits, problem.rates[j], -1.0)))  # equal rates: the first type by name
            chosen[j] = k
            free[k] -= problem.scale[j]


def _one_hot(problem: Problem, chosen: np.ndarray) -> np.ndarray:
    shares = np.zeros(problem.usable.shape)
    placed = np.flatnonzero(chosen >= 0)
    shares[placed, chosen[placed]] = 1.0
    return shares
