"""The planner over large pools (bench/scale.py plans over 80,000 devices): the array splits
against the loops they replaced (a heap of each device's next row, largest remainders), plans
as fast and ties as broken whatever order the devices come in, and the balanced placement's pruning of
devices outmatched `count` times over, which keeps the optimum (against brute force) and the
explanation's count of classes."""

from __future__ import annotations

import heapq
import itertools
import math
import random

import pytest
from test_placement import GB, brute_force, device, layer, random_instance, task

from dispatch_svc.planner import PlannedDevice, plan_shards
from dispatch_svc.planner.apportion import makespan, min_makespan_rows, proportional_rows
from dispatch_svc.planner.placement import Model, place_balanced, place_ranked
from dispatch_svc.planner.placement_types import ByDevice


def heap_split(total: int, rates: list[float]) -> list[int]:
    """The exact split as a heap hands it out: floors first, then each device's next row by finish time."""
    rows = [int(total * r / math.fsum(rates)) for r in rates]
    while sum(rows) > total:
        i = max((i for i, n in enumerate(rows) if n), key=lambda i: rows[i] / rates[i])
        rows[i] -= 1
    heap = [((rows[i] + 1) / r, i) for i, r in enumerate(rates)]
    heapq.heapify(heap)
    for _ in range(total - sum(rows)):
        _, i = heapq.heappop(heap)
        rows[i] += 1
        heapq.heappush(heap, ((rows[i] + 1) / rates[i], i))
    return rows


def affine_heap_makespan(total: int, rates: list[float], fixed: list[float]) -> float:
    """The exact affine makespan as a heap of every device's next row finds it, from no rows at all."""
    heap = [(f + 1 / r, i) for i, (r, f) in enumerate(zip(rates, fixed))]
    heapq.heapify(heap)
    rows, last = [0] * len(rates), 0.0
    for _ in range(total):
        last, i = heapq.heappop(heap)
        rows[i] += 1
        heapq.heappush(heap, (fixed[i] + (rows[i] + 1) / rates[i], i))
    return last


def remainder_split(total: int, rates: list[float]) -> list[int]:
    quotas = [total * r / math.fsum(rates) for r in rates]
    rows = [int(q) for q in quotas]
    for i in sorted(range(len(rates)), key=lambda i: (-(quotas[i] - rows[i]), i))[: total - sum(rows)]:
        rows[i] += 1
    return rows


def random_rates(rng: random.Random, n: int) -> list[float]:
    kind = rng.random()
    if kind < 0.3:  # few distinct rates: ties everywhere
        return [rng.choice([0.5, 1.0, 2.0, 3.0]) for _ in range(n)]
    if kind < 0.6:  # a few very fast devices take several extra rows each
        return [rng.choice([1.0, 1000.0]) * rng.uniform(0.9, 1.1) for _ in range(n)]
    return [10 ** rng.uniform(-3, 4) for _ in range(n)]


@pytest.mark.parametrize("seed", range(30))
def test_the_array_splits_give_what_the_heap_and_the_largest_remainders_give(seed):
    rng = random.Random(seed)
    for _ in range(20):
        rates = random_rates(rng, rng.choice([1, 2, 5, 50, 500]))
        total = rng.choice([1, 3, 64, 999, 10**5, 10**6])
        assert min_makespan_rows(total, rates) == heap_split(total, rates)
        assert proportional_rows(total, rates) == remainder_split(total, rates)


@pytest.mark.parametrize("seed", range(10))
def test_the_affine_array_split_finds_the_heaps_makespan(seed):
    rng = random.Random(seed)
    for _ in range(20):
        rates = random_rates(rng, rng.choice([1, 2, 5, 50, 300]))
        fixed = [rng.choice([0.0, 0.01, 1.0, 100.0]) * rng.uniform(0.5, 1.5) for _ in rates]
        total = rng.choice([1, 3, 64, 999, 20_000])
        rows = min_makespan_rows(total, rates, fixed)
        assert sum(rows) == total and min(rows) >= 0
        assert makespan(rows, rates, fixed) == pytest.approx(affine_heap_makespan(total, rates, fixed), rel=1e-12)


def test_a_split_over_80000_devices_uses_every_row_once_and_meets_the_bound():
    rng = random.Random(1)
    pool = [PlannedDevice(f"10.{i // 65536}.{i // 256 % 256}.{i % 256}/cuda:{i % 8}", f"t{i % 11}",
                          rng.choice([1.0, 2.0, 8.0]) * 100) for i in range(80_000)]
    total = 3_000_000
    plan = plan_shards(total, pool, exact=True, bucket_rungs=5, max_shard_rows=4096)
    shards = plan.shards
    assert [s.index for s in shards] == list(range(len(shards))) and shards[0].first_row == 0
    assert all(a.first_row + a.rows == b.first_row for a, b in itertools.pairwise(shards))
    assert shards[-1].first_row + shards[-1].rows == total and max(s.rows for s in shards) <= 4096
    ideal = total / sum(d.rows_per_second for d in pool)
    assert ideal <= plan.predicted_seconds < plan.equal_split_predicted_seconds


def test_the_exact_split_is_as_fast_whatever_order_the_devices_come_in():
    pool = [PlannedDevice(f"d{i:03d}", "t", rate) for i, rate in enumerate([2.0] * 40 + [1.0] * 40 + [0.3] * 5)]
    plans = [plan_shards(1_001, order, exact=True) for order in (pool, pool[::-1], random.Random(2).sample(pool, 85))]
    assert len({p.predicted_seconds for p in plans}) == 1
    ideal = 1_001 / sum(d.rows_per_second for d in pool)  # the LP bound; whole rows cost at most a row more
    assert ideal <= plans[0].predicted_seconds <= ideal + 1 / 1.0


