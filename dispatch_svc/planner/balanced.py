"""An order-preserving placement: contiguous stages over distinct, heterogeneous devices,
chosen to minimise the pipeline's predicted step time under each device's memory.

The ranked method (ranked.py) ignores layer order, so neighbouring layers can land on
different devices and activations cross devices many times; here each device takes one run
of consecutive layers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from dispatch_svc.planner.layer_model import (
    Model, by_score, capacity, evaluate, initial_scores, link_gbps, required_devices, summary,
)
from dispatch_svc.planner.placement_types import BALANCED, Device, NoRoom, Placement

# Count vectors the search may visit before it merges device classes (see _classes).
MAX_SEARCH_STATES = 200_000


@dataclass
class _Class:
    """Interchangeable devices: same type, rate, bandwidths and usable memory."""

    devices: list[Device]
    capacity: int

    @property
    def example(self) -> Device:
        return self.devices[0]


def place_balanced(model: Model, devices: Sequence[Device]) -> Placement:
    """Contiguous stages over distinct devices minimising the step time, exactly.

    The step time is the largest stage time, and every candidate step time is the time of some
    stage (layers i..j-1 on a device class k), so a binary search over those values finds the
    optimum T with a feasibility test: can the layers be covered by at most `count` stages
    of time <= T on distinct devices? Covering a longer prefix never hurts, so for each vector
    of devices used per class only the longest prefix reached matters; vectors are explored by
    number of devices, so the first cover found uses the fewest devices.

    Exact for tables without tied weights (tests check it against brute force). With ties,
    "a longer prefix never hurts" can fail by the shared bytes: a stage that starts after a
    tied layer's owner pays for a copy that a stage starting before it would not; such a
    split is then found only if it also fits with the copy.
    """
    task = model.task
    scores = initial_scores(devices, task.weights)
    count = required_devices(model, devices, scores)
    explain = []
    while True:
        try:
            placement = _balanced(model, devices, scores, count, explain)
            return placement
        except NoRoom:
            if task.device_count or count >= len(devices):
                raise
            explain.append(f"no contiguous split fits {count} device(s); trying {count + 1}")
            count += 1


def _balanced(model: Model, devices: Sequence[Device], scores: dict[str, float], count: int,
              explain: list[str]) -> Placement:
    """The order-preserving dynamic program over device classes and a binary search on the step
    time. Kept in one function on purpose: its arrays (prefix sums, send costs, memory reach) and
    the recurrence that reads them are one invariant, easier to check read together than split."""
    n = len(model)
    classes, note = _classes(model, devices, scores, count)
    k_count = len(classes)
    # Per class: compute prefix sums, the send cost at each boundary, the memory reach.
    cum = np.zeros((k_count, n + 1))
    send = np.zeros((k_count, n + 1))  # send[k][j]: a stage ending before layer j sends layer j-1's output
    for k, cls in enumerate(classes):
        d = cls.example
        cum[k, 1:] = np.cumsum([model.compute_seconds(i, d) for i in range(n)])
        send[k, 1:n] = [model.send_seconds(j - 1, d) for j in range(1, n)]
    reach_mem = np.zeros((k_count, n), dtype=np.int64)  # largest j with layers i..j-1 fitting class k
    for k, cls in enumerate(classes):
        for i in range(n):
            used, j = 0, i
            while j < n:
                extra = model.need[j] + (model.shared_need[j] if 0 <= model.owner[j] < i else 0)
                if used + extra > cls.capacity:
                    break
                used += extra
                j += 1
            reach_mem[k, i] = j
    spans = {}  # (k, i) -> stage times for j = i+1 .. reach
    values = []
    for k in range(k_count):
        for i in range(n):
            j_max = reach_mem[k, i]
            if j_max > i:
                times = cum[k, i + 1: j_max + 1] - cum[k, i] + send[k, i + 1: j_max + 1]
                spans[k, i] = times
                values.append(times)
    if not values:
        raise _no_split(model, classes)
    candidates = np.unique(np.concatenate(values))
    avail = tuple(min(len(c.devices), count) for c in classes)

    exact = _search_states(count, k_count) <= MAX_SEARCH_STATES
    # Beyond the search budget: devices in a fixed order, fastest first, each taking the longest
    # stage it can (optimal for that order, not over all orders; the explanation says so).
    in_order = sorted(((k, d) for k, c in enumerate(classes) for d in c.devices),
                      key=lambda kd: (-kd[1].peak_tflops, -classes[kd[0]].capacity, kd[1].id))[:count]

    def cover(limit: float) -> list[tuple[int, int]] | None:
        """Stages (class, first layer) covering every layer with stage times <= limit, or None."""
        reach = np.full((k_count, n), -1, dtype=np.int64)
        for (k, i), times in spans.items():
            ok = np.nonzero(times <= limit)[0]
            if ok.size:
                reach[k, i] = i + 1 + int(ok[-1])
        if not exact:
            stages, prefix = [], 0
            for k, _ in in_order:
                if reach[k, prefix] > prefix:
                    stages.append((k, prefix))
                    prefix = int(reach[k, prefix])
                    if prefix == n:
                        return stages
            return None
        level = {(0,) * k_count: 0}
        parents: dict[tuple[int, ...], tuple[tuple[int, ...], int, int]] = {}
        for _ in range(count):
            nxt: dict[tuple[int, ...], int] = {}
            for vec, prefix in level.items():
                for k in range(k_count):
                    if vec[k] >= avail[k] or reach[k, prefix] <= prefix:
                        continue
                    j = int(reach[k, prefix])
                    new = vec[:k] + (vec[k] + 1,) + vec[k + 1:]
                    if nxt.get(new, -1) < j:
                        nxt[new] = j
                        parents[new] = (vec, k, prefix)
                        if j == n:
                            return _path(parents, new)
            level = {v: p for v, p in nxt.items() if p < n}
            if not level:
                return None
        return None

    low, high = 0, len(candidates) - 1
    stages = cover(float(candidates[high]))
    if stages is None:
        raise _no_split(model, classes, count)
    while low < high:  # the smallest candidate step time with a cover
        mid = (low + high) // 2
        attempt = cover(float(candidates[mid]))
        if attempt is not None:
            high, stages = mid, attempt
        else:
            low = mid + 1
    if not exact:
        note += f"; over {MAX_SEARCH_STATES:,} search states, so devices were taken fastest first (not exact)"
    taken = [0] * k_count
    assignment: list[str] = []
    bounds = [prefix for _, prefix in stages] + [n]
    for (k, prefix), end in zip(stages, bounds[1:]):
        device = classes[k].devices[taken[k]]
        taken[k] += 1
        assignment.extend([device.id] * (end - prefix))
    evaluation = evaluate(model, devices, assignment)
    caps = {d.id: capacity(d, model.task) for d in devices}
    lines = [
        f"balanced: {n} layers in order over {len(devices)} devices in {k_count} classes of identical devices"
        f"{note}; at most {count} stage(s); binary search over {len(candidates):,} candidate step times "
        f"-> {evaluation.step_seconds * 1e3:.3f} ms per micro-batch with {len(stages)} stage(s)"]
    for stage in evaluation.stages:
        last = model.layers[stage.first_layer + stage.layer_count - 1].name
        lines.append(
            f"stage {stage.index}: {model.layers[stage.first_layer].name}..{last} ({stage.layer_count} layers, "
            f"{evaluation.memory_bytes[stage.device_id]:,} of {caps[stage.device_id]:,} B) on {stage.device_id} "
            f"compute {stage.compute_seconds * 1e3:.3f} ms + send {stage.transfer_seconds * 1e3:.3f} ms")
    lines.append(summary(BALANCED, evaluation))
    return Placement(BALANCED, tuple(assignment), evaluation, caps, scores, explain + lines)


def _classes(model: Model, devices: Sequence[Device], scores: dict[str, float], count: int
             ) -> tuple[list[_Class], str]:
    """Group interchangeable devices; a plan uses at most `count` of a class, best-scored first.
    If the search could outgrow MAX_SEARCH_STATES, devices of one type merge into one class
    figured at the group's smallest memory and rates (a safe under-estimate; the note says so)."""
    groups: dict[tuple, list[Device]] = {}
    for d in by_score(devices, scores):
        key = (d.target_type, d.peak_tflops, d.memory_bandwidth_gbps, link_gbps(d), capacity(d, model.task))
        groups.setdefault(key, []).append(d)
    classes = [_Class(g[:count], key[4]) for key, g in groups.items()]
    if _search_states(count, len(classes)) <= MAX_SEARCH_STATES:
        return classes, ""
    by_type: dict[str, list[Device]] = {}
    for cls in classes:
        by_type.setdefault(cls.example.target_type, []).extend(cls.devices)
    merged = []
    for target_type, group in by_type.items():
        group = sorted(group, key=lambda d: (-capacity(d, model.task), -d.peak_tflops, d.id))[:count]
        floor = dict(peak_tflops=min(d.peak_tflops for d in group),
                     memory_free_bytes=min(d.memory_free_bytes for d in group),
                     memory_bandwidth_gbps=min(d.memory_bandwidth_gbps for d in group),
                     link_gbps=min(link_gbps(d) for d in group))
        members = [Device(d.id, target_type, **floor) for d in group]
        merged.append(_Class(members, capacity(members[0], model.task)))
    return merged, f" (merged per type from {len(classes)} classes, at each type's smallest memory and rates)"


def _path(parents: dict, vec: tuple[int, ...]) -> list[tuple[int, int]]:
    stages = []
    while any(vec):
        vec, k, prefix = parents[vec]
        stages.append((k, prefix))
    return stages[::-1]


def _search_states(count: int, classes: int) -> int:
    """Count vectors with at most `count` devices over `classes` classes."""
    return math.comb(count + classes, classes)


def _no_split(model: Model, classes: Sequence[_Class], count: int | None = None) -> NoRoom:
    biggest = max(range(len(model)), key=lambda i: model.need[i])
    most = max(c.capacity for c in classes)
    if model.need[biggest] > most:
        return NoRoom(f"layer {model.layers[biggest].name!r} needs {model.need[biggest]:,} bytes but the largest "
                      f"usable free memory of any device is {most:,} bytes: short by {model.need[biggest] - most:,} bytes",
                      shortfall_bytes=model.need[biggest] - most)
    return NoRoom(f"no split of the {len(model)} layers into at most {count} contiguous stage(s) fits the devices' "
                  "memory", shortfall_bytes=0)

