"""Cross-job scheduling: which jobs get which type of device each round when several want one
heterogeneous pool (policy.py: FIFO, Gavel's max-min fairness, a min-total-time greedy)."""

from dispatch_svc.admission.scheduling.fair_shares import FairShares, SolverFailed, max_min_shares
from dispatch_svc.admission.scheduling.policy import (
    FIFO,
    MAX_MIN_FAIRNESS,
    MIN_TOTAL_TIME,
    POLICIES,
    Policy,
    assign_by_shares,
    fifo,
    max_min_fairness,
    min_total_time,
)
from dispatch_svc.admission.scheduling.problem import (
    Allocation,
    Assignment,
    InvalidSchedulingInput,
    Job,
    Problem,
    Throughputs,
    build_problem,
)

__all__ = [
    "FIFO",
    "MAX_MIN_FAIRNESS",
    "MIN_TOTAL_TIME",
    "POLICIES",
    "Allocation",
    "Assignment",
    "FairShares",
    "InvalidSchedulingInput",
    "Job",
    "Policy",
    "Problem",
    "SolverFailed",
    "Throughputs",
    "assign_by_shares",
    "build_problem",
    "fifo",
    "max_min_fairness",
    "max_min_shares",
    "min_total_time",
]