def test_ranked_gives_ties_to_the_lowest_id_whatever_order_the_devices_come_in():
    layers = [layer(f"l{i}", i, 10**8, flops=1e9, act=10**5) for i in range(6)]
    pool = [device(f"n{i:02d}", 100.0, 16 * GB, target_type="a") for i in range(30)]
    model = Model(layers, task(device_count=3))
    placements = {place_ranked(model, order).assignment
                  for order in (pool, list(reversed(pool)), random.Random(3).sample(pool, len(pool)))}
    assert len(placements) == 1 and set(next(iter(placements))) == {"n00", "n01", "n02"}


@pytest.mark.parametrize("seed", range(25))
def test_balanced_over_a_pool_padded_with_outmatched_devices_keeps_the_brute_force_optimum(seed):
    rng = random.Random(seed)
    layers, devices = random_instance(rng)
    count = rng.randint(1, len(devices))
    model = Model(layers, task(device_count=count, micro_batch_rows=rng.choice([1, 8])))
    optimum = brute_force(model, devices, count)
    if math.isinf(optimum):
        return
    # Devices below every real one in every figure: each is outmatched `count` times over.
    padding = [device(f"pad{i:03d}", min(d.peak_tflops for d in devices) / 2,
                      min(d.memory_free_bytes for d in devices) // 2, min(d.memory_bandwidth_gbps for d in devices) / 2,
                      min(d.link_gbps for d in devices) / 2, target_type="pad") for i in range(300)]
    placement = place_balanced(model, devices + padding)
    assert placement.evaluation.step_seconds == pytest.approx(place_balanced(model, devices).evaluation.step_seconds,
                                                              rel=1e-9)
    assert placement.evaluation.step_seconds <= optimum * (1 + 1e-9)
    assert not any(d.startswith("pad") for d in placement.devices)
    classes = len({(d.target_type, d.peak_tflops, d.memory_free_bytes) for d in devices}) + 1
    assert f"over {len(devices) + 300} devices in {classes} classes" in placement.explain[0]


def test_balanced_keeps_count_devices_of_a_class_the_plan_may_need_all_of():
    layers = [layer(f"l{i}", i, 3 * 10**8, flops=6e11, act=10**6) for i in range(12)]
    big = [device(f"a{i:03d}", 150.0, 4 * GB, target_type="a") for i in range(200)]
    small = [device(f"k{i:03d}", 4.0, 2 * GB, target_type="k") for i in range(200)]
    placement = place_balanced(Model(layers, task(micro_batch_rows=4, device_count=12)), big + small)
    assert placement.evaluation.feasible and {d[0] for d in placement.assignment} == {"a"}
    assert "in 2 classes of identical devices, of which the 1 not outmatched" in placement.explain[0]
    assert placement.capacity_bytes["k000"] == 2 * GB and placement.scores["a000"] > placement.scores["k000"]


def test_by_device_reads_like_a_dict_of_every_candidate():
    import numpy as np

    values = ByDevice(["a", "b", "c"], np.array([3, 1, 2], np.int64))
    assert dict(values) == {"a": 3, "b": 1, "c": 2} and type(values["a"]) is int
    assert values.get("z", -1) == -1 and len(values) == 3 and "b" in values


@pytest.mark.parametrize("seed", range(10))
def test_devices_as_columns_plan_exactly_as_a_list_of_devices(seed):
    from dispatch_svc.planner import DeviceColumns

    rng = random.Random(seed)
    rates = random_rates(rng, rng.choice([1, 5, 50, 500]))
    ids, types = [f"d{i}" for i in range(len(rates))], [rng.choice(["a", "b"]) for _ in rates]
    fixed = [rng.choice([0.0, 0.05, 2.0]) for _ in rates]
    listed = [PlannedDevice(i, t, r) for i, t, r in zip(ids, types, rates)]
    listed_affine = [PlannedDevice(i, t, r, f) for i, t, r, f in zip(ids, types, rates, fixed)]
    for options in ({}, {"exact": True, "max_shard_rows": 64},
                    {"exact": True, "max_shard_rows": 256, "bucket_rungs": 5}, {"min_shard_rows": 8}):
        total = rng.choice([1, 999, 10**5])
        assert plan_shards(total, DeviceColumns(ids, types, rates), **options) == plan_shards(total, listed, **options)
        assert (plan_shards(total, DeviceColumns(ids, types, rates, fixed), **options)
                == plan_shards(total, listed_affine, **options))


def test_columns_with_a_bad_device_are_refused_naming_it_as_a_list_would_be():
    from accelmesh.errors import InvalidArgument
    from dispatch_svc.planner import DeviceColumns

    with pytest.raises(InvalidArgument, match="device 'b': rows_per_second"):
        plan_shards(10, DeviceColumns(["a", "b"], ["t", "t"], [1.0, 0.0]))
    with pytest.raises(InvalidArgument, match="device 'a' is listed twice"):
        plan_shards(10, DeviceColumns(["a", "a"], ["t", "t"], [1.0, 2.0]))
    with pytest.raises(InvalidArgument, match="one of each per device"):
        DeviceColumns(["a"], [], [1.0])
