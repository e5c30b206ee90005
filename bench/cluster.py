"""Cluster scheduling benchmark: what heterogeneity-aware policies buy over FIFO on a mixed pool,
and what one decision costs at cluster scale.

    .venv/bin/python bench/cluster.py [--quick] [--out FILE] [--data DIR]

Prints one JSON document on stdout (progress on stderr); --out writes it to FILE as well.

(a) Simulation on Gavel's measured throughputs (../shared/data/gavel_isolated_throughputs.csv) over
    Gavel's simulated cluster, 12 K80 + 12 P100 + 12 V100. Jobs arrive as a Poisson process; each
    draws its scale factor (devices) from Gavel's Philly distribution (70% 1, 10% 2, 15% 4, 5% 8),
    its job type uniformly among the types measured at that scale factor, and its length as
    Gavel's generator does: 60 x 10^U(1.5, 3) s with probability 0.8, else 60 x 10^U(3, 4) s, on a
    V100 (steps = that time x the job's V100 steps/s). One seed, the trace's parameters in the JSON.
    Rounds of 6 minutes, as Gavel's: every round each policy (dispatch_svc.admission.scheduling) reallocates
    the pool among the jobs that have arrived and not finished; a job arriving mid-round waits for
    the next one, and a job finishing mid-round leaves its devices idle until then (both cost every
    policy alike). Reported per policy: average job completion time (JCT), makespan and slowdowns
    (JCT over the job's time alone), as ratios to FIFO's in the same run and to a lower bound: for
    JCT, each job alone from its arrival on its best type; for makespan, the larger of the latest
    such solo finish and Gavel's min-total-duration LP (every job there from the start, its time
    split among types at will). Over a sweep of arrival rates (the same jobs, closer together),
    and once with the first jobs of the trace all submitted at time 0 (Gavel's static traces,
    where makespan means most). Each trace runs twice: with Gavel's preemptive rounds
    (`policies`), and as the dispatcher's queue runs the policy (`queue`): a job keeps the
    devices it was given until it ends, and each round divides the free devices among the
    waiting jobs (dispatch_svc/admission/scheduling/rounds.py).
(b) Decision time at cluster scale: 1,000 queued jobs (the same generator) over the Alibaba PAI
    cluster's 6,742 GPUs (../shared/data/pai_machine_spec.csv), one decision of each policy with
    full input checks, median of a few, against FIFO's (ratio). Gavel measured only K80, P100 and
    V100, so each PAI type borrows a column (PAI_COLUMNS below, also in the JSON).
A section whose file is absent is null with its reason beside it; with both absent the document
says "skipped" and the exit status is still 0.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import platform
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import scipy
from common import progress, ratio
from scipy import sparse
from scipy.optimize import linprog

from dispatch_svc.admission.scheduling import (
    FIFO,
    MAX_MIN_FAIRNESS,
    POLICIES,
    Assignment,
    Job,
    assign_by_shares,
    build_problem,
    max_min_shares,
)

DATA_DIR = Path(__file__).resolve().parents[1].parent / "shared" / "data"
GAVEL_FILE = "gavel_isolated_throughputs.csv"
PAI_FILE = "pai_machine_spec.csv"

GAVEL_POOL = {"k80": 12, "p100": 12, "v100": 12}  # Gavel's 36-GPU simulated cluster
ROUND_S = 360.0  # Gavel's round
REFERENCE_TYPE = "v100"  # job lengths are drawn as time on this type, as Gavel's generator does
SEED = 1104
# Philly's scale factors as Gavel's generator draws them: (upper end of the uniform draw, devices).
SCALE_FACTORS = ((0.7, 1), (0.8, 2), (0.95, 4), (1.0, 8))
LONG_JOB_PROBABILITY = 0.2
SHORT_LOG10_MINUTES, LONG_LOG10_MINUTES = (1.5, 3.0), (3.0, 4.0)

# Each PAI GPU type -> the Gavel column whose steps/s it takes, x a factor. V100M32 is a V100 with
# 32 GB: the same chip, so the V100 figures. T4 (Turing, 8.1 FP32 TFLOPS, 320 GB/s) is nearest the
# P100 (9.3 TFLOPS, 732 GB/s) in compute and below it in memory bandwidth: the P100 figures scaled
# by the FP32 ratio 8.1 / 9.3. MISC is what PAI does not name (older, mixed GPUs): the K80 figures,
# the slowest measured, so no unknown GPU is credited with more than the oldest known one.
PAI_COLUMNS = {"P100": ("p100", 1.0), "T4": ("p100", 8.1 / 9.3), "V100": ("v100", 1.0),
               "V100M32": ("v100", 1.0), "MISC": ("k80", 1.0)}

MODES = {
    "full": {"jobs": 400, "rates_per_hour": (0.3, 0.5, 0.7), "batch_jobs": 100, "decision_jobs": 1000,
             "decision_runs": 5},
    "quick": {"jobs": 30, "rates_per_hour": (1.0,), "batch_jobs": 10, "decision_jobs": 100, "decision_runs": 2},
}


# -- the trace ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Catalog:
    """Gavel's table: steps/s per (job type, scale factor) key and device type."""

    throughputs: dict[str, dict[str, float]]  # "<job type> (scale factor <s>)" -> device type -> steps/s
    types_by_scale: dict[int, list[str]]  # scale factor -> job types measured at it

    @staticmethod
    def key(job_type: str, scale_factor: int) -> str:
        return f"{job_type} (scale factor {scale_factor})"


