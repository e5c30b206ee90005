"""The planner's throughput model: a shard's seconds as fixed + rows x per-row cost, from the
catalog (peak FLOP/s at the rule's compute dtype, the fixed prior) and from a decayed least-squares
fit to recorded shards, both on one scale (pure domain, no server). Every figure is worked by hand
on small data; nothing depends on this machine's speed."""

from __future__ import annotations

import math
import threading

import numpy as np
import pytest

from accelmesh.errors import InvalidArgument
from accelmesh.hardware.catalog import resolve_type
from accelmesh.programs import LayerInfo, Program
from compile_svc.rules import load_rules
from dispatch_svc.planner import (
    PlannedDevice,
    Target,
    ThroughputModel,
    flops_per_row,
    plan_shards,
)
from dispatch_svc.planner.throughput import CATALOG_EFFICIENCY, FIXED_PRIOR_S, MEASURED_SMOOTHING

KEEP = 1 - MEASURED_SMOOTHING


def rows_of(plan) -> list[int]:
    return [shard.rows for shard in plan.shards]


def layer(name: str, flops: float) -> LayerInfo:
    return LayerInfo(name, "dense", 0, {}, 0, 0, flops, 0.0, 0)


def program(*flops: float) -> Program:
    layers = tuple(layer(f"l{i}", f) for i, f in enumerate(flops))
    return Program("mlp", "1", "model", "", (), (), (), "digest", layers=layers)


def weighted_fit(points: list[tuple[int, float]]) -> tuple[float, float, float]:
    """Intercept, slope and residual standard error of the decayed weighted least squares, the
    textbook way: the k-th newest of n points weighs KEEP**k."""
    x, y = np.array([p[0] for p in points], float), np.array([p[1] for p in points])
    w = KEEP ** np.arange(len(points))[::-1]
    a = np.stack([np.ones_like(x), x], axis=1)
    intercept, slope = np.linalg.solve(a.T @ (w[:, None] * a), a.T @ (w * y))
    residual = y - intercept - slope * x
    effective = w.sum() ** 2 / (w * w).sum()
    rse = math.sqrt((w * residual * residual).sum() / w.sum() * effective / (effective - 2))
    return intercept, slope, rse


def test_catalog_cost_is_peak_at_the_compute_dtype_times_efficiency_over_flops_per_row_plus_the_fixed_prior():
    a100 = resolve_type("a100-80gb").performance()
    model = ThroughputModel()
    per_row = flops_per_row(program(1e9, 2e9))
    cost = model.rate("mlp@1", "cuda:a100-80gb[bf16]", a100, "bf16", flops_per_row=per_row)
    assert cost.source == "catalog" and cost.samples == 0
    assert cost.rows_per_second == pytest.approx(312e12 * CATALOG_EFFICIENCY / 3e9)
    assert cost.fixed_seconds == FIXED_PRIOR_S
    assert cost.seconds(1000) == pytest.approx(FIXED_PRIOR_S + 1000 * 3e9 / (312e12 * CATALOG_EFFICIENCY))
    assert cost.seconds(0) == 0.0  # no shard, no fixed cost


def test_without_a_flop_estimate_the_peak_rate_is_the_relative_speed_and_nothing_is_fixed():
    assert flops_per_row(program()) is None
    v100 = resolve_type("v100-16gb").performance()
    assert ThroughputModel().rate("f@1", "v100", v100, "fp32") == (15.7, "catalog", 0.0, 0, 0.0)


def test_noiseless_shards_of_several_sizes_give_back_the_fixed_and_per_row_seconds_exactly():
    model = ThroughputModel()
    for rows in (10, 50, 100, 10, 400):
        cost = model.record("mlp@1", "v100", rows=rows, seconds=0.2 + rows * 0.01)
    assert cost.source == "measured" and cost.samples == 5
    assert cost.fixed_seconds == pytest.approx(0.2, rel=1e-9)
    assert cost.seconds_per_row == pytest.approx(0.01, rel=1e-9)
    assert cost.residual_seconds == pytest.approx(0.0, abs=1e-6)  # a microsecond: float rounding
    # Large row counts lose no precision (the moments are centred).
    for rows in (1_000_000, 1_500_000, 2_000_000):
        cost = model.record("mlp@1", "big", rows=rows, seconds=0.5 + rows * 1e-6)
    assert cost.fixed_seconds == pytest.approx(0.5, rel=1e-6)
    assert cost.seconds_per_row == pytest.approx(1e-6, rel=1e-9)


