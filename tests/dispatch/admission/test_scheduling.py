"""The cross-job scheduling policies (dispatch_svc/scheduling): answers known by hand on small
throughput matrices (FIFO's order, Gavel's max-min fairness LP and its rounding, the speed-up
greedy), properties every allocation keeps on seeded random problems (capacity, usable types only,
no idle device a waiting job could use, the LP's constraints), determinism, and the errors that
name the bad field."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from dispatch_svc.admission.scheduling import (
    FIFO,
    MAX_MIN_FAIRNESS,
    MIN_TOTAL_TIME,
    POLICIES,
    Assignment,
    InvalidSchedulingInput,
    Job,
    assign_by_shares,
    build_problem,
    fifo,
    max_min_fairness,
    max_min_shares,
    min_total_time,
)
from dispatch_svc.admission.scheduling.fair_shares import LEVEL_SLACK, equal_share_throughput

TOLERANCE = 1e-6


def shares_of(jobs, pool, throughputs):
    problem = build_problem(jobs, pool, throughputs)
    return problem, max_min_shares(problem)


def share(problem, fair, job_id, device_type):
    return fair.shares[problem.ids.index(job_id), problem.types.index(device_type)]


# -- answers known by hand ------------------------------------------------------------------------


def test_max_min_gives_the_fast_type_to_the_job_it_speeds_up_when_the_other_gains_nothing_there():
    throughputs = {"fast_on_a": {"A": 10.0, "B": 1.0}, "indifferent": {"A": 1.0, "B": 1.0}}
    jobs = [Job("indifferent", "indifferent", arrival_s=0), Job("fast", "fast_on_a", arrival_s=1)]
    problem, fair = shares_of(jobs, {"A": 1, "B": 1}, throughputs)
    assert share(problem, fair, "fast", "A") == pytest.approx(1.0, abs=1e-5)
    assert share(problem, fair, "indifferent", "B") == pytest.approx(1.0, abs=1e-5)
    # Both jobs at least at their equal share (1.0), the fast one at 10 / 5.5 of it.
    assert fair.level == pytest.approx(1.0, rel=1e-6)
    assert fair.normalised[problem.ids.index("fast")] == pytest.approx(10 / 5.5, rel=1e-4)
    allocation = max_min_fairness(jobs, {"A": 1, "B": 1}, throughputs)
    assert allocation.assignments == {"indifferent": Assignment("B", 1), "fast": Assignment("A", 1)}


def test_max_min_splits_time_evenly_when_the_fast_type_would_cost_the_other_job_its_share():
    # 10x against 1.1x: j1 on A for a fraction a has normalised throughput (9a + 1) / 5.5, j2
    # (1.1 - 0.1a) / 1.05; they meet at a = 1/2, level 1. The rounding gives A first to the larger
    # share and then alternates, as Gavel's priorities X / fraction received do.
    throughputs = {"ten_x": {"A": 10.0, "B": 1.0}, "one_point_one_x": {"A": 1.1, "B": 1.0}}
    jobs = [Job("j1", "ten_x"), Job("j2", "one_point_one_x", arrival_s=1)]
    problem, fair = shares_of(jobs, {"A": 1, "B": 1}, throughputs)
    assert fair.level == pytest.approx(1.0, rel=1e-5)
    assert share(problem, fair, "j1", "A") == pytest.approx(0.5, abs=1e-4)
    first = max_min_fairness(jobs, {"A": 1, "B": 1}, throughputs)
    assert first.assignments["j1"] == Assignment("A", 1)
    after = [Job("j1", "ten_x", rounds_seen=1, rounds_received={"A": 1}),
             Job("j2", "one_point_one_x", arrival_s=1, rounds_seen=1, rounds_received={"B": 1})]
    second = max_min_fairness(after, {"A": 1, "B": 1}, throughputs)
    assert second.assignments == {"j1": Assignment("B", 1), "j2": Assignment("A", 1)}


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_each_job_gets_the_type_it_is_fast_on_when_their_speeds_cross(policy):
    throughputs = {"likes_a": {"A": 10.0, "B": 1.0}, "likes_b": {"A": 1.0, "B": 10.0}}
    jobs = [Job("b", "likes_b", arrival_s=0), Job("a", "likes_a", arrival_s=1)]
    allocation = POLICIES[policy](jobs, {"A": 1, "B": 1}, throughputs)
    assert allocation.assignments == {"b": Assignment("B", 1), "a": Assignment("A", 1)}


def test_fifo_gives_the_first_job_its_fastest_type_and_min_total_time_the_job_that_gains_most():
    throughputs = {"slight": {"A": 1.1, "B": 1.0}, "large": {"A": 10.0, "B": 1.0}}
    jobs = [Job("first", "slight", arrival_s=0), Job("second", "large", arrival_s=5)]
    pool = {"A": 1, "B": 1}
    assert fifo(jobs, pool, throughputs).assignments == {"first": Assignment("A", 1), "second": Assignment("B", 1)}
    assert min_total_time(jobs, pool, throughputs).assignments == {
        "first": Assignment("B", 1), "second": Assignment("A", 1)}


@pytest.mark.parametrize("policy", [FIFO, MIN_TOTAL_TIME])
def test_a_higher_priority_is_served_first_whatever_its_arrival(policy):
    throughputs = {"t": {"A": 2.0}}
    jobs = [Job("early", "t", arrival_s=0), Job("urgent", "t", priority=5, arrival_s=100),
            Job("later", "t", arrival_s=50)]
    allocation = POLICIES[policy](jobs, {"A": 2}, throughputs)
    assert set(allocation.assigned()) == {"urgent", "early"}


def test_fifo_takes_jobs_in_arrival_order_and_lets_a_small_one_backfill_what_a_large_one_cannot_use():
    throughputs = {"t": {"A": 1.0}}
    jobs = [Job("second", "t", scale_factor=2, arrival_s=2), Job("first", "t", scale_factor=2, arrival_s=1),
            Job("small", "t", scale_factor=1, arrival_s=3)]
    allocation = fifo(jobs, {"A": 3}, throughputs)
    assert allocation.assignments == {"first": Assignment("A", 2), "second": None, "small": Assignment("A", 1)}


def test_max_min_weights_normalised_throughput_by_priority():
    # Two identical jobs on one device: shares 2/3 and 1/3, normalised 4/3 and 2/3, level 2/3.
    jobs = [Job("high", "t", priority=2), Job("low", "t", arrival_s=1)]
    problem, fair = shares_of(jobs, {"A": 1}, {"t": {"A": 3.0}})
    assert fair.level == pytest.approx(2 / 3, rel=1e-5)
    assert share(problem, fair, "high", "A") == pytest.approx(2 / 3, rel=1e-4)
    assert share(problem, fair, "low", "A") == pytest.approx(1 / 3, rel=1e-4)


def test_a_job_larger_than_every_type_waits_and_is_left_out_of_the_lp():
    jobs = [Job("huge", "t", scale_factor=8), Job("small", "t", arrival_s=1)]
    pool, throughputs = {"A": 4, "B": 2}, {"t": {"A": 1.0, "B": 2.0}}
    for policy in POLICIES.values():
        allocation = policy(jobs, pool, throughputs)
        assert allocation.assignments["huge"] is None
        assert allocation.shares["huge"] == {}
        assert allocation.assignments["small"] == Assignment("B", 1)


def test_no_jobs_is_an_empty_allocation():
    for policy in POLICIES.values():
        allocation = policy([], {"A": 3}, {"t": {"A": 1.0}})
        assert allocation.assignments == {} and allocation.devices_used() == {}


# -- properties on seeded random problems ---------------------------------------------------------


def random_problem(seed: int):
    rng = random.Random(seed)
    types = ["k80", "p100", "v100", "t4"][: rng.randint(1, 4)]
    pool = {t: rng.randint(0, 9) for t in types}
    throughputs = {}
    for i in range(rng.randint(1, 6)):
        row = {t: round(rng.uniform(0.5, 20), 3) for t in types if rng.random() < 0.7}
        throughputs[f"type{i}"] = row or {types[0]: 1.0}
    jobs = [Job(f"j{i}", rng.choice(sorted(throughputs)), scale_factor=rng.choice([1, 1, 1, 2, 4, 8]),
                priority=rng.choice([1.0, 1.0, 2.0, 0.5]), arrival_s=float(rng.randint(0, 5)),
                remaining_steps=rng.choice([100.0, 5_000.0, math.inf]),
                rounds_seen=(seen := rng.randint(0, 6)),
                rounds_received={t: rng.randint(0, seen) for t in types if rng.random() < 0.3})
            for i in range(rng.randint(0, 25))]
    return jobs, pool, throughputs


SEEDS = range(40)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_an_allocation_fits_the_pool_uses_only_usable_types_and_leaves_no_device_a_waiting_job_could_use(
        policy, seed):
    jobs, pool, throughputs = random_problem(seed)
    allocation = POLICIES[policy](jobs, pool, throughputs)
    assert set(allocation.assignments) == {job.id for job in jobs}
    used = allocation.devices_used()
    assert all(used[t] <= pool[t] for t in used)
    by_id = {job.id: job for job in jobs}
    for job_id, assignment in allocation.assigned().items():
        job = by_id[job_id]
        assert assignment.device_type in throughputs[job.job_type]
        assert assignment.count == job.scale_factor
    free = {t: pool[t] - used.get(t, 0) for t in pool}
    for job_id, assignment in allocation.assignments.items():
        if assignment is None:
            job = by_id[job_id]
            assert all(free[t] < job.scale_factor for t in throughputs[job.job_type]), job_id


@pytest.mark.parametrize("seed", SEEDS)
def test_the_lp_shares_satisfy_its_constraints_and_reach_at_least_the_equal_split(seed):
    jobs, pool, throughputs = random_problem(seed)
    problem, fair = shares_of(jobs, pool, throughputs)
    x = fair.shares
    assert (x >= 0).all() and (x <= 1).all()
    assert (x[~problem.usable] == 0).all()
    assert (x.sum(axis=1) <= 1 + TOLERANCE).all()
    assert ((problem.scale[:, None] * x).sum(axis=0) <= problem.counts + TOLERANCE).all()
    in_lp = problem.usable.any(axis=1)
    if not in_lp.any():
        return
    # The equal split is itself feasible, so the worst weighted normalised throughput is at least
    # 1 / the largest weight; every job is at least at its weight x the level.
    assert fair.level >= 1 / problem.weight[in_lp].max() - TOLERANCE
    assert (fair.normalised[in_lp] >= problem.weight[in_lp] * fair.level * (1 - LEVEL_SLACK) - TOLERANCE).all()
    baseline = equal_share_throughput(problem, in_lp)
    achieved = (problem.rates * x).sum(axis=1)
    np.testing.assert_allclose(achieved[in_lp] / baseline[in_lp], fair.normalised[in_lp], rtol=1e-9)


@pytest.mark.parametrize("seed", range(10))
@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_the_same_jobs_in_any_order_get_the_same_allocation(policy, seed):
    jobs, pool, throughputs = random_problem(seed)
    first = POLICIES[policy](jobs, pool, throughputs)
    shuffled = list(jobs)
    random.Random(seed).shuffle(shuffled)
    again = POLICIES[policy](shuffled, dict(reversed(list(pool.items()))), throughputs)
    assert again.assignments == first.assignments
    assert again.shares == first.shares


def test_max_min_fairness_is_the_lp_then_the_rounding_which_a_simulator_may_call_apart():
    jobs, pool, throughputs = random_problem(7)
    problem = build_problem(jobs, pool, throughputs)
    assert assign_by_shares(problem, max_min_shares(problem)) == max_min_fairness(jobs, pool, throughputs)
    assert max_min_fairness(jobs, pool, throughputs).policy == MAX_MIN_FAIRNESS


# -- errors that name the field ---------------------------------------------------------------------

GOOD_TABLE = {"t": {"A": 1.0}}


@pytest.mark.parametrize("jobs, pool, throughputs, field", [
    ([Job("j", "t")], {"A": -1}, GOOD_TABLE, "pool['A']"),
    ([Job("j", "t")], {"A": 1.5}, GOOD_TABLE, "pool['A']"),
    ([Job("j", "unknown")], {"A": 1}, GOOD_TABLE, "jobs[0].job_type"),
    ([Job("j", "t")], {"A": 1}, {"t": {}}, "throughputs['t']"),
    ([Job("j", "t")], {"A": 1}, {"t": {"B": 1.0}}, "throughputs['t']['B']"),
    ([Job("j", "t")], {"A": 1}, {"t": {"A": 0.0}}, "throughputs['t']['A']"),
    ([Job("j", "t")], {"A": 1}, {"t": {"A": math.nan}}, "throughputs['t']['A']"),
    ([Job("j", "t", scale_factor=0)], {"A": 1}, GOOD_TABLE, "jobs[0].scale_factor"),
    ([Job("j", "t"), Job("k", "t", priority=0)], {"A": 1}, GOOD_TABLE, "jobs[1].priority"),
    ([Job("j", "t"), Job("j", "t")], {"A": 1}, GOOD_TABLE, "jobs[1].id"),
    ([Job("j", "t", remaining_steps=-1)], {"A": 1}, GOOD_TABLE, "jobs[0].remaining_steps"),
    ([Job("j", "t", arrival_s=math.inf)], {"A": 1}, GOOD_TABLE, "jobs[0].arrival_s"),
    ([Job("j", "t", rounds_received={"C": 1})], {"A": 1}, GOOD_TABLE, "jobs[0].rounds_received"),
    ([Job("j", "t", rounds_seen=-2)], {"A": 1}, GOOD_TABLE, "jobs[0].rounds_seen"),
])
@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_bad_input_is_a_value_error_naming_the_field(policy, jobs, pool, throughputs, field):
    with pytest.raises(ValueError) as raised:
        POLICIES[policy](jobs, pool, throughputs)
    assert isinstance(raised.value, InvalidSchedulingInput)
    assert raised.value.field == field
    assert str(raised.value).startswith(field)