def read_catalog(path: Path) -> Catalog:
    throughputs: dict[str, dict[str, float]] = {}
    types_by_scale: dict[int, list[str]] = {}
    with path.open(newline="") as handle:
        reader = csv.DictReader(handle)
        columns = [c for c in reader.fieldnames or [] if c.endswith("_steps_per_s")]
        for row in reader:
            scale = int(row["scale_factor"])
            throughputs[Catalog.key(row["job_type"], scale)] = {
                c.removesuffix("_steps_per_s"): float(row[c]) for c in columns if row[c] and float(row[c]) > 0}
            types_by_scale.setdefault(scale, []).append(row["job_type"])
    return Catalog(throughputs, {s: sorted(set(t)) for s, t in sorted(types_by_scale.items())})


@dataclass(frozen=True)
class TraceJob:
    id: str
    key: str  # the throughput table's row
    scale_factor: int
    arrival_s: float
    steps: float


def generate_trace(catalog: Catalog, jobs: int, rate_per_hour: float, rng: np.random.Generator) -> list[TraceJob]:
    """Poisson arrivals; scale factor, job type and length drawn as Gavel's generator draws them."""
    trace, now = [], 0.0
    for index in range(jobs):
        now += rng.exponential(3600.0 / rate_per_hour)
        draw = rng.uniform()
        drawn = next(s for upper, s in SCALE_FACTORS if draw < upper)
        scale = max(s for s in catalog.types_by_scale if s <= drawn)  # a table without it: the next smaller
        job_type = catalog.types_by_scale[scale][int(rng.integers(len(catalog.types_by_scale[scale])))]
        low, high = LONG_LOG10_MINUTES if rng.uniform() < LONG_JOB_PROBABILITY else SHORT_LOG10_MINUTES
        run_s = 60.0 * 10 ** rng.uniform(low, high)
        key = Catalog.key(job_type, scale)
        trace.append(TraceJob(f"job-{index:05d}", key, scale, now, run_s * catalog.throughputs[key][REFERENCE_TYPE]))
    return trace


# -- the simulation -------------------------------------------------------------------------------


@dataclass
class _Running:
    job: TraceJob
    remaining: float
    seen: int = 0
    received: Counter = field(default_factory=Counter)


