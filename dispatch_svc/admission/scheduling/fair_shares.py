"""Gavel's heterogeneity-aware max-min fairness as a linear program (Narayanan et al., OSDI '20,
"Heterogeneity-Aware Cluster Scheduling Policies for Deep Learning Workloads", section 4.1).

X[j, k] is the fraction of time job j spends on device type k. Job j then makes
throughput(j, X) = sum_k T[j, k] X[j, k] steps/s. Its equal share X_eq gives each of the J jobs
in the LP 1/J of every type's devices: a job of scale factor s_j on c_k / J devices of type k runs
X_eq[j, k] = c_k / (J s_j) of the time there, the row scaled down to sum to 1 where it is larger
(a job cannot run more than all the time). The LP is

    maximise t  subject to  throughput(j, X) / throughput(j, X_eq) >= w_j t   for every job j
                            sum_k X[j, k] <= 1                                 (one type at a time)
                            sum_j s_j X[j, k] <= c_k                           (devices of type k)
                            0 <= X[j, k] <= 1, and X[j, k] = 0 where j cannot use k

so a job that takes 8 devices counts its equal share as 8 times less time than a 1-device job,
as Gavel's scale-factor weighting does. w_j is the job's priority: at the optimum a job of
priority 2 gets at least twice the normalised throughput of a priority-1 job (Gavel's priority
weights). Max-min fixes only the worst job's share; among the optima a second LP keeps every
job at w_j t* (less 1e-6 relative, below HiGHS's tolerances) and maximises the sum of the
normalised throughputs over w_j, so no share is left idle that some job could use.

Jobs that can use no type in the pool (no figure, or fewer devices of every type they have a
figure for than they ask for) are left out of the LP and get no share. Variables: one per usable
(job, type) pair plus t, 2J + K constraints, all sparse; HiGHS solves 1,000 jobs over 5 types in
well under a second (bench/cluster.py times it).

scipy's `linprog(method="highs")` solves it: scipy is installed as a dependency of jax (and named
in pyproject.toml for the placement planner's bound), so there is no LP of our own.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from dispatch_svc.admission.scheduling.problem import Problem

if TYPE_CHECKING:
    from scipy import sparse

# The second LP keeps every job at this fraction of the first LP's level: far enough below it that
# HiGHS's feasibility tolerance (1e-7) cannot make the first optimum infeasible.
LEVEL_SLACK = 1e-6

# Every solve runs on this one thread: HiGHS keeps scheduler state per calling thread and does not
# hand all of it back (see dispatch_svc/planner/layer_model.py's _SOLVER, measured under fuzzing).
_SOLVER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fair-shares-lp")


class SolverFailed(RuntimeError):
    """HiGHS did not return an optimum for an LP that always has one (X = 0, t = 0 is feasible and t
    is bounded): a numerical failure, which is a bug to report with the inputs."""


@dataclass
class FairShares:
    """The LP's answer: X (J, K) in the Problem's order, the level t*, and each job's normalised
    throughput throughput(j, X) / throughput(j, X_eq) (0 for jobs left out)."""

    shares: np.ndarray
    level: float
    normalised: np.ndarray


def equal_share_throughput(problem: Problem, in_lp: np.ndarray) -> np.ndarray:
    """throughput(j, X_eq) for the jobs in `in_lp` (the pool split equally among them); 0 elsewhere."""
    jobs = int(in_lp.sum())
    if jobs == 0:
        return np.zeros(len(problem.ids))
    equal = problem.counts[None, :] / (jobs * problem.scale[:, None])
    equal = equal / np.maximum(equal.sum(axis=1, keepdims=True), 1.0)
    return np.where(in_lp, (np.where(problem.usable, problem.rates, 0.0) * equal).sum(axis=1), 0.0)


def max_min_shares(problem: Problem) -> FairShares:
    """Solve the LP above for `problem`; jobs that can use nothing get a zero row."""
    from scipy import sparse  # scipy takes 0.7 s to import: only a process that solves pays it

    n, k = problem.usable.shape
    shares = np.zeros((n, k))
    in_lp = problem.usable.any(axis=1)
    if not in_lp.any():
        return FairShares(shares, 0.0, np.zeros(n))
    baseline = equal_share_throughput(problem, in_lp)
    rows = np.flatnonzero(in_lp)
    pair_job, pair_type = np.nonzero(problem.usable)  # every usable pair belongs to a job in the LP
    pair_row = (np.cumsum(in_lp) - 1)[pair_job]  # the job's row among the LP's
    gain = problem.rates[pair_job, pair_type] / baseline[pair_job]  # normalised throughput per unit of time
    weight = problem.weight[rows]
    m, p = len(rows), len(pair_job)
    columns = np.arange(p)
    # The three constraint blocks over the pair variables: -normalised throughput, time, devices.
    throughput = sparse.csr_array((-gain, (pair_row, columns)), shape=(m, p))
    time = sparse.csr_array((np.ones(p), (pair_row, columns)), shape=(m, p))
    devices = sparse.csr_array((problem.scale[pair_job].astype(float), (pair_type, columns)), shape=(k, p))
    capacity = np.concatenate([np.ones(m), problem.counts.astype(float)])

    # First LP: variables (x, t); minimise -t.
    level_column = sparse.csr_array(weight.reshape(m, 1))
    a_ub = sparse.vstack([sparse.hstack([throughput, level_column]),
                          sparse.hstack([sparse.vstack([time, devices]), sparse.csr_array((m + k, 1))])]).tocsc()
    objective = np.zeros(p + 1)
    objective[-1] = -1.0
    bounds = np.column_stack([np.zeros(p + 1), np.append(np.ones(p), np.inf)])
    first = _solve(objective, a_ub, np.concatenate([np.zeros(m), capacity]), bounds)
    level = float(first[-1])
    x = first[:p]

    # Second LP: every job kept at its level, the sum of normalised throughput / w_j maximised.
    floor = weight * level * (1 - LEVEL_SLACK)
    second = _solve(-gain / weight[pair_row], sparse.vstack([throughput, time, devices]).tocsc(),
                    np.concatenate([-floor, capacity]), np.column_stack([np.zeros(p), np.ones(p)]),
                    fallback=x)
    shares[pair_job, pair_type] = np.clip(second, 0.0, 1.0)
    normalised = np.zeros(n)
    normalised[rows] = (problem.rates[rows] * shares[rows]).sum(axis=1) / baseline[rows]
    return FairShares(shares, level, normalised)


def _solve(objective: np.ndarray, a_ub: sparse.csc_array, b_ub: np.ndarray, bounds: np.ndarray,
           fallback: np.ndarray | None = None) -> np.ndarray:
    from scipy.optimize import linprog

    result = _SOLVER.submit(linprog, objective, A_ub=a_ub, b_ub=b_ub, bounds=bounds, method="highs").result()
    if result.status == 0:
        return result.x
    if fallback is not None:  # the first LP's optimum is feasible for the second: keep it
        return fallback
    raise SolverFailed(f"HiGHS found no optimum for the max-min fairness LP (status {result.status}: "
                       f"{result.message}); report the jobs, pool and throughput table that caused it")
