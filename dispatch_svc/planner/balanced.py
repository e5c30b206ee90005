"""An order-preserving placement: contiguous stages over distinct, heterogeneous devices,
chosen to minimise the pipeline's predicted step time under each device's memory.

The ranked method (ranked.py) ignores layer order, so neighbouring layers can land on
different devices and activations cross devices many times; here each device takes one run
of consecutive layers.

Over a large pool most devices cannot matter: a plan uses at most `count` devices, so a device
that `count` others match or beat on everything a stage's time and memory depend on (rate,
memory bandwidth, link, usable memory) is never needed, since one of those is always free to
take its place at no loss. `_useful` keeps only the classes of the rest, which over 80,000
devices is a few hundred; the per-class tables are numpy arrays.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from dispatch_svc.planner.cover_search import MAX_DENSE_STATES, cover_path, dense_cover, dense_size, search_states
from dispatch_svc.planner.layer_model import (
    MAX_STAGE_REPLICAS,
    Model,
    alike_key,
    by_score,
    capacity,
    evaluate,
    link_gbps,
    rates,
    required_devices,
    status_scores,
    summary,
)
from dispatch_svc.planner.placement_types import BALANCED, ByDevice, Device, NoRoom, Placement
from dispatch_svc.planner.stage_spans import Spans, memory_reach, stage_tables

# Count vectors the search may visit before it merges device classes (see _classes).
MAX_SEARCH_STATES = 200_000
# Devices a plan may use when the client gives no count.
MAX_DEVICE_COUNT = 256
# Devices joined to the busiest stages after the exact search (_widen), at most.
MAX_WIDEN_ROUNDS = 16
# Count vectors up to which stages may be replicated: each vector then has a transition per
# class and replica count, and the search runs once per replica count; past it, none.
MAX_REPLICATED_STATES = 20_000


@dataclass
class _Class:
    """Interchangeable devices: same type, rate, bandwidths, usable memory and stage overhead."""

    devices: list[Device]
    capacity: int

    @property
    def example(self) -> Device:
        return self.devices[0]


def place_balanced(model: Model, devices: Sequence[Device]) -> Placement:
    """Contiguous stages over distinct devices minimising the step time, exactly; a stage may
    run on several identical devices taking micro-batches in turn (trained, each returns its
    gradients every micro-batch and receives the step's parameters: Model.gradient_seconds and
    Model.load_seconds).

    The step time is the largest stage time, and every candidate step time is the time of some
    stage (layers i..j-1 on a device class k, over r replicas), so a binary search over those
    values finds the optimum T with a feasibility test: can the layers be covered by stages of
    time <= T on at most `count` distinct devices? Covering a longer prefix never hurts, so for
    each vector of devices used per class only the longest prefix reached matters; vectors are
    explored by number of devices, so the cover found uses the fewest devices for that T.

    `count` is the client's device count, else every device offered (at most MAX_DEVICE_COUNT):
    the search then takes as many as lower the predicted step, since a plan on fewer devices is
    one of those it considers.

    Exact for tables without tied weights (tests check it against brute force). With ties,
    "a longer prefix never hurts" can fail by the shared bytes: a stage that starts after a
    tied layer's owner pays for a copy that a stage starting before it would not; such a
    split is then found only if it also fits with the copy.
    """
    task = model.task
    figures = _Figures.of(devices, task)
    values = status_scores(figures.rate, figures.bandwidth, figures.free, np.zeros(len(devices)), task.weights)
    if task.device_count:
        count = required_devices(model, devices, values)  # checks the count against the devices
        how = "the client's count"
    else:
        count = min(len(devices), MAX_DEVICE_COUNT)
        how = "every device offered" if count == len(devices) else f"at most {MAX_DEVICE_COUNT} of them"
    return _balanced(model, devices, values, count, how, figures)


@dataclass(frozen=True)
class _Figures:
    """What each device offers a stage, as arrays in the devices' order, read off them once."""

    ids: list[str]
    rate: np.ndarray  # TFLOP/s
    bandwidth: np.ndarray  # GB/s
    link: np.ndarray  # GB/s, link_gbps
    free: np.ndarray  # bytes, as floats (what scores read)
    caps: np.ndarray  # usable bytes (capacity), int64
    kind: np.ndarray  # target type, numbered

    @classmethod
    def of(cls, devices: Sequence[Device], task) -> _Figures:
        rate, bandwidth = rates(devices)
        free = np.array([d.memory_free_bytes for d in devices], float)
        types: dict[str, int] = {}
        return cls([d.id for d in devices], rate, bandwidth, np.array([link_gbps(d) for d in devices], float), free,
                   (free * (1.0 - task.headroom)).astype(np.int64),  # capacity(), the same product and truncation
                   np.array([types.setdefault(d.target_type, len(types)) for d in devices], np.int64))