def simulate(trace: list[TraceJob], pool: dict[str, int], throughputs: dict, policy: str,
             preemptive: bool = True) -> dict:
    """Rounds of ROUND_S until every job has finished; completion time of each job. `preemptive`:
    each round reallocates the whole pool (Gavel); else a job keeps the devices it was given until
    it ends and each round divides the free devices among the waiting jobs (the dispatcher's queue,
    dispatch_svc/admission/scheduling/rounds.py)."""
    pending = sorted(trace, key=lambda j: j.arrival_s)
    active: dict[str, _Running] = {}
    held: dict[str, Assignment] = {}  # not preemptive: the running jobs' devices
    done: dict[str, float] = {}
    now, next_arrival, decisions, solves = 0.0, 0, 0, 0
    lp_key, fair = None, None
    while next_arrival < len(pending) or active:
        if not active:  # nothing to run: straight to the round after the next arrival
            now = max(now, math.ceil(pending[next_arrival].arrival_s / ROUND_S) * ROUND_S)
        while next_arrival < len(pending) and pending[next_arrival].arrival_s <= now:
            job = pending[next_arrival]
            active[job.id] = _Running(job, job.steps)
            next_arrival += 1
        free = dict(pool)
        for assignment in held.values():
            free[assignment.device_type] -= assignment.count
        jobs = [Job(r.job.id, r.job.key, r.job.scale_factor, 1.0, r.job.arrival_s, r.remaining, r.seen,
                    dict(r.received)) for r in active.values() if r.job.id not in held]
        if not jobs:
            given = {}
        elif policy == MAX_MIN_FAIRNESS:
            # The LP's shares depend only on which jobs there are: solved again when that changes,
            # as Gavel recomputes its allocation on arrivals and completions.
            problem = build_problem(jobs, free, throughputs)
            if (problem.ids, tuple(problem.counts)) != lp_key:
                lp_key, fair, solves = (problem.ids, tuple(problem.counts)), max_min_shares(problem), solves + 1
            given = assign_by_shares(problem, fair).assigned()
        else:
            given = POLICIES[policy](jobs, free, throughputs).assigned()
        decisions += 1
        if not preemptive:
            held.update(given)
            given = dict(held)
        for job_id, assignment in given.items():
            running = active[job_id]
            rate = throughputs[running.job.key][assignment.device_type]
            if running.remaining <= rate * ROUND_S:
                done[job_id] = now + running.remaining / rate
                del active[job_id]
                held.pop(job_id, None)
            else:
                running.remaining -= rate * ROUND_S
                running.received[assignment.device_type] += 1
        for running in active.values():
            running.seen += 1
        now += ROUND_S
    return {"completion_s": done, "rounds": decisions, "lp_solves": solves}


def lower_bounds(trace: list[TraceJob], pool: dict[str, int], throughputs: dict) -> dict:
    """Bounds no policy beats. JCT: each job alone from its arrival on its best type. Makespan (from
    the first arrival): the latest such solo finish, or the least time in which the pool could
    finish every job if all were there from the start and could split their time among types
    at will (`makespan_lp_s`)."""
    alone = [job.steps / max(r for t, r in throughputs[job.key].items() if pool.get(t, 0) >= job.scale_factor)
             for job in trace]
    start = min(j.arrival_s for j in trace)
    device_s = sum(job.scale_factor * a for job, a in zip(trace, alone))
    span_s = max(j.arrival_s for j in trace) - start
    return {
        "alone_s": alone,
        "avg_jct_s": statistics.fmean(alone),
        "makespan_s": max(max(j.arrival_s - start + a for j, a in zip(trace, alone)),
                          makespan_lp_s(trace, pool, throughputs)),
        "offered_load": device_s / sum(pool.values()) / span_s if span_s > 0 else None,
    }


