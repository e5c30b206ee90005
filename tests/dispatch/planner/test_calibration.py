"""Stage calls calibrate the layer model per target type, and plans price devices by it."""

from __future__ import annotations

import math

import pytest

from dispatch_svc.execution.strategies.pipeline_plan import _calibrated
from dispatch_svc.planner.calibration import StageCalibration
from dispatch_svc.planner.placement import Device, LayerCost, Model, Task, evaluate, place_balanced


def test_a_type_is_calibrated_by_the_decayed_means_of_its_stage_calls():
    calibration = StageCalibration(smoothing=0.5)
    assert calibration.get("a") is None
    calibration.record("a", predicted_seconds=0.001, execute_seconds=0.004, own_seconds=0.010)
    first = calibration.get("a")
    assert first.slowdown == pytest.approx(4.0) and first.overhead_seconds == pytest.approx(0.006)
    calibration.record("a", predicted_seconds=0.001, execute_seconds=0.016, own_seconds=0.018)
    second = calibration.get("a")
    # weights 0.5 (the older) and 1: the slowdown's geometric mean, the overhead's arithmetic one
    assert second.slowdown == pytest.approx(math.exp((0.5 * math.log(4) + math.log(16)) / 1.5))
    assert second.overhead_seconds == pytest.approx((0.5 * 0.006 + 0.002) / 1.5) and second.samples == 2
    calibration.record("a", predicted_seconds=0.0, execute_seconds=0.01, own_seconds=0.02)  # no prediction: ignored
    assert calibration.get("a").samples == 2 and calibration.get("b") is None


def test_a_calibrated_device_is_priced_at_its_measured_speed_and_pays_the_overhead_per_stage():
    calibration = StageCalibration(smoothing=0.3)
    calibration.record("slow", predicted_seconds=0.001, execute_seconds=0.010, own_seconds=0.015)
    catalog = [Device("a", "slow", 100.0, 10**9, 1000.0), Device("b", "other", 100.0, 10**9, 1000.0)]
    devices, lines = _calibrated(catalog, calibration)
    assert devices[0].peak_tflops == pytest.approx(10.0) and devices[0].memory_bandwidth_gbps == pytest.approx(100.0)
    assert devices[0].stage_overhead_s == pytest.approx(0.005) and devices[1] == catalog[1]
    assert len(lines) == 1 and "10x the catalog's prediction, 5.000 ms a stage call" in lines[0]
    layers = [LayerCost(f"l{i}", i, 10**6, 4 * 10**6, flops_per_sample=1e9, activation_bytes_per_sample=1000)
              for i in range(2)]
    model = Model(layers, Task(micro_batch_rows=1, headroom=0.0))
    one = evaluate(model, devices, ["a", "a"])
    two = evaluate(model, devices, ["a", "b"])
    assert one.compute_seconds["a"] == pytest.approx(10 * evaluate(model, catalog, ["a", "a"]).compute_seconds["a"]
                                                     + 0.005)  # one stage: one call
    assert two.stages[0].compute_seconds == pytest.approx(model.compute_seconds(0, devices[0]) + 0.005)


def test_with_a_stage_calls_overhead_two_devices_share_one_stage_rather_than_pipeline_it():
    layers = [LayerCost(f"l{i}", i, 10**6, 4 * 10**6, flops_per_sample=1e9, activation_bytes_per_sample=1000)
              for i in range(4)]
    model = Model(layers, Task(micro_batch_rows=1, headroom=0.0, device_count=2))
    costly = [Device("a", "x", 100.0, 10**9, 1000.0, stage_overhead_s=1.0),
              Device("b", "y", 50.0, 10**9, 1000.0, stage_overhead_s=1.0)]
    placement = place_balanced(model, costly)
    # as two stages each device pays a second's call for every micro-batch; sharing one stage,
    # each pays it for the micro-batches it takes
    (stage,) = placement.evaluation.stages
    alone = [1.0 + sum(model.compute_seconds(i, d) for i in range(4)) for d in costly]
    assert placement.replicas == {"a": ("b",)}
    assert placement.evaluation.step_seconds == pytest.approx(1 / (1 / alone[0] + 1 / alone[1]))
    pipelined = evaluate(model, costly, ["a", "a", "b", "b"])
    assert placement.evaluation.step_seconds < pipelined.step_seconds / 1.9