def _balanced(model: Model, devices: Sequence[Device], values: np.ndarray, count: int,
              how: str, figures: _Figures) -> Placement:
    """The order-preserving dynamic program over device classes and a binary search on the step
    time. Kept in one function on purpose: its arrays (prefix sums, send costs, memory reach) and
    the recurrence that reads them are one invariant, easier to check read together than split."""
    n = len(model)
    useful, all_classes = _useful(figures, count)
    pool = [devices[i] for i in useful]
    classes, note = _classes(model, pool, dict(zip((d.id for d in pool), values[useful].tolist())), count)
    k_count = len(classes)
    cum, send, stalled = stage_tables(model, [cls.example for cls in classes])
    overhead = np.array([cls.example.stage_overhead_s for cls in classes], float)
    reach_mem = memory_reach(model, np.array([cls.capacity for cls in classes], np.int64))
    gradients = np.concatenate(([0.0], np.cumsum([layer.parameter_bytes for layer in model.layers], dtype=float)))
    # Model.gradient_seconds and load_seconds of one gradient byte (both linear in the bytes)
    per_call = np.array([model.gradient_seconds(1.0, cls.example) for cls in classes])
    per_step = np.array([model.load_seconds(1.0, cls.example) for cls in classes])
    spans = Spans(cum, send, reach_mem, gradients, per_call, per_step, overhead, stalled)
    if not spans.any():
        raise _no_split(model, classes, count, stalled)
    candidates = spans.candidates()
    avail = tuple(min(len(c.devices), count) for c in classes)

    exact = search_states(count, k_count) <= MAX_SEARCH_STATES
    replicate = search_states(count, k_count) <= MAX_REPLICATED_STATES
    most = MAX_STAGE_REPLICAS if replicate else 1
    replicas = [min(most, a) for a in avail]  # devices of a class one stage may run on
    candidates = np.unique(np.concatenate([spans.candidates(r) for r in range(1, max(replicas) + 1)]))
    # Beyond the search budget: devices in a fixed order, fastest first, each taking the longest
    # stage it can (optimal for that order, not over all orders; the explanation says so).
    in_order = sorted(((k, d) for k, c in enumerate(classes) for d in c.devices),
                      key=lambda kd: (-kd[1].peak_tflops, -classes[kd[0]].capacity, kd[1].id))[:count]

    def cover(limit: float, count: int = count) -> list[tuple[int, int, int]] | None:
        """Stages (class, first layer, devices) covering every layer with stage times <= limit on
        at most `count` devices, the fewest such, or None (a stage on r devices: Spans)."""
        if not exact:
            reach = spans.reach(limit)
            stages, prefix = [], 0
            for k, _ in in_order[:count]:
                if reach[k, prefix] > prefix:
                    stages.append((k, prefix, 1))
                    prefix = int(reach[k, prefix])
                    if prefix == n:
                        return stages
            return None
        reaches = [spans.reach(limit, r) for r in range(1, max(replicas) + 1)]
        if dense_size(avail, count) <= MAX_DENSE_STATES:
            return dense_cover(reaches, replicas, avail, count, n)
        levels: list[dict[tuple[int, ...], int]] = [{} for _ in range(count + 1)]
        levels[0][(0,) * k_count] = 0
        parents: dict[tuple[int, ...], tuple[tuple[int, ...], int, int, int]] = {}
        for used in range(count):  # vectors by devices used: the first cover found uses the fewest
            for vec, prefix in levels[used].items():
                for k in range(k_count):
                    for r in range(1, min(replicas[k], avail[k] - vec[k], count - used) + 1):
                        j = int(reaches[r - 1][k, prefix])
                        if j <= prefix:
                            continue
                        new = vec[:k] + (vec[k] + r,) + vec[k + 1:]
                        level = levels[used + r]
                        if level.get(new, -1) < j:
                            level[new] = j
                            parents[new] = (vec, k, prefix, r)
            done = [vec for vec, prefix in levels[used + 1].items() if prefix == n]
            if done:
                return cover_path(parents, min(done))
            levels[used + 1] = {v: p for v, p in levels[used + 1].items() if p < n}
        return None

    def search(budget: int) -> list[tuple[int, int, int]] | None:
        """The cover at the smallest candidate step time on at most `budget` devices."""
        low, high = 0, len(candidates) - 1
        found = cover(float(candidates[high]), budget)
        if found is None:
            return None
        while low < high:
            mid = (low + high) // 2
            attempt = cover(float(candidates[mid]), budget)
            if attempt is not None:
                high, found = mid, attempt
            else:
                low = mid + 1
        return found

    stages = search(count)
    if stages is None:
        raise _no_split(model, classes, count, stalled)
    if not exact:
        note += f"; over {MAX_SEARCH_STATES:,} search states, so devices were taken fastest first (not exact)"
    if not replicate:
        note += f"; no replicated stages (over {MAX_REPLICATED_STATES:,} search states)"
    assignment, copies, evaluation = _assigned(model, pool, classes, stages)
    exact_step = evaluation.step_seconds
    copies, evaluation = _widen(model, pool, classes, assignment, copies, evaluation, count)
    # Fewer pipeline stages, the devices left over joining them by speed, can beat every plan of
    # identical replicas (a slow device sharing a fast one's micro-batches, no hop between them):
    # the search again on 1, 2, 4, ... devices, each widened, the best kept (where the search is
    # small enough to run a few more times: MAX_REPLICATED_STATES).
    budget = 1
    while replicate and budget < len(set(assignment)):
        fewer = search(budget)
        if fewer is not None:
            other = _assigned(model, pool, classes, fewer)
            widened = _widen(model, pool, classes, other[0], other[1], other[2], count)
            if widened[1].step_seconds < evaluation.step_seconds * (1 - 1e-9):
                assignment, (copies, evaluation) = other[0], widened
        budget *= 2
    if evaluation.step_seconds < exact_step * (1 - 1e-9):
        note += (f"; then unused devices joined the busiest stages, micro-batches shared by speed "
                 f"({exact_step * 1e3:.3f} -> {evaluation.step_seconds * 1e3:.3f} ms)")
    caps = ByDevice(figures.ids, figures.caps)
    usable = {d.id: capacity(d, model.task) for d in pool}
    unused = (f", of which the {k_count} not outmatched {count} times over can matter" if k_count < all_classes
              else "")
    lines = [
        f"balanced: {n} layers in order over {len(devices)} devices in {all_classes} classes of identical devices"
        f"{unused}{note}; at most {count} device(s) ({how}); binary search over {len(candidates):,} "
        f"candidate step times -> {evaluation.step_seconds * 1e3:.3f} ms per micro-batch with {len(stages)} stage(s)"]
    for stage in evaluation.stages:
        last = model.layers[stage.first_layer + stage.layer_count - 1].name
        lines.append(
            f"stage {stage.index}: {model.layers[stage.first_layer].name}..{last} ({stage.layer_count} layers, "
            f"{evaluation.memory_bytes[stage.device_id]:,} of {usable[stage.device_id]:,} B) on {stage.device_id} "
            f"compute {stage.compute_seconds * 1e3:.3f} ms + send {stage.transfer_seconds * 1e3:.3f} ms"
            + (f", replicated on {', '.join(stage.replicas)} ({1 + len(stage.replicas)} devices sharing micro-batches "
               f"{' / '.join(f'{w:.0%}' for w in stage.shares)})" if stage.replicas else ""))
    lines.append(summary(BALANCED, evaluation))
    # initial_scores and capacity of every device, as the arrays at hand
    return Placement(BALANCED, tuple(assignment), evaluation, caps, ByDevice(figures.ids, values), lines, copies)