def test_the_fit_is_least_squares_with_older_shards_decayed():
    points = [(10, 1.0), (20, 1.5), (10, 0.9), (40, 2.5), (20, 1.3)]
    model = ThroughputModel()
    for rows, seconds in points:
        cost = model.record("p@1", "t", rows=rows, seconds=seconds)
    intercept, slope, rse = weighted_fit(points)
    assert cost.fixed_seconds == pytest.approx(intercept, rel=1e-9)
    assert cost.seconds_per_row == pytest.approx(slope, rel=1e-9)
    assert cost.residual_seconds == pytest.approx(rse, rel=1e-9) and cost.residual_seconds > 0
    # Decay: once a device's cost changes, its recent shards win.
    for _ in range(40):
        for rows in (10, 30):
            cost = model.record("p@1", "t", rows=rows, seconds=0.1 + rows * 0.05)
    assert cost.fixed_seconds == pytest.approx(0.1, rel=1e-3)
    assert cost.seconds_per_row == pytest.approx(0.05, rel=1e-3)


def test_one_shard_size_splits_by_the_reported_fixed_part():
    model, v100 = ThroughputModel(), resolve_type("v100-16gb").performance()
    model.record("mlp@1", "v100", rows=100, seconds=1.2, fixed_seconds=0.2)
    cost = model.record("mlp@1", "v100", rows=100, seconds=1.4, fixed_seconds=0.3)
    fixed = (KEEP * 0.2 + 0.3) / (KEEP + 1)  # decayed means
    seconds = (KEEP * 1.2 + 1.4) / (KEEP + 1)
    assert cost.fixed_seconds == pytest.approx(fixed)
    assert cost.seconds_per_row == pytest.approx((seconds - fixed) / 100)
    assert model.rate("mlp@1", "v100", v100, "fp32", flops_per_row=1e9) == cost  # the fit wins over the catalog
    assert model.rate("mlp@2", "v100", v100, "fp32").source == "catalog"  # per program ref
    assert model.rate("mlp@1", "t4", v100, "fp32").source == "catalog"  # per target type


def test_one_shard_size_without_a_reported_fixed_part_keeps_the_priors_split_or_is_all_per_row():
    v100 = resolve_type("v100-16gb").performance()
    model = ThroughputModel()
    model.record("mlp@1", "v100", rows=100, seconds=2.0)
    prior = model.catalog_cost(v100, "fp32", flops_per_row=1e9)
    share = prior.fixed_seconds / prior.seconds(100)  # the prior's fixed fraction at 100 rows
    cost = model.rate("mlp@1", "v100", v100, "fp32", flops_per_row=1e9)
    assert cost.fixed_seconds == pytest.approx(2.0 * share)
    assert cost.seconds(100) == pytest.approx(2.0)
    # No FLOP estimate: no prior in seconds to split by, so the honest reading is rows / seconds.
    assert model.rate("mlp@1", "v100", v100, "fp32") == (50.0, "measured", 0.0, 1, 0.0)


def test_a_fit_with_a_negative_intercept_goes_through_the_origin():
    model = ThroughputModel()
    model.record("p@1", "t", rows=10, seconds=0.05)
    cost = model.record("p@1", "t", rows=20, seconds=0.2)  # the line through both starts at -0.1 s
    w = np.array([KEEP, 1.0])
    x, y = np.array([10.0, 20.0]), np.array([0.05, 0.2])
    assert cost.fixed_seconds == 0.0
    assert cost.seconds_per_row == pytest.approx((w * x * y).sum() / (w * x * x).sum())


def test_measured_costs_feed_later_plans():
    model = ThroughputModel()
    spec = {"a": resolve_type("a100-80gb").performance(), "b": resolve_type("a100-80gb").performance()}

    def plan():
        costs = model.rates("p@1", [Target(d, perf, "bf16") for d, perf in spec.items()], flops_per_row=1e9)
        pool = [PlannedDevice(d, d, costs[d].rows_per_second, costs[d].fixed_seconds) for d in spec]
        return plan_shards(100, pool, exact=True)

    assert rows_of(plan()) == [50, 50]  # same type, same catalog cost
    for rows in (10, 30):
        model.record("p@1", "a", rows=rows, seconds=0.5 + rows / 300)
        model.record("p@1", "b", rows=rows, seconds=0.1 + rows / 100)
    # 0.5 + n / 300 = 0.1 + (100 - n) / 100 at n = 45: both end at 0.65 s. A split by rate alone
    # (300 : 100) would give a 75 rows and end at 0.75 s.
    assert rows_of(plan()) == [45, 55]


