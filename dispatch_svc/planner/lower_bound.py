"""The step time no placement can beat (README, Model placement): the model's work and traffic
over the devices' summed rates, the slowest layer over the devices fastest at it, and the least
step over fractional plans (a linear program). What a plan's step is measured against."""

from __future__ import annotations

import math
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from dispatch_svc.planner.layer_model import BANDWIDTH_EFFICIENCY, MAX_STAGE_REPLICAS, Model, alike_key, link_gbps
from dispatch_svc.planner.placement_types import DEFAULT_STEP_MICRO_BATCHES, TRAINING, Device
from dispatch_svc.planner.throughput import CATALOG_EFFICIENCY


def lower_bound_seconds(model: Model, devices: Sequence[Device], mixed_replicas: bool = True) -> float:
    """A step time no placement on `devices` can beat. A device's time is at least the sum over
    its layers of FLOPs / rate and of memory traffic / bandwidth, and, trained, of the gradients
    it returns and the parameters it receives over its link. So the busiest device takes at least
    the model's traffic over the devices' summed bandwidth, and, with F the model's FLOPs and G
    the bytes every micro-batch must move (the gradients, and the parameters once a step), at
    least (F + t G) / sum over devices of max(rate, t x link) for every t >= 0 (a device that
    spends its step computing f FLOPs and moving g bytes does f + t g <= step x max(rate, t link)
    of that work; t = 0 is the FLOPs over the summed rate). And every layer runs somewhere, so
    at least the slowest layer over the stage that holds it: replicas of any type take
    micro-batches in proportion to their speed, so a layer shared by the MAX_STAGE_REPLICAS
    devices fastest at it takes 1 / (the sum of their rates). Without `mixed_replicas` only
    identical devices replicate a stage (ranked's fair step, which ranked.py has always
    measured that way)."""
    if not devices:
        return math.inf
    bandwidth = sum(d.memory_bandwidth_gbps for d in devices) * 1e9 * BANDWIDTH_EFFICIENCY
    traffic = sum(model.traffic) / bandwidth if bandwidth > 0 else 0.0
    work = _work_bound(model, devices)
    alike: dict[tuple, list[Device]] = {}
    for d in devices:
        alike.setdefault(alike_key(d, model.task), []).append(d)
    if not mixed_replicas:
        layer = max(min(model.compute_seconds(i, group[0]) / min(MAX_STAGE_REPLICAS, len(group))
                        for group in alike.values()) for i in range(len(model)))
        return max(work, traffic, layer)
    work = max(work, _shares_bound(model, list(alike.values())))
    layer = 0.0
    for i in range(len(model)):
        gradients = model.layers[i].parameter_bytes
        per_device: list[float] = []  # micro-batches a second of layer i on each device
        for group in alike.values():
            seconds = model.compute_seconds(i, group[0]) + model.gradient_seconds(gradients, group[0])
            per_device += [1.0 / seconds if seconds > 0 else math.inf] * len(group)
        rate = sum(sorted(per_device, reverse=True)[:MAX_STAGE_REPLICAS])  # 0 where no device computes it
        layer = max(layer, 1.0 / rate if rate > 0 else math.inf)
    return max(work, traffic, layer)


MAX_BOUND_VARIABLES = 20_000  # layers x kinds of device the shares bound solves for (dense rows); past it, skipped


# Every linear program is solved on this one thread. HiGHS keeps scheduler state per thread that
# calls it and does not hand all of it back: a dispatcher planning on its request threads grew
# by about 128 KiB per solve under bench/fuzz.py (memray: HighsTaskExecutor), 1.16x its memory
# after 1,000 SubmitJob and RunJob calls; 120 solves from four threads at a time grew a bare
# interpreter by 18 MiB, the same solves on one thread by nothing. The solves are small
# (MAX_BOUND_VARIABLES) and a plan waits for its own.
_SOLVER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lower-bound-lp")


def _shares_bound(model: Model, groups: Sequence[Sequence[Device]]) -> float:
    """The least step over fractional plans: each layer's micro-batches shared among the kinds of
    device in any proportions, a kind of n devices offering n x step seconds, a share x of layer
    l on a device of kind k costing x times its seconds there (compute, and trained, the
    gradients it returns and its part of the step's parameters: a device pays all of them
    whatever its share, so charging the share is less than any plan pays). Every placement is
    one such plan, so none beats the least; it ties each layer's gradients to the devices that
    compute it, which the closed forms cannot. A linear program (scipy's HiGHS); 0 where it
    finds nothing or is too large to solve here."""
    n, k = len(model), len(groups)
    if n * k > MAX_BOUND_VARIABLES or n == 0:
        return 0.0
    from scipy.optimize import linprog  # a dependency of jax's; imported only when a bound is asked for

    cost = np.empty((n, k))
    for j, group in enumerate(groups):
        d = group[0]
        for i in range(n):
            moved = model.layers[i].parameter_bytes
            cost[i, j] = model.compute_seconds(i, d) + model.gradient_seconds(moved, d) + model.load_seconds(moved, d)
    if not np.all(np.isfinite(cost).any(axis=1)):
        return math.inf  # a layer no device computes
    cost = np.where(np.isfinite(cost), cost, 1e30)
    scale = float(cost[cost < 1e30].max()) or 1.0  # seconds near 1 keep the solver's tolerances meaningful
    cost = np.minimum(cost / scale, 1e12)
    # variables: x[i, j] (row-major), then the step; minimise the step
    objective = np.zeros(n * k + 1)
    objective[-1] = 1.0
    capacity = np.zeros((k, n * k + 1))
    for j, group in enumerate(groups):
        capacity[j, j:n * k:k] = cost[:, j]
        capacity[j, -1] = -float(len(group))
    cover = np.zeros((n, n * k + 1))
    for i in range(n):
        cover[i, i * k:(i + 1) * k] = 1.0
    try:
        result = _SOLVER.submit(linprog, objective, A_ub=capacity, b_ub=np.zeros(k), A_eq=cover, b_eq=np.ones(n),
                                bounds=(0, None), method="highs").result()
    except ValueError:  # figures the solver refuses: the closed forms still bound the step
        return 0.0
    if result.status != 0:
        return 0.0
    return max(0.0, float(result.x[-1]) * scale * (1 - 1e-7))  # below the solver's tolerance: still a bound


def _work_bound(model: Model, devices: Sequence[Device]) -> float:
    """max over t >= 0 of (F + t G) / sum of max(rate, t x link): see lower_bound_seconds. The
    ratio is piecewise of that shape, so its maximum is at t = 0, at a device's rate / link, or
    as t grows without end (G over the summed links)."""
    rates = [d.peak_tflops * 1e12 * CATALOG_EFFICIENCY for d in devices]
    links = [link_gbps(d) * 1e9 * BANDWIDTH_EFFICIENCY for d in devices]
    flops = model.total_flops
    moved = 0.0
    if model.task.kind == TRAINING:  # every gradient each micro-batch, every parameter once a step
        steps = model.task.step_micro_batches or DEFAULT_STEP_MICRO_BATCHES
        moved = sum(layer.parameter_bytes for layer in model.layers) * (1.0 + 1.0 / steps)
    best = flops / sum(rates) if sum(rates) > 0 else math.inf
    if moved > 0:
        best = max(best, moved / sum(links))
        for t in {rate / link for rate, link in zip(rates, links) if link > 0}:
            best = max(best, (flops + t * moved) / sum(max(rate, t * link) for rate, link in zip(rates, links)))
    return best