def _useful(f: _Figures, count: int) -> tuple[np.ndarray, int]:
    """The indices of the devices a best placement on at most `count` of them may need, and how
    many classes of identical devices (_classes' key) there are in all.

    A device may be left out when `count` others have at least its rate, bandwidth, link and
    usable memory: a plan using it uses fewer than `count` others, so one of those is free and
    takes its stage as fast, with as much room. Found per (bandwidth, link) group as the first
    `count` layers of its (usable memory, rate) skyline: sorted by memory, a device on the skyline
    has more rate than every one before it, and one below the first `count` layers has at least
    `count` before it with as much of both. A device as good as a kept one in every figure is
    kept too, so a class is kept or dropped whole."""
    # One sort: by (bandwidth, link) group, then most memory, then most rate, then type: a class
    # of identical devices (_classes' key) is then a run, a group a run of runs.
    order = np.lexsort((f.kind, -f.rate, -f.caps, f.link, f.bandwidth))
    changed = [np.diff(values[order]) != 0 for values in (f.bandwidth, f.link, f.caps, f.rate, f.kind)]
    new_group = np.concatenate(([True], changed[0] | changed[1]))
    new_like = new_group | np.concatenate(([False], changed[2] | changed[3]))  # alike in every figure
    new_class = new_like | np.concatenate(([False], changed[4]))
    like = np.empty(len(order), np.int64)
    like[order] = np.cumsum(new_like) - 1
    kept = np.zeros(len(order), bool)
    for members in np.split(order, np.flatnonzero(new_group)[1:]):
        for _ in range(count):
            if not members.size:
                break
            best_before = np.maximum.accumulate(np.concatenate(([-np.inf], f.rate[members][:-1])))
            skyline = f.rate[members] > best_before
            kept[members[skyline]] = True
            members = members[~skyline]
    wanted = np.zeros(int(like.max(initial=-1)) + 1, bool)
    wanted[like[kept]] = True
    return np.flatnonzero(wanted[like]), int(new_class.sum())


