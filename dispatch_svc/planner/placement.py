"""Placing a model's layers on devices (MISSION B3-B6), and predicting what a placement costs.

Two strategies share one cost and memory model, so their predictions compare like for like:

- `place_ranked` is the method of MISSION B: layers sorted by parameter count, largest first;
  each goes to the device with the best task-weighted status (accelmesh.scoring.combine, the
  inventory's own formula) among those whose free memory holds it; what the layer needs is
  reserved and the statuses are updated before the next layer (B5). The model's device count
  N (B6: the client's, else the fewest best devices whose memory holds it) decides the pool:
  the N largest layers each open a new device, the remaining layers go only to chosen ones.
- `place_balanced` keeps layer order: contiguous stages, one per device, chosen by dynamic
  programming to minimise the pipeline's step time under each device's memory.

Model, per layer l on device d, for a micro-batch of b rows:

    memory(l)  = parameter bytes x (1 inference | 3 training: weights, gradients, momentum)
                 + shared (tied) parameter bytes when their owner sits on another device
                 + b x (activation in + activation out) x ACTIVATION_COPIES[kind]
    compute(l) = max(b x FLOPs / (peak rate at the rule's dtype x CATALOG_EFFICIENCY),
                     memory traffic / (memory bandwidth x BANDWIDTH_EFFICIENCY))
                 where memory traffic = parameter bytes + b x (bytes accessed per sample less
                 the parameters), and training multiplies both by 3 (forward + backward)
    send(l)    = b x activation bytes / (sender's link bandwidth x BANDWIDTH_EFFICIENCY),
                 paid by the sender when the next layer runs on another device

A device's time per micro-batch is the sum of compute and send over its layers; the step time
is the busiest device's (in steady state the pipeline moves one micro-batch per step); a job
of m micro-batches takes about (one micro-batch through every stage) + (m - 1) x step. A
device's usable memory is its free memory less `headroom` of it. A layer table without FLOPs
counts FLOPS_PER_PARAMETER per parameter per sample.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from accelmesh.errors import InvalidArgument, ResourceExhausted
from accelmesh.scoring import DeviceStatus, Weights, combine
from dispatch_svc.planner.throughput import CATALOG_EFFICIENCY

RANKED, BALANCED, AUTO = "ranked", "balanced", "auto"
STRATEGIES = (RANKED, BALANCED, AUTO)
INFERENCE, TRAINING = "inference", "training"

DEFAULT_HEADROOM = 0.1
DEFAULT_MICRO_BATCH_ROWS = 8
# Sustained fraction of datasheet memory and link bandwidth (streaming copies reach 80-90%).
BANDWIDTH_EFFICIENCY = 0.8
# A device that reports no link bandwidth (a host CPU) sends over 100 Gb/s Ethernet.
DEFAULT_LINK_GBPS = 12.5
PARAMETER_COPIES = {INFERENCE: 1, TRAINING: 3}  # training: weights, gradients, SGD momentum
COMPUTE_FACTOR = {INFERENCE: 1.0, TRAINING: 3.0}  # backward ~ twice the forward
# Micro-batches whose activations a device holds at once: inference has the one running and
# the next arriving; training also keeps the forward activations for the backward pass.
ACTIVATION_COPIES = {INFERENCE: 2, TRAINING: 4}
FLOPS_PER_PARAMETER = 2.0  # a multiply and an add per parameter per sample (dense layers)
# Count vectors the balanced search may visit before it merges device classes (see _classes).
MAX_SEARCH_STATES = 200_000


@dataclass(frozen=True)
class LayerCost:
    """One row of a layer table (LayerInfo, or a client's explicit LayerCost)."""

    name: str
    order: int
    parameter_count: int
    parameter_bytes: int
    flops_per_sample: float = 0.0
    bytes_accessed_per_sample: float = 0.0
    activation_bytes_per_sample: int = 0
    shared_from: str = ""
    shared_parameter_bytes: int = 0


@dataclass(frozen=True)
class Device:
    """A candidate device as placement sees it: its free status right now."""

    id: str
    target_type: str
    peak_tflops: float  # free peak rate at the device's rule dtype (after utilisation and reservations)
    memory_free_bytes: int
    memory_bandwidth_gbps: float
    link_gbps: float = 0.0  # interconnect, one direction; 0 means DEFAULT_LINK_GBPS
    # For the status score (B1): compute at the scoring precision; default peak_tflops.
    score_tflops: float | None = None


@dataclass(frozen=True)
class Task:
    kind: str = INFERENCE
    micro_batch_rows: int = DEFAULT_MICRO_BATCH_ROWS
    headroom: float = DEFAULT_HEADROOM
    device_count: int = 0  # 0: derived from memory (B6)
    weights: Weights = Weights(1 / 3, 1 / 3, 1 / 3)


@dataclass(frozen=True)
class Stage:
    index: int
    device_id: str
    first_layer: int
    layer_count: int
    compute_seconds: float
    transfer_seconds: float


@dataclass
class Evaluation:
    """What a placement is predicted to cost (the same model for every strategy)."""

    feasible: bool  # every device's memory holds its layers
    step_seconds: float
    latency_seconds: float  # one micro-batch through every stage
    cross_transfers: int
    stages: list[Stage]
    memory_bytes: dict[str, int]
    compute_seconds: dict[str, float]
    transfer_seconds: dict[str, float]
    layer_memory: list[int]
    layer_seconds: list[float]
    over_memory: list[str]  # devices whose layers do not fit

    def predicted_seconds(self, micro_batches: int) -> float:
        return self.latency_seconds + max(0, micro_batches - 1) * self.step_seconds


@dataclass
class Placement:
    strategy: str
    assignment: tuple[str, ...]  # device id of each layer, in layer order
    evaluation: Evaluation
    capacity_bytes: dict[str, int]  # usable memory of each candidate before placing
    scores: dict[str, float]  # each candidate's status score before placing
    explain: list[str] = field(default_factory=list)

    @property
    def devices(self) -> list[str]:
        """Devices used, in order of first use along the forward pass."""
        return list(dict.fromkeys(self.assignment))


class NoRoom(ResourceExhausted):
    """No device set holds the model; `shortfall_bytes` says by how much. `wider` is True when
    devices outside the ones already chosen might still hold it."""

    def __init__(self, message: str, shortfall_bytes: int, wider: bool = False):
        super().__init__(message)
        self.shortfall_bytes = shortfall_bytes
        self.wider = wider


# -- the model ----------------------------------------------------------------------------------


class Model:
    """A layer table in layer order with the task's per-layer figures precomputed."""

    def __init__(self, layers: Sequence[LayerCost], task: Task):
        check_task(task)
        self.layers = sorted(layers, key=lambda layer: layer.order)
        self.task = task
        b = task.micro_batch_rows
        index = {layer.name: i for i, layer in enumerate(self.layers)}
        self.owner = [index[layer.shared_from] if layer.shared_from else -1 for layer in self.layers]
        self.shared = [layer.shared_parameter_bytes for layer in self.layers]
        copies, factor = PARAMETER_COPIES[task.kind], COMPUTE_FACTOR[task.kind]
        self.act = [b * layer.activation_bytes_per_sample for layer in self.layers]  # bytes out per micro-batch
        act_in = [self.act[0]] + self.act[:-1]  # the first layer's input is not in the table: like its output
        self.need = [layer.parameter_bytes * copies + (act_in[i] + self.act[i]) * ACTIVATION_COPIES[task.kind]
                     for i, layer in enumerate(self.layers)]
        self.shared_need = [s * copies for s in self.shared]
        self.flops = []
        self.traffic = []
        for layer in self.layers:
            flops = layer.flops_per_sample
            if flops <= 0 and layer.bytes_accessed_per_sample <= 0:
                flops = FLOPS_PER_PARAMETER * layer.parameter_count
            weights = layer.parameter_bytes + layer.shared_parameter_bytes
            per_sample = max(0.0, layer.bytes_accessed_per_sample - weights) or 2.0 * layer.activation_bytes_per_sample
            self.flops.append(b * flops * factor)
            self.traffic.append((weights + b * per_sample) * factor)
        self.total_flops = sum(self.flops)

    def __len__(self) -> int:
        return len(self.layers)

    def compute_seconds(self, layer: int, device: Device) -> float:
        rate = device.peak_tflops * 1e12 * CATALOG_EFFICIENCY
        bandwidth = device.memory_bandwidth_gbps * 1e9 * BANDWIDTH_EFFICIENCY
        flops_s = self.flops[layer] / rate if rate > 0 else (math.inf if self.flops[layer] else 0.0)
        bytes_s = self.traffic[layer] / bandwidth if bandwidth > 0 else 0.0
        return max(flops_s, bytes_s)

    def send_seconds(self, layer: int, device: Device) -> float:
        """Seconds to send layer's output from `device` to another device."""
        return self.act[layer] / (link_gbps(device) * 1e9 * BANDWIDTH_EFFICIENCY)

    def total_need(self) -> int:
        return sum(self.need)

    def intensity(self) -> float:
        """FLOP per byte of memory traffic over the whole model (B2's arithmetic intensity)."""
        traffic = sum(self.traffic)
        return self.total_flops / traffic if traffic > 0 else 0.0


def link_gbps(device: Device) -> float:
    return device.link_gbps if device.link_gbps > 0 else DEFAULT_LINK_GBPS


def capacity(device: Device, task: Task) -> int:
    return int(device.memory_free_bytes * (1.0 - task.headroom))


def evaluate(model: Model, devices: Sequence[Device], assignment: Sequence[str]) -> Evaluation:
    """The predicted step time, memory and transfers of `assignment` (device id per layer)."""
    by_id = {d.id: d for d in devices}
    memory: dict[str, int] = {}
    compute: dict[str, float] = {}
    send: dict[str, float] = {}
    stages: list[Stage] = []
    layer_memory, layer_seconds = [], []
    cross = 0
    for i, device_id in enumerate(assignment):
        device = by_id[device_id]
        need = model.need[i]
        if model.owner[i] >= 0 and assignment[model.owner[i]] != device_id:
            need += model.shared_need[i]
        seconds = model.compute_seconds(i, device)
        layer_memory.append(need)
        layer_seconds.append(seconds)
        memory[device_id] = memory.get(device_id, 0) + need
        compute[device_id] = compute.get(device_id, 0.0) + seconds
        send.setdefault(device_id, 0.0)
        if stages and stages[-1].device_id == device_id:
            last = stages[-1]
            stages[-1] = Stage(last.index, device_id, last.first_layer, last.layer_count + 1,
                               last.compute_seconds + seconds, 0.0)
        else:
            if stages:
                cross += 1
                prev = stages[-1]
                out = model.send_seconds(i - 1, by_id[prev.device_id])
                stages[-1] = Stage(prev.index, prev.device_id, prev.first_layer, prev.layer_count,
                                   prev.compute_seconds, out)
                send[prev.device_id] += out
            stages.append(Stage(len(stages), device_id, i, 1, seconds, 0.0))
    step = max((compute[d] + send[d] for d in compute), default=0.0)
    over = [d for d, used in memory.items() if used > capacity(by_id[d], model.task)]
    return Evaluation(
        feasible=not over, step_seconds=step,
        latency_seconds=sum(s.compute_seconds + s.transfer_seconds for s in stages),
        cross_transfers=cross, stages=stages, memory_bytes=memory, compute_seconds=compute,
        transfer_seconds=send, layer_memory=layer_memory, layer_seconds=layer_seconds, over_memory=over)


def lower_bound_seconds(model: Model, devices: Sequence[Device]) -> float:
    """Total work over total compute: every device's step time is at least its FLOPs over its
    rate, so the busiest is at least the whole model's FLOPs over the devices' summed rate."""
    rate = sum(d.peak_tflops for d in devices) * 1e12 * CATALOG_EFFICIENCY
    return model.total_flops / rate if rate > 0 else math.inf


# -- checks -------------------------------------------------------------------------------------


def check_task(task: Task) -> None:
    if task.kind not in (INFERENCE, TRAINING):
        raise InvalidArgument(f"task kind must be {INFERENCE} or {TRAINING}, got {task.kind!r}")
    if not (isinstance(task.headroom, (int, float)) and 0.0 <= task.headroom < 1.0):
        raise InvalidArgument(f"spec.placement.memory_headroom must be in [0, 1), got {task.headroom!r}; "
                              f"leave it unset for {DEFAULT_HEADROOM}")
    if task.micro_batch_rows < 1:
        raise InvalidArgument(f"spec.placement.micro_batch_rows must be >= 1, got {task.micro_batch_rows}")
    if task.device_count < 0:
        raise InvalidArgument(f"spec.placement.device_count must be >= 0 (0 derives it from memory), got {task.device_count}")


def check_layers(layers: Sequence[LayerCost], where: str = "spec.placement.layers") -> None:
    """A layer table must be complete and consistent; every problem names its row and field."""
    if not layers:
        raise InvalidArgument(f"{where} is empty; a model needs at least one layer")
    seen: dict[str, int] = {}
    orders = sorted(layer.order for layer in layers)
    if orders != list(range(len(layers))):
        raise InvalidArgument(f"{where}[].order must number the {len(layers)} layers 0..{len(layers) - 1} once each, "
                              f"got {orders}")
    by_name = {layer.name: layer for layer in layers}
    for i, layer in enumerate(layers):
        row = f"{where}[{i}]"
        if not layer.name:
            raise InvalidArgument(f"{row}.name is empty; every layer needs a unique name")
        if layer.name in seen:
            raise InvalidArgument(f"{row}.name {layer.name!r} is also {where}[{seen[layer.name]}].name; "
                                  "layer names must be unique")
        seen[layer.name] = i
        for name in ("parameter_count", "parameter_bytes", "flops_per_sample", "bytes_accessed_per_sample",
                     "activation_bytes_per_sample", "shared_parameter_bytes"):
            value = getattr(layer, name)
            if not math.isfinite(value) or value < 0:
                raise InvalidArgument(f"{row}.{name} of layer {layer.name!r} must be a finite number >= 0, got {value}")
        if layer.parameter_count and not layer.parameter_count / 8 <= layer.parameter_bytes <= layer.parameter_count * 8:
            raise InvalidArgument(
                f"{row}.parameter_bytes of layer {layer.name!r} is {layer.parameter_bytes} for "
                f"{layer.parameter_count} parameters ({layer.parameter_bytes / layer.parameter_count:.3g} bytes each); "
                "give the bytes at the stored dtype, between 1/8 and 8 bytes per parameter (4 for float32)")
        if layer.parameter_bytes and not layer.parameter_count:
            raise InvalidArgument(f"{row}.parameter_count of layer {layer.name!r} is 0 but parameter_bytes is "
                                  f"{layer.parameter_bytes}; give the count too")
        if layer.shared_from:
            owner = by_name.get(layer.shared_from)
            if owner is None or owner.order >= layer.order:
                raise InvalidArgument(f"{row}.shared_from {layer.shared_from!r} of layer {layer.name!r} must name an "
                                      "earlier layer of the table")
        elif layer.shared_parameter_bytes:
            raise InvalidArgument(f"{row}.shared_parameter_bytes of layer {layer.name!r} is set but shared_from is "
                                  "empty; name the layer whose parameters it shares")


# -- how many devices (B6) ----------------------------------------------------------------------


def initial_scores(devices: Sequence[Device], weights: Weights) -> dict[str, float]:
    statuses = [_status(d, d.memory_free_bytes, 0.0) for d in devices]
    return {d.id: score for d, (score, _) in zip(devices, combine(statuses, weights))}


def required_devices(model: Model, devices: Sequence[Device], scores: dict[str, float]) -> int:
    """The client's count, else the fewest best-scored devices whose usable memory holds the model."""
    task = model.task
    if task.device_count:
        if task.device_count > len(devices):
            raise InvalidArgument(f"spec.placement.device_count is {task.device_count} but only {len(devices)} devices "
                                  "match the job's constraints; ask for fewer or leave it 0")
        return task.device_count
    total = model.total_need()
    usable = 0
    for count, device in enumerate(_by_score(devices, scores), start=1):
        usable += capacity(device, task)
        if usable >= total:
            return count
    raise NoRoom(
        f"the model needs {total:,} bytes ({_gib(total)}) for {task.kind} with micro-batches of "
        f"{task.micro_batch_rows} rows, but all {len(devices)} devices offer {usable:,} usable bytes "
        f"({_gib(usable)}, after {task.headroom:.0%} headroom): short by {total - usable:,} bytes",
        shortfall_bytes=total - usable)


# -- ranked (B4-B6) -----------------------------------------------------------------------------


def place_ranked(model: Model, devices: Sequence[Device]) -> Placement:
    """MISSION B4-B6; when the device count was derived and the chosen devices cannot take a
    layer, one more device is allowed and the placement starts over (explained)."""
    scores = initial_scores(devices, model.task.weights)
    count = required_devices(model, devices, scores)
    while True:
        try:
            return _ranked(model, devices, scores, count)
        except NoRoom as exc:
            if model.task.device_count or count >= len(devices) or not exc.wider:
                raise
            count += 1


def _ranked(model: Model, devices: Sequence[Device], scores: dict[str, float], count: int) -> Placement:
    task = model.task
    weights = task.weights
    caps = {d.id: capacity(d, task) for d in devices}
    free = dict(caps)
    load = {d.id: 0.0 for d in devices}  # share of the model's FLOPs placed on the device
    assignment: list[str | None] = [None] * len(model)
    chosen: list[str] = []
    explain = [
        f"ranked: {len(model)} layers by parameter count, largest first, over {len(devices)} devices; "
        f"weights compute {weights.compute:.2f}, memory {weights.memory:.2f}, bandwidth {weights.bandwidth:.2f}; "
        f"the model needs {model.total_need():,} bytes, so {count} device(s)"
        + (" (the client's count)" if task.device_count else f" (usable memory after {task.headroom:.0%} headroom)")]
    order = sorted(range(len(model)), key=lambda i: (-model.layers[i].parameter_count, i))
    share = [f / model.total_flops if model.total_flops else 1.0 / len(model) for f in model.flops]
    for i in order:
        layer = model.layers[i]
        # Until `count` devices are chosen each layer opens a new one (the largest layers spread
        # over the devices the model needs); after that only chosen devices take layers (B6).
        opening = len(chosen) < count
        pool = [d for d in devices if (d.id in chosen) != opening]
        needs = {d.id: _need_on(model, i, d.id, assignment) for d in devices}
        fits = [d for d in pool if needs[d.id] <= free[d.id]]
        if not fits and opening:  # no new device holds it: a chosen one may
            pool = [d for d in devices if d.id in chosen]
            fits = [d for d in pool if needs[d.id] <= free[d.id]]
        if not fits:
            pool = pool or list(devices)
            largest = max(pool, key=lambda d: free[d.id])
            where = f"any of the {count} chosen devices" if not opening else "any device"
            raise NoRoom(
                f"layer {layer.name!r} ({layer.parameter_count:,} parameters) needs {needs[largest.id]:,} bytes but "
                f"{where} has at most {free[largest.id]:,} bytes free ({largest.id}): short by "
                f"{needs[largest.id] - free[largest.id]:,} bytes", shortfall_bytes=needs[largest.id] - free[largest.id],
                wider=not opening)
        statuses = [_status(d, free[d.id], load[d.id]) for d in devices]
        scored = {d.id: s for d, (s, _) in zip(devices, combine(statuses, weights))}
        ranked = sorted(fits, key=lambda d: (-scored[d.id], d.id))
        best = ranked[0]
        assignment[i] = best.id
        free[best.id] -= needs[best.id]
        load[best.id] += share[i]
        if model.owner[i] < 0:  # an owner joining a layer that shares its parameters frees the copy
            for j, owner in enumerate(model.owner):
                if owner == i and assignment[j] == best.id:
                    free[best.id] += model.shared_need[j]
        new = best.id not in chosen
        if new:
            chosen.append(best.id)
        runner_up = f"; next best {ranked[1].id} {scored[ranked[1].id]:.3f}" if len(ranked) > 1 else ""
        explain.append(
            f"{layer.name} ({layer.parameter_count:,} params, needs {needs[best.id]:,} B) -> {best.id} "
            f"score {scored[best.id]:.3f}{runner_up}; {len(fits)} of {len(pool)} "
            f"{'new' if new else 'chosen'} devices had room; reserved, {free[best.id]:,} B left"
            + (f"; device {len(chosen)} of {count}" if new else ""))
    placed = tuple(a for a in assignment if a is not None)
    evaluation = evaluate(model, devices, placed)
    explain.append(_summary(RANKED, evaluation))
    return Placement(RANKED, placed, evaluation, caps, scores, explain)


def _need_on(model: Model, i: int, device_id: str, assignment: Sequence[str | None]) -> int:
    """Memory layer i needs on device_id: shared parameters count unless their owner is there.
    An owner not yet placed counts (its copy is returned if it lands on the same device)."""
    need = model.need[i]
    if model.owner[i] >= 0 and assignment[model.owner[i]] != device_id:
        need += model.shared_need[i]
    return need


def _status(device: Device, free: int, load: float) -> DeviceStatus:
    rate = device.peak_tflops if device.score_tflops is None else device.score_tflops
    idle = max(0.0, 1.0 - load)
    return DeviceStatus(rate * idle, free, device.memory_bandwidth_gbps * idle)


# -- balanced -----------------------------------------------------------------------------------


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
    lines.append(_summary(BALANCED, evaluation))
    return Placement(BALANCED, tuple(assignment), evaluation, caps, scores, explain + lines)


def _classes(model: Model, devices: Sequence[Device], scores: dict[str, float], count: int
             ) -> tuple[list[_Class], str]:
    """Group interchangeable devices; a plan uses at most `count` of a class, best-scored first.
    If the search could outgrow MAX_SEARCH_STATES, devices of one type merge into one class
    figured at the group's smallest memory and rates (a safe under-estimate; the note says so)."""
    groups: dict[tuple, list[Device]] = {}
    for d in _by_score(devices, scores):
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


# -- baselines (bench/placement.py compares against them) ----------------------------------------


def sequential_fill(model: Model, devices: Sequence[Device]) -> Placement:
    """Fill devices in the order given, layer after layer, as big-model loaders do: a device
    takes layers until the next one does not fit. Infeasible if the devices run out."""
    caps = {d.id: capacity(d, model.task) for d in devices}
    assignment: list[str] = []
    k, used = 0, 0
    for i in range(len(model)):
        need = model.need[i]
        while k < len(devices) - 1 and used + need > caps[devices[k].id]:
            k, used = k + 1, 0
        assignment.append(devices[k].id)
        used += need
    evaluation = evaluate(model, devices, assignment)
    return Placement("sequential_fill", tuple(assignment), evaluation, caps, {}, [_summary("sequential_fill", evaluation)])


def parameter_split(model: Model, devices: Sequence[Device], count: int) -> Placement:
    """Contiguous stages with equal parameter counts on the first `count` devices given."""
    caps = {d.id: capacity(d, model.task) for d in devices}
    total = sum(layer.parameter_count for layer in model.layers) or 1
    assignment, seen = [], 0
    for layer in model.layers:
        stage = min(count - 1, int(count * (seen + layer.parameter_count / 2) / total))
        assignment.append(devices[stage].id)
        seen += layer.parameter_count
    evaluation = evaluate(model, devices, assignment)
    return Placement("parameter_split", tuple(assignment), evaluation, caps, {}, [_summary("parameter_split", evaluation)])


# -- helpers ------------------------------------------------------------------------------------


def _by_score(devices: Sequence[Device], scores: dict[str, float]) -> list[Device]:
    return sorted(devices, key=lambda d: (-scores.get(d.id, 0.0), d.id))


def _summary(strategy: str, evaluation: Evaluation) -> str:
    fits = "fits" if evaluation.feasible else f"does NOT fit on {', '.join(evaluation.over_memory)}"
    return (f"{strategy}: step {evaluation.step_seconds * 1e3:.3f} ms per micro-batch on "
            f"{len(evaluation.memory_bytes)} device(s), {evaluation.cross_transfers} cross-device transfer(s); {fits}")


def _gib(value: int) -> str:
    return f"{value / 2**30:.2f} GiB"