def test_catalog_path_uses_the_rule_dtype():
    rules = load_rules()
    a100 = resolve_type("a100-80gb").device_spec("10.0.0.1", 0)
    v100 = resolve_type("v100-16gb").device_spec("10.0.0.1", 1)
    dtypes = [rules.match(d).build.compute_dtype for d in (a100, v100)]
    assert dtypes == ["bf16", "fp32"]
    model = ThroughputModel()
    pool = [
        PlannedDevice(d.id, rules.target_type(d).key, model.rate("p@1", rules.target_type(d).key, d.performance, dt,
                                                                   flops_per_row=1e9).rows_per_second)
        for d, dt in zip((a100, v100), dtypes)
    ]
    plan = plan_shards(1000, pool)
    assert plan.rows_by_device() == {a100.id: 952, v100.id: 48}  # 312 : 15.7 TFLOP/s
    assert plan.predicted_seconds < plan.equal_split_predicted_seconds / 9


def test_record_rejects_nonsense_and_is_thread_safe():
    model = ThroughputModel()
    for rows, seconds, fixed in [(0, 1.0, None), (5, 0.0, None), (5, -1.0, None), (5, math.inf, None),
                                 (2.5, 1.0, None), (5, 1.0, 1.5), (5, 1.0, -0.1)]:
        with pytest.raises(InvalidArgument):
            model.record("p@1", "t", rows, seconds, fixed_seconds=fixed)

    def worker(k: int) -> None:
        for i in range(500):
            rows = k + 1 + i % 2
            model.record("p@1", f"t{k}", rows=rows, seconds=0.5 + rows * (k + 1))

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    fits = [model.measured("p@1", f"t{k}") for k in range(8)]
    assert [f.samples for f in fits] == [500] * 8
    assert [f.seconds_per_row for f in fits] == pytest.approx([k + 1 for k in range(8)])
    assert [f.fixed_seconds for f in fits] == pytest.approx([0.5] * 8)


@pytest.mark.parametrize("options", [{"efficiency": 0}, {"efficiency": 1.5}, {"smoothing": 0},
                                     {"fixed_prior_s": -1}, {"fixed_prior_s": math.nan}])
def test_model_options_are_checked(options):
    with pytest.raises(InvalidArgument):
        ThroughputModel(**options)


def test_catalog_rate_rejects_unknown_dtype_and_bad_flops():
    perf = resolve_type("t4").performance()
    with pytest.raises(InvalidArgument, match="compute_dtype"):
        ThroughputModel().catalog_rate(perf, "int8")
    with pytest.raises(InvalidArgument, match="flops_per_row"):
        ThroughputModel().catalog_rate(perf, "fp32", flops_per_row=0)


def test_rates_put_measured_and_catalog_types_on_one_scale():
    a100, v100 = resolve_type("a100-80gb").performance(), resolve_type("v100-16gb").performance()
    targets = [Target("a100", a100, "bf16"), Target("v100", v100, "fp32")]
    model = ThroughputModel()
    assert model.rates("f@1", targets) == {"a100": (312.0, "catalog", 0.0, 0, 0.0),
                                           "v100": (15.7, "catalog", 0.0, 0, 0.0)}
    model.record("f@1", "v100", rows=1000, seconds=1.25, fixed_seconds=0.25)
    rates = model.rates("f@1", targets)
    assert rates["v100"][:3] == (1000.0, "measured", 0.25)
    # Priced as the V100 compares with its catalog figure, not as a raw 312 "rows/s", and with
    # the measured types' fixed cost.
    assert rates["a100"].source == "catalog"
    assert rates["a100"].rows_per_second == pytest.approx(1000 * 312 / 15.7)
    assert rates["a100"].fixed_seconds == 0.25
    # With a FLOP estimate the same: the catalog's absolute figure would be out of scale with a
    # device that runs 1000 rows/s where its datasheet says 15.7e12 x 0.4 / 1e9 = 6280.
    with_flops = model.rates("f@1", targets, flops_per_row=1e9)
    assert with_flops["a100"].rows_per_second == pytest.approx(1000 * 312 / 15.7)