def _classes(model: Model, devices: Sequence[Device], scores: dict[str, float], count: int
             ) -> tuple[list[_Class], str]:
    """Group interchangeable devices; a plan uses at most `count` of a class, best-scored first.
    If the search could outgrow MAX_SEARCH_STATES, devices of one type merge into one class
    figured at the group's smallest memory and rates (a safe under-estimate; the note says so)."""
    groups: dict[tuple, list[Device]] = {}
    for d in by_score(devices, scores):
        key = alike_key(d, model.task)
        groups.setdefault(key, []).append(d)
    classes = [_Class(g[:count], key[4]) for key, g in groups.items()]
    if search_states(count, len(classes)) <= MAX_SEARCH_STATES:
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
                     link_gbps=min(link_gbps(d) for d in group),
                     stage_overhead_s=max(d.stage_overhead_s for d in group))
        members = [Device(d.id, target_type, **floor) for d in group]
        merged.append(_Class(members, capacity(members[0], model.task)))
    return merged, f" (merged per type from {len(classes)} classes, at each type's smallest memory and rates)"


def _assigned(model: Model, pool: Sequence[Device], classes: Sequence[_Class], stages: list[tuple[int, int, int]]):
    """The device of every layer and the replicas of each stage's first device, for the search's
    stages (class, first layer, devices); and their evaluation."""
    taken = [0] * len(classes)
    assignment: list[str] = []
    copies: dict[str, tuple[str, ...]] = {}
    bounds = [prefix for _, prefix, _ in stages] + [len(model)]
    for (k, prefix, r), end in zip(stages, bounds[1:]):
        device, *others = classes[k].devices[taken[k]:taken[k] + r]
        taken[k] += r
        if others:
            copies[device.id] = tuple(d.id for d in others)
        assignment.extend([device.id] * (end - prefix))
    return assignment, copies, evaluate(model, pool, assignment, copies)


