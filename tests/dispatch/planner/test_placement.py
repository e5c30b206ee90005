"""Layer placement (requirements B4-B6): the ranked method on hand-checked cases, the balanced
strategy against brute force, and the layer-table checks."""

from __future__ import annotations

import itertools
import math
import random
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from accelmesh.errors import InvalidArgument, ResourceExhausted
from accelmesh.scoring import Weights
from dispatch_svc.planner.placement import (
    FLOPS_PER_PARAMETER,
    TRAINING_IN_FLIGHT,
    Device,
    LayerCost,
    Model,
    NoRoom,
    Task,
    check_layers,
    evaluate,
    lower_bound_seconds,
    parameter_split,
    place,
    place_balanced,
    place_ranked,
    sequential_fill,
)

GB = 10**9


def layer(name: str, order: int, params: int, *, flops: float | None = None, act: int = 0, **extra) -> LayerCost:
    return LayerCost(name, order, params, params * 4, flops_per_sample=flops, activation_bytes_per_sample=act, **extra)


def device(name: str, tflops: float, memory: int, bandwidth: float = 1000.0, link: float = 100.0,
           target_type: str = "") -> Device:
    return Device(name, target_type or name, tflops, memory, bandwidth, link)


def task(**kw) -> Task:
    kw.setdefault("headroom", 0.0)
    kw.setdefault("micro_batch_rows", 1)
    return Task(**kw)


# -- ranked -------------------------------------------------------------------------------------


def test_ranked_places_largest_layers_first_on_the_best_device_with_room():
    layers = [layer("small", 0, 10**8), layer("big", 1, 10**9), layer("mid", 2, 5 * 10**8)]
    devices = [device("a", 100.0, 5 * GB), device("b", 50.0, 5 * GB)]
    placement = place_ranked(Model(layers, task(device_count=2, weights=Weights(1, 0, 0))), devices)
    # big (4 GB) goes to the faster a; a is then 4/5.6 of the model's FLOPs busy, so b scores
    # higher for mid; small goes where the weighted status is best after both.
    assert placement.assignment[1] == "a"
    assert placement.assignment[2] == "b"
    lines = placement.explain
    assert lines[1].startswith("big ") and lines[2].startswith("mid ") and lines[3].startswith("small ")
    assert all("->" in line for line in lines[1:4])


def test_a_device_with_no_free_compute_takes_no_layer_and_spoils_no_plan_on_the_others():
    """A device whose compute other jobs hold (free rate 0) would run a stage forever. Balanced
    once summed its infinite layer times into prefixes, so every later stage was inf - inf = NaN
    and nothing fitted anywhere; ranked gave it layers by its memory, at an infinite step."""
    layers = [layer(f"l{i}", i, 10**8, flops=1e9) for i in range(4)]
    held = device("held", 0.0, 16 * GB)  # the most memory: ranked on memory alone would pick it
    free = device("free", 10.0, 8 * GB)
    model = Model(layers, task(weights=Weights(0, 1, 0)))
    alone = place_balanced(model, [free])
    with np.errstate(invalid="raise"):  # no inf - inf anywhere
        balanced = place_balanced(model, [held, free])
        _, strategy, ranked = place(model, [held, free], "ranked")
    assert balanced.assignment == ("free",) * 4
    assert balanced.evaluation.step_seconds == alone.evaluation.step_seconds
    assert strategy == "ranked" and ranked.assignment == ("free",) * 4
    assert math.isfinite(ranked.evaluation.step_seconds)


def test_without_free_compute_the_refusal_says_so_and_claims_no_shortfall_of_memory():
    layers = [layer(f"l{i}", i, 10**8, flops=1e9) for i in range(4)]
    held = [device("held0", 0.0, 8 * GB), device("held1", 0.0, 8 * GB)]
    with pytest.raises(NoRoom) as err:
        place_balanced(Model(layers, task()), held)
    assert "compute free now" in str(err.value) and "memory" not in str(err.value)
    assert err.value.shortfall_bytes == 0
    # Two devices asked for, one of them with compute free: not enough now, and not the client's count at fault.
    with pytest.raises(NoRoom) as err:
        place(Model(layers, task(device_count=2)), [held[0], device("free", 10.0, 8 * GB)], "auto")
    assert "1 of the 2 devices have no compute free now" in str(err.value) and err.value.shortfall_bytes == 0