def makespan_lp_s(trace: list[TraceJob], pool: dict[str, int], throughputs: dict) -> float:
    """min M such that y[j, k] hours of job j on type k finish its steps (sum_k rate y >= steps),
    no job runs longer than M (sum_k y[j, k] <= M) and no type is asked for more than it has
    (sum_j s_j y[j, k] <= c_k M): Gavel's min-total-duration LP, a relaxation of every schedule."""
    types = sorted(pool)
    pairs = [(j, k, throughputs[job.key][t]) for j, job in enumerate(trace) for k, t in enumerate(types)
             if t in throughputs[job.key] and pool[t] >= job.scale_factor]
    n, p = len(trace), len(pairs)
    job_of, type_of, rate = (np.array(c, dtype=float) for c in zip(*pairs))
    job_of, type_of = job_of.astype(int), type_of.astype(int)
    columns = np.arange(p)
    steps_h = np.array([job.steps for job in trace]) / 3600  # rates stay steps/s: y in hours
    scale = np.array([job.scale_factor for job in trace], float)
    work = sparse.csr_array((-rate, (job_of, columns)), shape=(n, p))
    time_used = sparse.csr_array((np.ones(p), (job_of, columns)), shape=(n, p))
    devices = sparse.csr_array((scale[job_of], (type_of, columns)), shape=(len(types), p))
    makespan_column = np.concatenate([np.zeros(n), -np.ones(n), -np.array([pool[t] for t in types], float)])
    a_ub = sparse.hstack([sparse.vstack([work, time_used, devices]), sparse.csr_array(makespan_column[:, None])])
    objective = np.zeros(p + 1)
    objective[-1] = 1.0
    result = linprog(objective, A_ub=a_ub.tocsc(), b_ub=np.concatenate([-steps_h, np.zeros(n + len(types))]),
                     bounds=(0, None), method="highs")
    if result.status != 0:
        raise RuntimeError(f"the makespan bound's LP failed: {result.message}")
    return float(result.x[-1]) * 3600 * (1 - 1e-6)  # below the solver's tolerance: still a bound


def compare_policies(trace: list[TraceJob], pool: dict[str, int], throughputs: dict, label: str) -> dict:
    """Every policy over one trace, with Gavel's preemptive rounds (`policies`) and as the
    dispatcher's queue runs it, no job preempted (`queue`): JCT, makespan, slowdowns, and their
    ratios to FIFO's in the same mode and to the bounds."""
    bound = lower_bounds(trace, pool, throughputs)
    return {
        "offered_load": None if bound["offered_load"] is None else round(bound["offered_load"], 3),
        "lower_bound": {"avg_jct_h": round(bound["avg_jct_s"] / 3600, 3),
                        "makespan_h": round(bound["makespan_s"] / 3600, 3)},
        "policies": _run_policies(trace, pool, throughputs, label, bound, preemptive=True),
        "queue": _run_policies(trace, pool, throughputs, f"{label}, not preempted", bound, preemptive=False),
    }


def _run_policies(trace: list[TraceJob], pool: dict[str, int], throughputs: dict, label: str, bound: dict, *,
                  preemptive: bool) -> dict:
    start = min(j.arrival_s for j in trace)
    raw, results = {}, {}
    for policy in POLICIES:
        began = time.perf_counter()
        run = simulate(trace, pool, throughputs, policy, preemptive)
        jct = [run["completion_s"][j.id] - j.arrival_s for j in trace]
        slowdown = [t / a for t, a in zip(jct, bound["alone_s"])]
        raw[policy] = (statistics.fmean(jct), max(run["completion_s"].values()) - start)
        results[policy] = {
            "avg_jct_h": round(raw[policy][0] / 3600, 3), "makespan_h": round(raw[policy][1] / 3600, 3),
            "mean_slowdown": round(statistics.fmean(slowdown), 3), "max_slowdown": round(max(slowdown), 3),
            "rounds": run["rounds"], "lp_solves": run["lp_solves"], "sim_wall_s": round(time.perf_counter() - began, 2),
        }
        progress(f"simulation: {label}, {policy}: avg JCT {results[policy]['avg_jct_h']} h, "
                 f"makespan {results[policy]['makespan_h']} h")
    for policy, (jct_s, makespan_s) in raw.items():
        results[policy].update({
            "ratio_avg_jct_to_fifo": ratio(jct_s, raw[FIFO][0]),
            "ratio_makespan_to_fifo": ratio(makespan_s, raw[FIFO][1]),
            "ratio_avg_jct_to_bound": ratio(jct_s, bound["avg_jct_s"]),
            "ratio_makespan_to_bound": ratio(makespan_s, bound["makespan_s"]),
        })
    return results