def _widen(model: Model, pool: Sequence[Device], classes: Sequence[_Class], assignment: Sequence[str],
           copies: dict[str, tuple[str, ...]], evaluation, count: int):
    """After the exact search over identical replicas, greedily: while fewer than `count` devices
    are used, the unused device (one per class is tried) whose joining the busiest stage lowers
    that stage's time most, the step not growing, joins it, taking micro-batches in proportion to its speed (HetPipe's
    heterogeneous data parallelism within a stage); at most MAX_WIDEN_ROUNDS joins, each stage on
    at most MAX_STAGE_REPLICAS devices. Never worse than the exact plan; not exact itself."""
    used = set(evaluation.memory_bytes)
    spare = [[d for d in cls.devices if d.id not in used] for cls in classes]
    owners = set(assignment)
    for _ in range(MAX_WIDEN_ROUNDS):
        if len(used) >= count:
            break
        busiest = max(evaluation.compute_seconds,
                      key=lambda d: evaluation.compute_seconds[d] + evaluation.transfer_seconds[d])
        primary = busiest if busiest in owners else next(p for p, c in copies.items() if busiest in c)
        if 1 + len(copies.get(primary, ())) >= MAX_STAGE_REPLICAS:
            break
        # the busiest stage's time drops, the step does not grow: several stages as busy each get help in turn
        best, busy = None, _busy(evaluation, primary)
        for k, free in enumerate(spare):
            if not free or classes[k].capacity < evaluation.memory_bytes[primary]:
                continue
            trial = {**copies, primary: (*copies.get(primary, ()), free[0].id)}
            tried = evaluate(model, pool, assignment, trial)
            if tried.feasible and tried.step_seconds <= evaluation.step_seconds and \
                    _busy(tried, primary) < (best[0] if best else busy) * (1 - 1e-9):
                best = (_busy(tried, primary), k, trial, tried)
        if best is None:
            break
        _, k, copies, evaluation = best
        used.add(spare[k].pop(0).id)
    return copies, evaluation


def _busy(evaluation, device_id: str) -> float:
    return evaluation.compute_seconds[device_id] + evaluation.transfer_seconds[device_id]


def _no_split(model: Model, classes: Sequence[_Class], count: int | None = None,
              stalled: np.ndarray | None = None) -> NoRoom:
    """Why no cover exists: a layer larger than every device's memory, else the split. Devices
    with no free compute for the layers (`stalled`, stage_tables) are named apart: memory is not
    what they lack, and their compute comes back when the jobs holding it end."""
    biggest = max(range(len(model)), key=lambda i: model.need[i])
    most = max(c.capacity for c in classes)
    if model.need[biggest] > most:
        return NoRoom(f"layer {model.layers[biggest].name!r} needs {model.need[biggest]:,} bytes but the largest "
                      f"usable free memory of any device is {most:,} bytes: "
                      f"short by {model.need[biggest] - most:,} bytes",
                      shortfall_bytes=model.need[biggest] - most)
    idle = [] if stalled is None else [c for c, row in zip(classes, stalled) if row.any()]
    if len(idle) == len(classes):
        return NoRoom(f"no device offered has compute free now to run the {len(model)} layers on", shortfall_bytes=0)
    if idle:
        return NoRoom(f"no split of the {len(model)} layers into at most {count} contiguous stage(s) fits the memory "
                      "of the devices with compute free now (some have none)", shortfall_bytes=0)
    return NoRoom(f"no split of the {len(model)} layers into at most {count} contiguous stage(s) fits the devices' "
                  "memory", shortfall_bytes=0)

