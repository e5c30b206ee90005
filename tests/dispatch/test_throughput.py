"""The planner's throughput model: catalog rates from peak FLOP/s at the rule's compute dtype,
measured rates that override them, and both on one scale (pure domain, no server)."""

from __future__ import annotations

import math
import threading

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
from dispatch_svc.planner.throughput import CATALOG_EFFICIENCY, MEASURED_SMOOTHING


def rows_of(plan) -> list[int]:
    return [shard.rows for shard in plan.shards]


def layer(name: str, flops: float) -> LayerInfo:
    return LayerInfo(name, "dense", 0, {}, 0, 0, flops, 0.0, 0)


def program(*flops: float) -> Program:
    layers = tuple(layer(f"l{i}", f) for i, f in enumerate(flops))
    return Program("mlp", "1", "model", "", (), (), (), "digest", layers=layers)


def test_catalog_rate_is_peak_at_the_compute_dtype_times_efficiency_over_flops_per_row():
    a100 = resolve_type("a100-80gb").performance()
    model = ThroughputModel()
    per_row = flops_per_row(program(1e9, 2e9))
    rate, source = model.rate("mlp@1", "cuda:a100-80gb[bf16]", a100, "bf16", flops_per_row=per_row)
    assert source == "catalog"
    assert rate == pytest.approx(312e12 * CATALOG_EFFICIENCY / 3e9)


def test_without_a_flop_estimate_the_peak_rate_is_the_relative_speed():
    assert flops_per_row(program()) is None
    v100 = resolve_type("v100-16gb").performance()
    assert ThroughputModel().rate("f@1", "v100", v100, "fp32") == (15.7, "catalog")


def test_measured_rates_override_the_catalog_and_weigh_shards_by_size():
    model, v100 = ThroughputModel(), resolve_type("v100-16gb").performance()
    assert model.record("mlp@1", "v100", rows=100, seconds=2.0) == 50.0
    assert model.rate("mlp@1", "v100", v100, "fp32") == (50.0, "measured")
    keep = 1 - MEASURED_SMOOTHING
    second = model.record("mlp@1", "v100", rows=100, seconds=1.0)
    assert second == pytest.approx((keep * 100 + 100) / (keep * 2.0 + 1.0))
    # A tiny shard slowed by fixed costs barely moves an estimate built on big ones.
    model.record("mlp@1", "big", rows=10_000, seconds=10.0)
    assert model.record("mlp@1", "big", rows=6, seconds=0.25) == pytest.approx(1000, rel=0.05)  # a rate mean: ~707
    assert model.rate("mlp@2", "v100", v100, "fp32").source == "catalog"  # per program ref
    assert model.rate("mlp@1", "t4", v100, "fp32").source == "catalog"  # per target type


def test_measured_rates_feed_later_plans():
    model = ThroughputModel()
    spec = {"a": resolve_type("a100-80gb").performance(), "b": resolve_type("a100-80gb").performance()}

    def plan():
        pool = [PlannedDevice(d, d, model.rate("p@1", d, perf, "bf16").rows_per_second) for d, perf in spec.items()]
        return plan_shards(100, pool)

    assert rows_of(plan()) == [50, 50]  # same type, same catalog rate
    model.record("p@1", "a", rows=300, seconds=1.0)
    model.record("p@1", "b", rows=100, seconds=1.0)
    assert rows_of(plan()) == [75, 25]


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
    for rows, seconds in [(0, 1.0), (5, 0.0), (5, -1.0), (5, math.inf)]:
        with pytest.raises(InvalidArgument):
            model.record("p@1", "t", rows, seconds)

    def worker(k: int) -> None:
        for _ in range(500):
            model.record("p@1", f"t{k}", rows=k + 1, seconds=1.0)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [model.measured("p@1", f"t{k}") for k in range(8)] == pytest.approx([k + 1 for k in range(8)])


@pytest.mark.parametrize("options", [{"efficiency": 0}, {"efficiency": 1.5}, {"smoothing": 0}])
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
    assert model.rates("f@1", targets) == {"a100": (312.0, "catalog"), "v100": (15.7, "catalog")}
    model.record("f@1", "v100", rows=1000, seconds=1.0)
    rates = model.rates("f@1", targets)
    assert rates["v100"] == (1000.0, "measured")
    # Priced with the FLOPs per row the V100 measurement implies, not as a raw 312 "rows/s".
    assert rates["a100"].source == "catalog"
    assert rates["a100"].rows_per_second == pytest.approx(1000 * 312 / 15.7)
    # A caller's FLOP estimate is used as given.
    with_flops = model.rates("f@1", targets, flops_per_row=1e9)
    assert with_flops["a100"].rows_per_second == pytest.approx(312e12 * CATALOG_EFFICIENCY / 1e9)