def scale_factor_probabilities() -> dict[str, float]:
    uppers = [upper for upper, _ in SCALE_FACTORS]
    return {str(s): round(upper - low, 3) for (upper, s), low in zip(SCALE_FACTORS, [0.0, *uppers])}


def bench_simulation(path: Path, mode: dict) -> dict:
    catalog = read_catalog(path)
    pool = GAVEL_POOL
    throughputs = {k: {t: r for t, r in row.items() if t in pool} for k, row in catalog.throughputs.items()}
    sweep = []
    for rate in mode["rates_per_hour"]:
        # The same seed at every rate: the same jobs, arriving closer together.
        trace = generate_trace(catalog, mode["jobs"], rate, np.random.default_rng(SEED))
        sweep.append({"rate_jobs_per_hour": rate, **compare_policies(trace, pool, throughputs, f"{rate} jobs/h")})
    batch = [replace(job, arrival_s=0.0) for job in
             generate_trace(catalog, mode["batch_jobs"], 1.0, np.random.default_rng(SEED))]
    static = {"jobs": len(batch), **compare_policies(batch, pool, throughputs, f"{len(batch)} jobs at once")}
    return {
        "source": str(path), "pool": pool, "round_s": ROUND_S,
        "trace": {
            "jobs": mode["jobs"], "seed": SEED, "arrivals": "Poisson",
            "rates_jobs_per_hour": list(mode["rates_per_hour"]),
            "scale_factor_probabilities": scale_factor_probabilities(),
            "job_types": "uniform among the types measured at the job's scale factor",
            "length": f"60 x 10^U{SHORT_LOG10_MINUTES} s, or with probability {LONG_JOB_PROBABILITY} "
                      f"60 x 10^U{LONG_LOG10_MINUTES} s, on a {REFERENCE_TYPE}",
            "priorities": "all 1",
            "all_at_once": "the first jobs of the same trace, every one submitted at time 0 (Gavel's static "
                           "traces): the makespan case",
        },
        "assumptions": [
            ("offered_load: each job's least device-seconds over the pool's device-seconds between the first "
             "and the last arrival (a job on its best type: above 1 the pool cannot keep up at any policy)"),
            ("lower bounds: JCT, each job alone from its arrival on its best type; makespan, the larger of the "
             "latest such finish and Gavel's min-total-duration LP over every job (arrivals ignored, time split "
             "among types at will)"),
            "jobs arriving mid-round wait for the next round; devices a job frees mid-round idle until then",
            ("max-min fairness solves its LP again only when the set of jobs changes (Gavel does the same); "
             "its rounding runs every round"),
        ],
        "by_rate": sweep,
        "all_at_once": static,
    }


# -- (b) decision time at cluster scale -----------------------------------------------------------


def read_pai_pool(path: Path) -> dict[str, int]:
    pool: Counter = Counter()
    with path.open(newline="") as handle:
        for row in csv.DictReader(handle):
            gpu_type = row["gpu_type"].strip()
            if gpu_type in PAI_COLUMNS:  # CPU machines have no GPUs
                pool[gpu_type] += int(row["cap_gpu"])
    return dict(sorted(pool.items()))


def pai_throughputs(catalog: Catalog, pool: dict[str, int]) -> dict[str, dict[str, float]]:
    table = {}
    for key, row in catalog.throughputs.items():
        table[key] = {t: row[column] * factor for t, (column, factor) in PAI_COLUMNS.items()
                      if t in pool and column in row}
    return table