def test_a_layer_that_fits_nowhere_names_the_layer_and_the_largest_free_memory():
    layers = [layer("huge", 0, 3 * GB), layer("tiny", 1, 10**6)]  # 12 GB of parameters
    devices = [device("a", 10.0, 10 * GB), device("b", 10.0, 9 * GB)]  # 19 GB in all: enough in total
    with pytest.raises(NoRoom) as err:
        place_ranked(Model(layers, task()), devices)
    message = str(err.value)
    assert "'huge'" in message and "10,000,000,000 bytes free (a)" in message
    assert err.value.shortfall_bytes == 12 * GB - 10 * GB
    assert isinstance(err.value, ResourceExhausted)


def test_a_model_larger_than_every_device_together_reports_the_shortfall():
    layers = [layer(f"l{i}", i, GB) for i in range(5)]  # 20 GB
    devices = [device("a", 10.0, 8 * GB), device("b", 10.0, 8 * GB)]
    with pytest.raises(NoRoom) as err:
        place_ranked(Model(layers, task(headroom=0.5)), devices)
    assert err.value.shortfall_bytes == 20 * GB - 8 * GB
    assert "short by 12,000,000,000 bytes" in str(err.value)


def test_the_device_count_caps_the_devices_used():
    layers = [layer(f"l{i}", i, GB // 4) for i in range(6)]  # 1 GB each
    devices = [device(name, 10.0, 4 * GB) for name in "abc"]
    capped = place_ranked(Model(layers, task(device_count=2)), devices)
    assert len(set(capped.assignment)) == 2
    free = place_ranked(Model(layers, task(device_count=3)), devices)
    assert len(set(free.assignment)) == 3
    # Derived from memory: 6 GB over devices of 4 GB usable needs 2 of them.
    derived = place_ranked(Model(layers, task()), devices)
    assert len(set(derived.assignment)) == 2
    assert "so 2 device(s)" in derived.explain[0]


def test_a_device_count_larger_than_the_pool_is_invalid():
    with pytest.raises(InvalidArgument, match="spec.placement.device_count is 4 but only 2"):
        place_ranked(Model([layer("l", 0, 10)], task(device_count=4)), [device("a", 1, GB), device("b", 1, GB)])


def test_reserving_a_layer_changes_where_the_next_one_goes():
    layers = [layer("big", 0, 6 * 10**8), layer("mid", 1, 10**8), layer("small", 2, 10**8)]
    devices = [device("a", 20.0, 8 * GB), device("b", 10.0, 8 * GB), device("c", 5.0, 8 * GB)]
    placement = place_ranked(Model(layers, task(device_count=2, weights=Weights(1, 0, 0))), devices)
    # big opens the fastest device a, mid opens the next best b (the model gets 2 devices).
    # a starts with the better status, but big alone takes the model's whole ideal step (the
    # slowest layer on its best device bounds it), so a has no compute left and small goes to b.
    assert placement.assignment == ("a", "b", "b")
    assert placement.scores["a"] > placement.scores["b"]
    assert "5,600,000,000 B left" in placement.explain[1]  # a's 8 GB less big's 2.4 GB
    assert "(100% busy)" in placement.explain[1]
    assert "chosen devices had room" in placement.explain[3]


def test_the_largest_layers_open_as_many_devices_as_the_model_needs():
    layers = [layer(f"l{i}", i, GB // 4) for i in range(4)]
    devices = [device("fast", 100.0, 40 * GB), device("slow", 10.0, 40 * GB)]
    placement = place_ranked(Model(layers, task(device_count=2, weights=Weights(1, 0, 0))), devices)
    assert set(placement.assignment) == {"fast", "slow"}
    alone = place_ranked(Model(layers, task(device_count=1, weights=Weights(1, 0, 0))), devices)
    assert set(alone.assignment) == {"fast"}


def test_weights_decide_between_a_compute_rich_and_a_memory_rich_device():
    layers = [layer("only", 0, GB // 4)]
    devices = [device("fast", 300.0, 16 * GB), device("roomy", 30.0, 80 * GB)]
    compute = place_ranked(Model(layers, task(device_count=1, weights=Weights(1, 0, 0))), devices)
    memory = place_ranked(Model(layers, task(device_count=1, weights=Weights(0, 1, 0))), devices)
    assert compute.assignment == ("fast",)
    assert memory.assignment == ("roomy",)


def test_tied_parameters_count_once_when_owner_and_user_share_a_device():
    layers = [layer("embed", 0, GB // 4), layer("body", 1, GB // 4),
              layer("head", 2, 0, shared_from="embed", shared_parameter_bytes=GB)]
    model = Model(layers, task())
    devices = [device("a", 10.0, 10 * GB), device("b", 10.0, 10 * GB)]
    together = evaluate(model, devices, ["a", "b", "a"])
    apart = evaluate(model, devices, ["a", "b", "b"])
    assert together.memory_bytes["a"] == GB  # embed, and head reads its copy
    assert apart.memory_bytes["b"] == 2 * GB and apart.memory_bytes["a"] == GB


def test_a_stage_holds_its_weights_and_the_peak_of_its_micro_batches_in_flight_not_a_sum_over_layers():
    # b = 4 rows: outputs 400, 1200, 200 bytes; inputs 400 (like the first output), 400, 1200;
    # working sets (in + out) 800, 1600, 1400.
    layers = [layer("a", 0, 1000, act=100), layer("b", 1, 2000, act=300), layer("c", 2, 500, act=50)]
    inference = Model(layers, task(micro_batch_rows=4))
    # weights 4000 + 8000 + 2000, the next micro-batch's input 400, the largest working set and its workspace
    assert inference.total_need() == 14_000 + 400 + 2 * 1600
    assert inference.stage_need(1, 3) == 10_000 + 400 + 2 * 1600
    assert inference.need == [4000 + 400 + 2 * 800, 8000 + 400 + 2 * 1600, 2000 + 1200 + 2 * 1400]
    devices = [device("x", 100.0, GB), device("y", 100.0, GB)]
    assert evaluate(inference, devices, ["x", "y", "y"]).memory_bytes == {"x": 6000, "y": 13_600}
    # two runs on x (a and c): both runs' next inputs, one peak
    assert evaluate(inference, devices, ["x", "y", "x"]).memory_bytes["x"] == 6000 + 400 + 1200 + 2 * 1400
    training = Model(layers, task(kind="training", micro_batch_rows=4))
    # weights and the gradients a backward returns; the one micro-batch a backward recomputes
    # keeps every layer's input; forward, activation gradients and workspace at the peak
    assert TRAINING_IN_FLIGHT == 1
    assert training.total_need() == 2 * 14_000 + (400 + 400 + 1200) + 3 * 1600
    assert sum(training.need) >= training.total_need() and sum(inference.need) >= inference.total_need()


def test_buffers_are_held_once_and_never_trained():
    rows = [layer("embed", 0, 1000, act=100),
            LayerCost("rotary", 1, 0, 0, buffer_bytes=640, activation_bytes_per_sample=100)]
    check_layers(rows)
    inference, training = (Model(rows, task(kind=kind, micro_batch_rows=1)) for kind in ("inference", "training"))
    assert inference.weights == [4000, 640] and training.weights == [8000, 640]
    with pytest.raises(InvalidArgument, match=r"layers\[0\].parameter_count .* buffer_bytes"):
        check_layers([LayerCost("position_ids", 0, 0, 2048)])


def test_unknown_flops_are_estimated_and_zero_flops_are_zero():
    unknown = LayerCost("dense", 0, 1000, 4000, activation_bytes_per_sample=8)
    lookup = LayerCost("embed", 0, 1000, 4000, flops_per_sample=0.0, activation_bytes_per_sample=8)
    assert Model([unknown], task(micro_batch_rows=2)).flops == [2 * FLOPS_PER_PARAMETER * 1000]
    assert Model([lookup], task(micro_batch_rows=2)).flops == [0.0]


# -- balanced -----------------------------------------------------------------------------------


def brute_force(model: Model, devices: list[Device], count: int, replicate: bool = True, mixed: bool = False) -> float:
    """The smallest feasible step time over every contiguous split and every assignment of
    devices to its stages: one device a stage, or (`replicate`) several identical ones, or
    (`mixed`) any several, sharing micro-batches by speed."""
    n = len(model)
    best = math.inf
    for stages in range(1, min(n, count) + 1):
        for cuts in itertools.combinations(range(1, n), stages - 1):
            bounds = [0, *cuts, n]
            for where in itertools.product(range(-1, stages), repeat=len(devices)):  # device -> stage or unused
                groups = [[d for d, s in zip(devices, where) if s == k] for k in range(stages)]
                if not all(groups) or sum(map(len, groups)) > count:
                    continue
                if not mixed and any(len(g) > 1 and (not replicate or len({(d.target_type, d.peak_tflops,
                                                                              d.memory_free_bytes,
                                                                              d.memory_bandwidth_gbps,
                                                                              d.link_gbps, d.stage_overhead_s)
                                                                             for d in g}) > 1)
                                     for g in groups):
                    continue
                assignment = []
                for g, (a, b) in zip(groups, zip(bounds, bounds[1:])):
                    assignment.extend([g[0].id] * (b - a))
                ev = evaluate(model, devices, assignment,
                              {g[0].id: tuple(d.id for d in g[1:]) for g in groups if g[1:]})
                if ev.feasible:
                    best = min(best, ev.step_seconds)
    return best


def random_instance(rng: random.Random):
    n = rng.randint(2, 6)
    layers = [LayerCost(f"l{i}", i, p := rng.randint(1, 40) * 10**7, p * 4,
                        flops_per_sample=rng.uniform(1e9, 4e10), bytes_accessed_per_sample=rng.uniform(0, 2e8),
                        activation_bytes_per_sample=rng.choice([10**5, 10**6, 10**7]))
              for i in range(n)]
    kinds = [("fast", 120.0, 16 * GB, 900.0, 300.0), ("big", 40.0, 40 * GB, 1500.0, 150.0),
             ("slow", 8.0, 24 * GB, 300.0, 15.0)]
    devices = []
    for i in range(rng.randint(2, 4)):
        name, tflops, memory, bandwidth, link = rng.choice(kinds)
        memory = int(memory * rng.choice([0.05, 0.1, 0.3, 1.0]))  # sometimes tight
        overhead = rng.choice([0.0, 0.0, 1e-3])  # what a stage call costs beyond its compute, when measured
        devices.append(Device(f"d{i}", name, tflops, memory, bandwidth, link, stage_overhead_s=overhead))
    return layers, devices


@pytest.mark.parametrize("kind", ["inference", "training"])
@pytest.mark.parametrize("seed", range(40))
def test_balanced_finds_the_brute_force_optimum(seed, kind):
    rng = random.Random(seed)
    layers, devices = random_instance(rng)
    count = rng.randint(1, len(devices))
    model = Model(layers, task(kind=kind, device_count=count, micro_batch_rows=rng.choice([1, 8, 32]),
                               step_micro_batches=rng.choice([1, 4])))
    optimum = brute_force(model, devices, count)
    if math.isinf(optimum):
        with pytest.raises(NoRoom):
            place_balanced(model, devices)
        return
    placement = place_balanced(model, devices)
    assert placement.evaluation.feasible
    # exact over identical replicas; devices of other classes joining a stage afterwards only help,
    # and no assignment of devices to stages beats what brute force finds over all of them
    step = placement.evaluation.step_seconds
    if "joined the busiest stages" in placement.explain[0]:
        assert brute_force(model, devices, count, mixed=True) * (1 - 1e-9) <= step < optimum
    else:
        assert step == pytest.approx(optimum, rel=1e-9)
    assert len(placement.devices) <= count
    runs = [k for k, _ in itertools.groupby(placement.assignment)]
    assert len(runs) == len(set(runs)), "a device holds one contiguous stage"
    # the bound holds over the devices offered and those used, replicas of other types included
    assert step >= lower_bound_seconds(model, devices) * (1 - 1e-9)
    assert step >= lower_bound_seconds(model, [d for d in devices if d.id in placement.devices]) * (1 - 1e-9)


def test_the_training_bound_counts_the_gradients_and_parameters_every_placement_moves():
    # One device, one flops-bound layer: no placement does better than computing it and moving
    # its gradients back each micro-batch and its parameters in once a step, so the bound is the
    # plan; over two devices it still holds and is no longer exact.
    layers = [layer("heavy", 0, 10**8, flops=1e12, act=10**3)]
    model = Model(layers, task(kind="training", micro_batch_rows=8, step_micro_batches=4))
    one = [device("a", 100.0, 200 * GB, link=10.0, target_type="a")]
    step = evaluate(model, one, ["a"]).step_seconds
    assert lower_bound_seconds(model, one) == pytest.approx(step, rel=1e-12)
    assert step > model.compute_seconds(0, one[0])  # the flops alone would bound less
    two = [*one, device("b", 50.0, 200 * GB, link=40.0, target_type="b")]
    placed = place_balanced(model, two).evaluation.step_seconds
    assert lower_bound_seconds(model, two) * (1 - 1e-9) <= placed < step


def test_the_lower_bound_counts_replicas_of_another_type():
    # One layer on a 100 and a 60 TFLOP/s device: sharing its micro-batches by speed takes
    # 1 / (1/a + 1/b) of a micro-batch's work, less than the faster device alone.
    layers = [layer("only", 0, 10**6, flops=1e12, act=10**3)]
    devices = [device("a", 100.0, 80 * GB, target_type="a"), device("b", 60.0, 80 * GB, target_type="b")]
    model = Model(layers, task(micro_batch_rows=8))
    a, b = (model.compute_seconds(0, d) for d in devices)
    assert lower_bound_seconds(model, devices) == pytest.approx(1 / (1 / a + 1 / b), rel=1e-12)
    assert lower_bound_seconds(model, devices, mixed_replicas=False) == pytest.approx(a, rel=1e-12)
    placement = place_balanced(model, devices)
    assert placement.evaluation.step_seconds >= lower_bound_seconds(model, devices) * (1 - 1e-9)
    # devices that compute nothing bound nothing: no placement on them runs the layer (fuzz found a
    # division by zero here)
    idle = [device("z", 0.0, 80 * GB, target_type="z", bandwidth=0.0)]
    assert lower_bound_seconds(model, idle) == math.inf


def test_bounds_asked_from_many_threads_are_solved_on_one(monkeypatch):
    # HiGHS keeps state per calling thread and does not give all of it back, so a dispatcher that
    # planned on its request threads grew with every plan: every linear program runs on the
    # planner's one solver thread, whichever thread asks, with the same answer.
    import scipy.optimize

    solved_on, real = [], scipy.optimize.linprog

    def recording(*args, **kwargs):
        solved_on.append(threading.current_thread().name)
        return real(*args, **kwargs)

    layers = [layer(f"l{i}", i, 10**8, flops=1e12, act=10**3) for i in range(3)]
    model = Model(layers, task(kind="training", micro_batch_rows=8, step_micro_batches=4))
    devices = [device("a", 100.0, 200 * GB, link=10.0, target_type="a"),
               device("b", 50.0, 200 * GB, link=40.0, target_type="b")]
    alone = lower_bound_seconds(model, devices)
    monkeypatch.setattr(scipy.optimize, "linprog", recording)
    with ThreadPoolExecutor(max_workers=4) as pool:
        bounds = list(pool.map(lambda _: lower_bound_seconds(model, devices), range(8)))
    assert bounds == [alone] * 8
    assert len(solved_on) == 8 and set(solved_on) == {solved_on[0]}
    assert solved_on[0].startswith("lower-bound-lp")


@pytest.mark.parametrize("params", [10**6, 10**10])
def test_a_trained_stage_pays_its_gradients_every_micro_batch_and_its_parameters_every_step(params):
    # One compute-heavy layer on two identical devices, 4 micro-batches a step over a 10 GB/s link:
    # alone, a device runs every micro-batch and returns the layer's gradients each time, and gets
    # the step's parameters once; replicated, each runs half the micro-batches and both get the
    # parameters, so replicas always help the devices (the dispatcher's own link is not modelled).
    layers = [layer("heavy", 0, params, flops=1e11, act=10**3)]
    devices = [device("a", 100.0, 200 * GB, link=10.0, target_type="a"),
               device("b", 100.0, 200 * GB, link=10.0, target_type="a")]
    model = Model(layers, task(kind="training", micro_batch_rows=8, step_micro_batches=4))
    compute = model.compute_seconds(0, devices[0])
    moved = 4 * params / (10.0 * 1e9 * 0.8)  # parameter bytes over the link at 80%
    alone = evaluate(model, devices, ["a"])
    assert alone.step_seconds == pytest.approx(compute + moved + moved / 4, rel=1e-12)
    replicated = evaluate(model, devices, ["a"], {"a": ("b",)})
    assert replicated.step_seconds == pytest.approx((compute + moved) / 2 + moved / 4, rel=1e-12)
    placement = place_balanced(model, devices)
    assert placement.replicas == {"a": ("b",)} or placement.replicas == {"b": ("a",)}
    assert placement.evaluation.step_seconds == pytest.approx(replicated.step_seconds, rel=1e-9)
    assert placement.evaluation.step_seconds == pytest.approx(brute_force(model, devices, 2), rel=1e-9)


def test_balanced_is_never_slower_than_ranked_or_the_baselines_when_all_fit():
    layers = [layer("embed", 0, 10**8, flops=1e8, act=10**6)]
    layers += [layer(f"block_{i}", i + 1, 2 * 10**8, flops=4e11, act=10**6) for i in range(8)]
    layers += [layer("head", 9, 10**8, flops=2e8, act=10**3)]
    devices = [device("a0", 150.0, 4 * GB, target_type="a"), device("a1", 150.0, 4 * GB, target_type="a"),
               device("v0", 60.0, 8 * GB, target_type="v")]
    model = Model(layers, task(device_count=3, micro_batch_rows=8))
    balanced = place_balanced(model, devices)
    others = [place_ranked(model, devices), sequential_fill(model, devices), parameter_split(model, devices, 3)]
    for other in others:
        if other.evaluation.feasible:
            assert balanced.evaluation.step_seconds <= other.evaluation.step_seconds * (1 + 1e-9), other.strategy
    assert balanced.evaluation.step_seconds >= lower_bound_seconds(model, devices)
    assert balanced.evaluation.cross_transfers == len(balanced.evaluation.stages) - 1


def test_balanced_plans_many_devices_quickly_and_explains_itself():
    layers = [layer(f"l{i}", i, 3 * 10**8, flops=6e11, act=10**6) for i in range(100)]
    devices = [device(f"n{i}/{t}", rate, memory, target_type=t)
               for i in range(250) for t, rate, memory in (("a", 150.0, 40 * GB), ("v", 60.0, 32 * GB),
                                                           ("t", 30.0, 16 * GB), ("k", 4.0, 12 * GB))]
    placement = place_balanced(Model(layers, task(micro_batch_rows=4)), devices)
    assert placement.evaluation.feasible
    assert placement.explain[0].startswith("balanced: 100 layers in order over 1000 devices in 4 classes")


# -- layer tables -------------------------------------------------------------------------------


@pytest.mark.parametrize("rows, message", [
    ([], "spec.placement.layers is empty"),
    ([layer("a", 0, 10), layer("a", 1, 10)], "spec.placement.layers[1].name 'a' is also spec.placement.layers[0].name"),
    ([layer("a", 0, 10), layer("b", 2, 10)], "must number the 2 layers 0..1"),
    ([LayerCost("a", 0, -5, 4)], "spec.placement.layers[0].parameter_count of layer 'a' must be a finite number >= 0"),
    ([LayerCost("a", 0, 1000, 10)], "spec.placement.layers[0].parameter_bytes of layer 'a' is 10 for 1000 parameters"),
    ([LayerCost("a", 0, 10, 40, flops_per_sample=float("nan"))], "flops_per_sample of layer 'a'"),
    ([layer("a", 0, 10, shared_from="b"), layer("b", 1, 10)], "shared_from 'b' of layer 'a' must name an earlier"),
    ([LayerCost("", 0, 10, 40)], "spec.placement.layers[0].name is empty"),
    ([layer(f"l{i}", i, 10) for i in range(1025)], "spec.placement.layers has 1025 rows; at most 1024"),
])
def test_inconsistent_layer_tables_are_refused_naming_the_row(rows, message):
    with pytest.raises(InvalidArgument) as err:
        check_layers(rows)
    assert message in str(err.value)


@pytest.mark.parametrize("bad, message", [
    (dict(headroom=1.0), "memory_headroom must be in [0, 1)"),
    (dict(micro_batch_rows=0), "micro_batch_rows must be >= 1"),
    (dict(device_count=-1), "device_count must be >= 0"),
])
def test_bad_placement_options_are_refused(bad, message):
    with pytest.raises(InvalidArgument, match=message.replace("[", r"\[").replace(")", r"\)")):
        Model([layer("a", 0, 10)], Task(**bad))


def test_micro_batches_go_to_a_stages_devices_by_their_shares_evenly_spread():
    from dispatch_svc.execution.strategies.pipeline import weighted_turns

    assert weighted_turns((1.0, 1.0, 1.0), 7) == [0, 1, 2, 0, 1, 2, 0]  # identical devices take turns in order
    turns = weighted_turns((0.5, 0.25, 0.25), 8)
    assert [turns.count(i) for i in range(3)] == [4, 2, 2]
    fast = [i for i, t in enumerate(turns) if t == 0]
    assert max(b - a for a, b in zip(fast, fast[1:])) <= 3, "the fast device's turns are spread out"
    uneven = weighted_turns((0.7, 0.2, 0.1), 100)
    assert [uneven.count(i) for i in range(3)] == [70, 20, 10]


def test_without_a_count_balanced_takes_as_many_devices_as_lower_the_step_and_a_count_caps_it():
    # 12 equal layers; each device holds 5 of them, so memory needs 3 of the 4 equal devices
    layers = [layer(f"l{i}", i, 10**8, flops=4e11, act=10**5) for i in range(12)]
    devices = [device(f"d{i}", 100.0, int(5.5 * 4 * 10**8), target_type="same") for i in range(4)]
    free = Model(layers, task(micro_batch_rows=1))
    assert len(place_balanced(free, devices).devices) == 4  # 3 layers a device
    capped = Model(layers, task(micro_batch_rows=1, device_count=3))
    assert len(place_balanced(capped, devices).devices) == 3
    # three layers a device instead of four (the sends, 100 kB each, are a rounding error)
    assert place_balanced(free, devices).evaluation.step_seconds == pytest.approx(
        place_balanced(capped, devices).evaluation.step_seconds * 3 / 4, rel=1e-4)
    # a fast device and a 100x slower one, 100 MB between the layers over 1 GB/s: no pipeline
    # stage on the slow one (the send costs more than it gives), but it takes 1% of the micro-batches
    tiny = [layer("a", 0, 10**6, flops=1e9, act=10**8), layer("b", 1, 10**6, flops=1e9, act=10**8)]
    pair = [device("fast", 100.0, GB, link=1.0), device("slow", 1.0, GB, link=1.0)]
    model = Model(tiny, task(micro_batch_rows=1))
    placement = place_balanced(model, pair)
    assert placement.evaluation.cross_transfers == 0 and placement.replicas == {"fast": ("slow",)}
    (stage,) = placement.evaluation.stages
    fast, slow = (sum(model.compute_seconds(i, d) for i in range(2)) for d in pair)
    assert stage.shares == pytest.approx((slow / (fast + slow), fast / (fast + slow)))
    assert placement.evaluation.step_seconds == pytest.approx(1 / (1 / fast + 1 / slow))


@pytest.mark.parametrize("seed", range(12))
def test_the_array_search_and_the_dictionary_search_find_the_same_plan(seed, monkeypatch):
    # balanced keeps its search in arrays while the vectors of devices used fit MAX_DENSE_STATES,
    # in dictionaries past it: the same recurrence, so the same stages
    import dispatch_svc.planner.balanced as balanced

    rng = random.Random(seed)
    layers, devices = random_instance(rng)
    model = Model(layers, task(kind=rng.choice(["inference", "training"]), device_count=rng.randint(1, len(devices)),
                               micro_batch_rows=rng.choice([1, 8, 32])))
    try:
        dense = place_balanced(model, devices)
    except NoRoom:
        monkeypatch.setattr(balanced, "MAX_DENSE_STATES", 0)
        with pytest.raises(NoRoom):
            place_balanced(model, devices)
        return
    monkeypatch.setattr(balanced, "MAX_DENSE_STATES", 0)
    sparse = place_balanced(model, devices)
    assert sparse.evaluation.step_seconds == pytest.approx(dense.evaluation.step_seconds, rel=1e-12)
    assert len(sparse.devices) == len(dense.devices)
