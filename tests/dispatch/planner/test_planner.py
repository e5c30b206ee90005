"""Planner: sharding under affine shard costs (a fixed part plus one per row; the plain rate model
when nothing is fixed) and its bucketed shard sizes (pure domain, no server). The throughput
model the costs come from is tested in test_throughput.py."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from accelmesh.errors import FailedPrecondition, InvalidArgument
from dispatch_svc.planner import (
    BUCKET_RUNGS,
    PlannedDevice,
    bucket_ladder,
    group_by_target_type,
    plan_shards,
)
from dispatch_svc.planner.apportion import makespan, min_makespan_rows, proportional_rows, quotas
from dispatch_svc.planner.throughput import MIN_SECONDS_PER_ROW, ThroughputModel


def devices(*rates: float, target_type: str = "t") -> list[PlannedDevice]:
    return [PlannedDevice(f"10.0.0.1/cuda:{i}", target_type, rate) for i, rate in enumerate(rates)]


def rows_of(plan) -> list[int]:
    return [shard.rows for shard in plan.shards]


# -- sharding: hand-checked cases ------------------------------------------------------------------


def test_rates_one_two_three_get_rows_one_two_three():
    plan = plan_shards(60, devices(1, 2, 3))
    assert rows_of(plan) == [10, 20, 30]
    assert [s.first_row for s in plan.shards] == [0, 10, 30]
    assert [s.index for s in plan.shards] == [0, 1, 2]
    assert [s.predicted_seconds for s in plan.shards] == [10.0, 10.0, 10.0]
    assert plan.predicted_seconds == 10.0
    assert plan.equal_split_predicted_seconds == 20.0  # 20 rows on the rate-1 device


@pytest.mark.parametrize(
    "total, rates, expected",
    [
        (10, (1, 2, 3), [2, 3, 5]),  # quotas 1.67, 3.33, 5: the one leftover row goes to the .67
        (10, (1, 1, 1), [4, 3, 3]),  # equal remainders: the earlier device first
        (7, (5, 3), [4, 3]),  # quotas 4.375, 2.625
        (1, (1, 1, 1), [1]),  # one row: one shard, the others left out
    ],
)
def test_largest_remainder_rounding(total, rates, expected):
    plan = plan_shards(total, devices(*rates))
    assert rows_of(plan) == expected
    assert sum(rows_of(plan)) == total


def test_shards_cover_all_rows_contiguously_in_device_order():
    rng = random.Random(7)
    for _ in range(200):
        rates = [rng.uniform(0.1, 50) for _ in range(rng.randint(1, 8))]
        total = rng.randint(1, 500)
        plan = plan_shards(total, devices(*rates), max_shard_rows=rng.choice([None, 3, 17]))
        row = 0
        for shard in plan.shards:
            assert shard.first_row == row and shard.rows >= 1
            row += shard.rows
        assert row == total
        order = [int(s.device_id.rsplit(":", 1)[1]) for s in plan.shards]
        assert order == sorted(order)


def test_max_shard_rows_splits_a_share_into_consecutive_shards_on_the_same_device():
    plan = plan_shards(40, devices(1, 3), max_shard_rows=7)
    assert rows_of(plan) == [5, 5, 6, 6, 6, 6, 6]  # 10 rows -> 2 pieces, 30 rows -> 5 pieces
    assert [s.device_id[-1] for s in plan.shards] == ["0", "0", "1", "1", "1", "1", "1"]
    assert [s.index for s in plan.shards] == list(range(7))
    assert plan.rows_by_device() == {"10.0.0.1/cuda:0": 10, "10.0.0.1/cuda:1": 30}
    # The pieces run one after another, so the device's total time is what counts.
    assert plan.predicted_seconds == pytest.approx(10.0)
    assert plan.shards[0].predicted_seconds == pytest.approx(5.0)


def test_a_device_too_slow_for_a_row_is_left_out():
    plan = plan_shards(10, devices(1000, 1))
    assert rows_of(plan) == [10]
    assert plan.shards[0].device_id.endswith(":0")
    assert plan.equal_split_predicted_seconds == 5.0  # equal split still counts every device


def test_min_shard_rows_keeps_the_fastest_devices_whose_share_reaches_it():
    assert rows_of(plan_shards(5, devices(1, 1, 1))) == [2, 2, 1]
    assert rows_of(plan_shards(5, devices(1, 1, 1), min_shard_rows=2)) == [3, 2]
    plan = plan_shards(100, devices(1, 50, 50), min_shard_rows=5)  # the slow one would get 1 row
    assert [s.device_id[-1] for s in plan.shards] == ["1", "2"]
    assert rows_of(plan_shards(3, devices(1, 4), min_shard_rows=10)) == [3]  # smaller job: fastest takes all


def test_group_by_target_type_keeps_first_seen_order():
    pool = [PlannedDevice("a", "v100", 1), PlannedDevice("b", "a100", 2), PlannedDevice("c", "v100", 1)]
    groups = group_by_target_type(pool)
    assert list(groups) == ["v100", "a100"]
    assert [d.device_id for d in groups["v100"]] == ["a", "c"]


# -- sharding: against the brute-force optimum --------------------------------------------------------


def brute_force_makespan(total: int, rates: list[float]) -> float:
    best = math.inf
    for split in itertools.product(range(total + 1), repeat=len(rates) - 1):
        if sum(split) <= total:
            best = min(best, makespan([*split, total - sum(split)], rates))
    return best


@pytest.mark.parametrize("seed", range(6))
def test_plan_is_within_one_row_time_of_the_optimum_and_exact_mode_is_optimal(seed):
    rng = random.Random(seed)
    for _ in range(40):
        rates = [rng.choice([0.3, 1, 2, 2.5, 7, 40]) * rng.uniform(0.5, 1.5) for _ in range(rng.randint(2, 3))]
        total = rng.randint(1, 14)
        optimum = brute_force_makespan(total, rates)
        lp_optimum = total / sum(rates)
        plan = plan_shards(total, devices(*rates))
        rows = proportional_rows(total, rates)
        bottleneck = max((i for i, n in enumerate(rows) if n), key=lambda i: rows[i] / rates[i])
        assert plan.predicted_seconds <= lp_optimum + 1 / rates[bottleneck] + 1e-12
        assert plan.predicted_seconds <= optimum + 1 / rates[bottleneck] + 1e-12
        exact = plan_shards(total, devices(*rates), exact=True)
        assert exact.predicted_seconds == pytest.approx(optimum, rel=1e-12)
        assert lp_optimum <= exact.predicted_seconds + 1e-12


def test_exact_mode_beats_rounding_when_a_slow_device_would_be_the_bottleneck():
    rates = [1, 100]
    assert proportional_rows(60, rates) == [1, 59]  # quota 0.59 rounds up: 1 s on the slow device
    assert min_makespan_rows(60, rates) == [0, 60]  # 0.6 s on the fast one alone
    assert plan_shards(60, devices(*rates), exact=True).predicted_seconds == pytest.approx(0.6)


# -- sharding: affine costs, by hand and against the brute force ---------------------------------------


def affine(*costs: tuple[float, float]) -> list[PlannedDevice]:
    """Devices from (rows per second, fixed seconds) pairs."""
    return [PlannedDevice(f"10.0.0.1/cuda:{i}", "t", rate, fixed) for i, (rate, fixed) in enumerate(costs)]


def brute_force_affine(total: int, rates: list[float], fixed: list[float]) -> float:
    best = math.inf
    for split in itertools.product(range(total + 1), repeat=len(rates) - 1):
        if sum(split) <= total:
            best = min(best, makespan([*split, total - sum(split)], rates, fixed))
    return best


def test_the_lp_optimum_fills_devices_to_one_level_above_their_fixed_costs():
    import numpy as np

    # Level 100 with the first alone is above the second's 10 s, so both: (100 + 10) / 2 = 55 s.
    assert quotas(100, np.array([1.0, 1.0]), np.array([0.0, 10.0])).tolist() == [55.0, 45.0]
    # 10 rows take the first 10 s; the second would start at 50 s: it gets none.
    assert quotas(10, np.array([1.0, 1.0]), np.array([0.0, 50.0])).tolist() == [10.0, 0.0]


def test_a_device_whose_fixed_cost_exceeds_the_makespan_gets_no_rows():
    plan = plan_shards(10, affine((10, 0.0), (1000, 5.0)), exact=True)  # 1 s alone; 5 s just to start on the other
    assert plan.rows_by_device() == {"10.0.0.1/cuda:0": 10}
    assert plan.predicted_seconds == pytest.approx(1.0)
    assert plan_shards(10, affine((10, 0.0), (1000, 5.0))).rows_by_device() == {"10.0.0.1/cuda:0": 10}
    # Equal shares pay both fixed costs: 5 s + 5 rows at 1000/s.
    assert plan.equal_split_predicted_seconds == pytest.approx(5.005)


def test_fixed_costs_move_rows_to_the_device_that_starts_sooner():
    # By rate alone 300 : 100 gives 75 : 25 rows; with 0.5 s and 0.1 s fixed both end at 0.65 s with 45 : 55.
    plan = plan_shards(100, affine((300, 0.5), (100, 0.1)), exact=True)
    assert rows_of(plan) == [45, 55]
    assert [s.predicted_seconds for s in plan.shards] == pytest.approx([0.65, 0.65])
    assert plan.predicted_seconds == pytest.approx(0.65)


def test_every_shard_predicts_its_devices_fixed_cost_and_the_makespan_charges_a_device_once():
    plan = plan_shards(40, affine((1, 0.5), (3, 0.5)), max_shard_rows=7, exact=True)
    by_device = plan.rows_by_device()
    assert by_device == {"10.0.0.1/cuda:0": 10, "10.0.0.1/cuda:1": 30}  # both end at 10.5 s
    for shard in plan.shards:
        rate = 1 if shard.device_id.endswith(":0") else 3
        assert shard.predicted_seconds == pytest.approx(0.5 + shard.rows / rate)
    assert plan.predicted_seconds == pytest.approx(10.5)


@pytest.mark.parametrize("seed", range(6))
def test_exact_affine_plans_are_optimal_and_rounded_ones_within_a_row_time(seed):
    rng = random.Random(seed)
    for _ in range(40):
        n = rng.randint(2, 3)
        rates = [rng.choice([0.3, 1, 2, 2.5, 7, 40]) * rng.uniform(0.5, 1.5) for _ in range(n)]
        fixed = [rng.choice([0.0, 0.0, 0.1, 0.5, 2.0, 20.0]) * rng.uniform(0.5, 1.5) for _ in range(n)]
        total = rng.randint(1, 14)
        pool = affine(*zip(rates, fixed))
        optimum = brute_force_affine(total, rates, fixed)
        exact = plan_shards(total, pool, exact=True)
        assert exact.predicted_seconds == pytest.approx(optimum, rel=1e-12)
        assert sum(rows_of(exact)) == total
        level = max(f + q / r for q, r, f in zip(quotas(total, *map(_array, (rates, fixed))), rates, fixed) if q > 0)
        assert level <= optimum + 1e-12  # the LP optimum bounds every integer split
        rounded = plan_shards(total, pool)
        used = [int(s.device_id.rsplit(":", 1)[1]) for s in rounded.shards]
        assert rounded.predicted_seconds <= level + max(1 / rates[i] for i in used) + 1e-12


@pytest.mark.parametrize("seed", range(3))
def test_exact_bucketed_affine_plans_are_the_best_split_into_whole_units(seed):
    rng = random.Random(seed)
    for _ in range(30):
        n = rng.randint(2, 3)
        rates = [rng.choice([0.3, 1, 2, 7, 40]) * rng.uniform(0.5, 1.5) for _ in range(n)]
        fixed = [rng.choice([0.0, 0.5, 3.0, 30.0]) * rng.uniform(0.5, 1.5) for _ in range(n)]
        cap = rng.choice([1, 2, 5]) * 16
        total = cap * rng.randint(1, 3) // 2
        ladder = bucket_ladder(total, cap)
        plan = plan_shards(total, affine(*zip(rates, fixed)), max_shard_rows=cap, exact=True, bucket_rungs=BUCKET_RUNGS)
        # The split charges one fixed cost per device: against the brute force over units of q rows.
        by_device = plan.rows_by_device()
        rows = [by_device.get(f"10.0.0.1/cuda:{i}", 0) for i in range(n)]
        best = brute_force_affine(total // ladder.unit, [r / ladder.unit for r in rates], fixed)
        assert makespan(rows, rates, fixed) == pytest.approx(best, rel=1e-12)


def _array(values):
    import numpy as np

    return np.array(values, float)


# -- sharding: bucketed sizes ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "total, cap, unit, rungs, tail",
    [
        (200, 64, 4, (4, 8, 16, 32, 64), 0),  # the fake mesh's AFFINE job: 64-row shards at most
        (1000, None, 62, (62, 124, 248, 496, 992), 8),  # no cap: the largest shard is the job
        (32768, 2048, 128, (128, 256, 512, 1024, 2048), 0),
        (5, None, 1, (1, 2, 4), 0),  # fewer rows than the ladder is tall: rungs stop at the job
        (1, 10, 1, (1,), 0),
    ],
)
def test_the_ladder_depends_on_the_jobs_shape_alone(total, cap, unit, rungs, tail):
    ladder = bucket_ladder(total, cap)
    assert (ladder.unit, ladder.rungs, ladder.tail) == (unit, rungs, tail)
    assert len(ladder.sizes) <= BUCKET_RUNGS + 1 and max(ladder.sizes) <= min(total, cap or total)


def test_a_share_is_cut_into_top_rungs_then_its_binary_digits():
    ladder = bucket_ladder(32768, 2048)
    assert ladder.pieces(9000 // 128 * 128) == [2048] * 4 + [512, 256]  # 8960 rows
    assert ladder.pieces(128 * 31) == [2048, 1024, 512, 256, 128]
    assert ladder.pieces(0) == []
    with pytest.raises(InvalidArgument, match="128-row units"):
        ladder.pieces(100)


def test_bucketed_plans_use_only_ladder_sizes_and_cover_every_row_once():
    rng = random.Random(11)
    for _ in range(400):
        rates = [rng.choice([0.2, 1, 3, 15, 80]) * rng.uniform(0.5, 1.5) for _ in range(rng.randint(1, 9))]
        total, cap = rng.randint(1, 5000), rng.choice([None, 1, 7, 64, 300, 2048])
        exact = rng.random() < 0.5
        plan = plan_shards(total, devices(*rates), max_shard_rows=cap, exact=exact, bucket_rungs=BUCKET_RUNGS)
        ladder = bucket_ladder(total, cap)
        row = 0
        for shard in plan.shards:
            assert shard.first_row == row and shard.rows in ladder.sizes
            row += shard.rows
        assert row == total
        assert sum(s.rows == ladder.tail for s in plan.shards) == (1 if ladder.tail else 0)  # tail < unit
        order = [int(s.device_id.rsplit(":", 1)[1]) for s in plan.shards]
        assert order == sorted(order)  # a device's pieces are consecutive rows
        # Balanced in whole units: proportional rounding's bound (one unit on any device past the
        # LP optimum of the units), plus the tail on the device that finishes earliest with it.
        whole = total - ladder.tail
        bound = whole / sum(rates) + ladder.unit / min(rates) + ladder.tail / max(rates)
        assert plan.predicted_seconds <= bound * (1 + 1e-12)


@pytest.mark.parametrize("seed", range(4))
def test_exact_bucketed_plans_are_the_best_split_into_whole_units(seed):
    rng = random.Random(seed)
    for _ in range(30):
        rates = [rng.choice([0.3, 1, 2, 7, 40]) * rng.uniform(0.5, 1.5) for _ in range(rng.randint(2, 3))]
        cap = rng.choice([1, 2, 5]) * 16
        total = cap * rng.randint(1, 3) // 2  # a whole number of units: no tail
        ladder = bucket_ladder(total, cap)
        assert ladder.tail == 0
        plan = plan_shards(total, devices(*rates), max_shard_rows=cap, exact=True, bucket_rungs=BUCKET_RUNGS)
        # A unit of q rows on a device of rate r takes q / r: the brute force over units, at rate r / q.
        best_units = brute_force_makespan(total // ladder.unit, [r / ladder.unit for r in rates])
        assert plan.predicted_seconds == pytest.approx(best_units, rel=1e-12)
        assert plan.predicted_seconds >= brute_force_makespan(total, rates) - 1e-12  # rows can only do better


def test_bucketing_costs_little_balance_on_a_job_many_shards_long():
    rng = random.Random(5)
    for _ in range(50):
        rates = [rng.uniform(1, 20) for _ in range(rng.randint(2, 8))]
        pool = devices(*rates)
        free = plan_shards(20000, pool, max_shard_rows=500, exact=True)
        bucketed = plan_shards(20000, pool, max_shard_rows=500, exact=True, bucket_rungs=BUCKET_RUNGS)
        assert bucketed.predicted_seconds <= free.predicted_seconds * 1.05
        assert len({s.rows for s in bucketed.shards}) <= BUCKET_RUNGS + 1


def test_the_faster_device_still_takes_the_larger_share():
    plan = plan_shards(1600, devices(1, 3), max_shard_rows=128, exact=True, bucket_rungs=BUCKET_RUNGS)
    assert plan.rows_by_device() == {"10.0.0.1/cuda:0": 400, "10.0.0.1/cuda:1": 1200}
    assert [s.rows for s in plan.shards] == [128] * 3 + [16] + [128] * 9 + [32, 16]
    plan = plan_shards(1000, devices(1, 3), exact=True, bucket_rungs=BUCKET_RUNGS)  # unit 62, tail 8
    assert plan.rows_by_device() == {"10.0.0.1/cuda:0": 248, "10.0.0.1/cuda:1": 744 + 8}
    assert [s.rows for s in plan.shards] == [248, 496, 248, 8]


# -- sharding: errors ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "total, pool, options, error",
    [
        (0, devices(1), {}, InvalidArgument),
        (-5, devices(1), {}, InvalidArgument),
        (2.5, devices(1), {}, InvalidArgument),
        (10, [], {}, FailedPrecondition),
        (10, devices(1, 0), {}, InvalidArgument),
        (10, devices(1, -2), {}, InvalidArgument),
        (10, devices(1, math.nan), {}, InvalidArgument),
        (10, devices(1, math.inf), {}, InvalidArgument),
        (10, [PlannedDevice("a", "t", 1), PlannedDevice("a", "t", 2)], {}, InvalidArgument),
        (10, devices(1), {"max_shard_rows": 0}, InvalidArgument),
        (10, devices(1), {"min_shard_rows": 0}, InvalidArgument),
        (10, devices(1), {"max_shard_rows": 10, "min_shard_rows": 6}, InvalidArgument),
        (10, devices(1), {"bucket_rungs": 0}, InvalidArgument),
    ],
)
def test_bad_requests_raise_typed_errors(total, pool, options, error):
    with pytest.raises(error):
        plan_shards(total, pool, **options)


def test_error_messages_name_the_field_and_the_device():
    with pytest.raises(InvalidArgument, match=r"'10.0.0.1/cuda:1'.*rows_per_second"):
        plan_shards(10, devices(1, 0))
    for bad in (-1.0, math.nan, math.inf):
        with pytest.raises(InvalidArgument, match=r"'10.0.0.1/cuda:1'.*fixed_seconds"):
            plan_shards(10, affine((1, 0.0), (1, bad)))


def test_a_device_far_faster_than_the_rest_does_not_list_its_slots_one_by_one():
    # A catalog prior of billions of rows/s beside measured devices of a few hundred, with fixed
    # costs: the exact split must not enumerate every slot of the fast device up to the bound.
    import heapq

    from dispatch_svc.planner.apportion import makespan, min_makespan_rows

    rates = [2.4e15, 211.0, 227.0, 205.0]
    fixed = [0.5, 0.29, 0.17, 0.25]
    for total in (7, 1_000, 4_097):
        rows = min_makespan_rows(total, rates, fixed)
        assert sum(rows) == total
        heap = [(f + 1 / r, i) for i, (f, r) in enumerate(zip(fixed, rates))]  # the N earliest slots, one by one
        heapq.heapify(heap)
        taken = [0] * len(rates)
        for _ in range(total):
            _, i = heapq.heappop(heap)
            taken[i] += 1
            heapq.heappush(heap, (fixed[i] + (taken[i] + 1) / rates[i], i))
        assert makespan(rows, rates, fixed) == pytest.approx(makespan(taken, rates, fixed), rel=1e-12)


@pytest.mark.parametrize("rates, fixed", [
    ([1e308, 1e308], [0.1, 0.2]),  # sums overflow
    ([1e200, 3.0], [0.1, 0.2]),  # N / r vanishes next to the fixed cost: a quota of 1e183 rows once
    ([1e16, 3e16], [0.1, 0.1000000001]),
])
def test_rates_near_the_float_limit_still_split_every_row_once(rates, fixed):
    # A device measured absurdly fast beside a real one made a garbage int64 quota and a rounding
    # loop that never ended (a SubmitJob past its deadline on CI): the split stays whole and sane.
    for split in (proportional_rows, min_makespan_rows):
        rows = split(256, rates, fixed)
        assert sum(rows) == 256 and all(0 <= r <= 256 for r in rows), (split.__name__, rows)


def test_a_fit_whose_rows_cost_nothing_is_priced_at_the_floor():
    model = ThroughputModel()
    for rows in (16, 32, 64):  # nearly all fixed cost: a slope of a femtosecond a row
        model.record("affine@1", "cpu", rows, 0.05 + rows * 1e-15)
    cost = model.measured("affine@1", "cpu")
    assert cost is not None and cost.rows_per_second == pytest.approx(1 / MIN_SECONDS_PER_ROW)