def bench_decision(gavel_path: Path, pai_path: Path, mode: dict) -> dict:
    catalog = read_catalog(gavel_path)
    pool = read_pai_pool(pai_path)
    throughputs = pai_throughputs(catalog, pool)
    trace = generate_trace(catalog, mode["decision_jobs"], 1.0, np.random.default_rng(SEED))
    jobs = [Job(j.id, j.key, j.scale_factor, 1.0, j.arrival_s, j.steps) for j in trace]
    problem = build_problem(jobs, pool, throughputs)
    timings, placed = {}, {}
    for name, policy in POLICIES.items():
        allocation = policy(jobs, pool, throughputs)  # warm-up: imports and first-call costs are not deciding
        placed[name] = {"jobs_placed": len(allocation.assigned()), "devices_used": allocation.devices_used()}
        seconds = []
        for _ in range(mode["decision_runs"]):
            began = time.perf_counter()
            policy(jobs, pool, throughputs)
            seconds.append(time.perf_counter() - began)
        timings[name] = statistics.median(seconds)
        progress(f"decision: {name} over {len(jobs)} jobs, median {timings[name]:.4f} s")
    return {
        "source": str(pai_path), "devices": sum(pool.values()), "devices_by_type": pool, "jobs": len(jobs),
        "devices_asked": int(problem.scale.sum()),
        "pai_type_to_gavel_column": {t: {"column": c, "factor": round(f, 4)} for t, (c, f) in PAI_COLUMNS.items()},
        "pai_type_mapping_reason": "V100M32: a V100 with 32 GB (same chip); T4: the P100 figures x FP32 TFLOPS "
                                   "8.1 / 9.3 (nearest in compute); MISC (unnamed, older GPUs): the K80 figures, "
                                   "the slowest measured",
        "lp_variables": int(problem.usable.sum()) + 1,
        "lp_constraints": 2 * len(jobs) + len(pool),
        "runs": mode["decision_runs"],
        "policies": {name: {"median_s": round(timings[name], 5), "ratio_to_fifo": ratio(timings[name], timings[FIFO]),
                            **placed[name]} for name in POLICIES},
    }


def skipped(path: Path, section: str) -> str:
    """Say plainly on stderr that a section did not run; the reason goes into the JSON beside its null."""
    progress(f"NOTE: {path} not found; skipping {section} (\"{section}\": null in the JSON)")
    return f"{path} not found"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small trace and few timings: a smoke run")
    parser.add_argument("--out", type=Path, help="write the JSON here as well")
    parser.add_argument("--data", type=Path, default=DATA_DIR,
                        help=f"folder holding {GAVEL_FILE} and {PAI_FILE} (default {DATA_DIR})")
    args = parser.parse_args(argv)
    name = "quick" if args.quick else "full"
    mode = MODES[name]
    started = time.perf_counter()
    gavel_path, pai_path = args.data / GAVEL_FILE, args.data / PAI_FILE
    simulation = bench_simulation(gavel_path, mode) if gavel_path.exists() else None
    decision = bench_decision(gavel_path, pai_path, mode) if gavel_path.exists() and pai_path.exists() else None
    result = {
        "benchmark": "cluster",
        "mode": name,
        "machine": {"cores": os.cpu_count(), "python": platform.python_version(), "numpy": np.__version__,
                    "scipy": scipy.__version__, "platform": platform.platform()},
        "simulation": simulation,
        "simulation_skipped_reason": None if simulation is not None else skipped(gavel_path, "simulation"),
        "decision_time": decision,
        "decision_time_skipped_reason": None if decision is not None else skipped(
            pai_path if gavel_path.exists() else gavel_path, "decision_time"),
        "wall_s": round(time.perf_counter() - started, 1),
    }
    if simulation is None and decision is None:
        result["skipped"] = f"no data: {gavel_path} not found"
    text = json.dumps(result, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
