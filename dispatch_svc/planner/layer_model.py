"""The memory and cost model of a model placed layer by layer on devices (requirements B3-B6):
what a layer needs on a device, what a placement costs, how many devices a model needs.

Per layer l on device d, for a micro-batch of b rows:

    weights(l) = parameter bytes x (1 inference | 2 training: the weights and the gradient a
                 backward pass returns; the optimizer's state and the master copy of the
                 parameters stay in the dispatcher, strategies/pipeline_training.py)
                 + buffer bytes (state that is not trained: held once)
                 + shared (tied) parameter bytes when their owner sits on another device
    work(l)    = b x (activation in + activation out): what is live while l runs
    compute(l) = max(b x FLOPs / (peak rate at the rule's dtype x CATALOG_EFFICIENCY),
                     memory traffic / (memory bandwidth x BANDWIDTH_EFFICIENCY))
                 where memory traffic is the compulsory one: parameters read once per
                 micro-batch, b x (activation in + activation out); training multiplies both
                 by 4 (forward, then the backward call's forward again and its backward).
                 XLA's bytes accessed (in the layer table) is measured before fusion, counting
                 every intermediate, so it overstates what fused kernels move (30x for a
                 GPT-2 XL block at 1,024 tokens) and is not used here.
    send(l)    = b x activation bytes / (sender's link bandwidth x BANDWIDTH_EFFICIENCY),
                 paid by the sender when the next layer runs on another device

A device's memory is not a sum over its layers: it holds their weights, and the activations of
the micro-batches in flight, which peak in one layer at a time:

    inference: sum of weights + b x activation in of each run's first layer (the next
               micro-batch, arriving while one runs) + (1 + WORKSPACE_COPIES) x the largest
               work(l) (the running micro-batch's input and output, and as much again of
               workspace for the compiled layer's temporaries)
    training:  sum of weights + TRAINING_IN_FLIGHT x the sum of b x activation in (the
               trainer is GPipe with rematerialisation: the dispatcher keeps each micro-batch's
               stage input, and a backward call recomputes its forward, keeping every layer's
               input of that one micro-batch) + (2 + WORKSPACE_COPIES) x the largest work(l)
               (forward, the activation gradients, workspace)

A device's time per micro-batch is the sum of compute and send over its layers, and of its
stage_overhead_s (measured, calibration.py; 0 until then) for every stage it runs, shared with the
replicas of its stage when it has any (they take micro-batches in proportion to their speed, so
each is as busy; identical ones in turn). A trained stage's device also pays what the trainer
moves (strategies/pipeline_training.py): every backward call returns the stage's gradients to the
dispatcher, which applies the optimizer, and every optimizer step's new parameters reach each of
the stage's devices once:

    gradient(stage) = the stage's parameter bytes / (link x BANDWIDTH_EFFICIENCY), per
                      micro-batch the device runs (shared with its replicas like compute)
    load(stage)     = the same bytes / (link x BANDWIDTH_EFFICIENCY) / micro-batches per
                      step, on every device of the stage (not shared)

The step time is the busiest device's (in steady state the pipeline moves one micro-batch per
step); a job of m micro-batches takes about (one micro-batch through every stage) + (m - 1) x
step. A device's usable memory is its free memory less `headroom` of it. A layer whose FLOPs
the table does not give (None, not 0: 0 is a layer without arithmetic, such as a lookup)
counts FLOPS_PER_PARAMETER per parameter per sample.

The types it works on and their checks are in placement_types.py; the step no placement can
beat is lower_bound.py's.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Mapping, Sequence

import numpy as np

from accelmesh.errors import InvalidArgument
from accelmesh.scoring import Weights, normalised, weighted
from dispatch_svc.planner.placement_types import (
    DEFAULT_STEP_MICRO_BATCHES,
    INFERENCE,
    TRAINING,
    Device,
    Evaluation,
    LayerCost,
    NoRoom,
    Stage,
    Task,
    check_task,
)
from dispatch_svc.planner.throughput import CATALOG_EFFICIENCY

# Sustained fraction of datasheet memory and link bandwidth (streaming copies reach 80-90%).
BANDWIDTH_EFFICIENCY = 0.8
# A device that reports no link bandwidth (a host CPU) sends over 100 Gb/s Ethernet.
DEFAULT_LINK_GBPS = 12.5
PARAMETER_COPIES = {INFERENCE: 1, TRAINING: 2}  # training: weights and the gradient a backward returns
# Training: the forward call, then the backward call's forward again (rematerialisation) and its
# backward, about twice a forward.
COMPUTE_FACTOR = {INFERENCE: 1.0, TRAINING: 4.0}
# Workspace for a compiled layer's temporaries, in copies of its largest working set (input and
# output of one micro-batch): XLA's fused kernels keep far less than the unfused graph would.
WORKSPACE_COPIES = 1
# Micro-batches a pipeline-trained stage keeps every layer's input for: the one its backward call
# recomputes (GPipe with rematerialisation; the dispatcher stashes the stage inputs).
TRAINING_IN_FLIGHT = 1
# Copies of the largest working set live at once, workspace included: the running micro-batch
# (inference); its forward and its activation gradients (training).
WORKING_COPIES = {INFERENCE: 1 + WORKSPACE_COPIES, TRAINING: 2 + WORKSPACE_COPIES}
# Devices one stage may run on (itself and its replicas), taking micro-batches in turn. Each
# trained replica receives the step's parameters (load_seconds).
MAX_STAGE_REPLICAS = 8
# The most bytes a model may need in all (4 EiB): beyond anything placeable, and within int64.
MAX_NEED_BYTES = 2**62
FLOPS_PER_PARAMETER = 2.0  # a multiply and an add per parameter per sample (dense layers)


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
        # the first layer's input is not in the table: like its output
        self.act_in = [self.act[0]] + self.act[:-1]
        self.weights = [layer.parameter_bytes * copies + layer.buffer_bytes for layer in self.layers]
        self.work = [a + o for a, o in zip(self.act_in, self.act)]
        self.shared_need = [s * copies for s in self.shared]
        self._arrays: tuple[np.ndarray, ...] | None = None  # stage_needs' columns, made on first use
        # A layer alone on a device: what it needs there. The sum over any set of layers is at
        # least what device_memory charges them (a sum of maxima is at least their maximum).
        self.need = [self.weights[i] + self.activation_bytes([i], [i]) for i in range(len(self.layers))]
        total = sum(self.need) + sum(self.shared_need)
        if total > MAX_NEED_BYTES:  # past int64 the placement arithmetic (numpy) would overflow
            raise InvalidArgument(
                f"the model needs {total:,} bytes at spec.placement.micro_batch_rows {b}, more than any set of "
                f"devices holds ({MAX_NEED_BYTES:,}); use fewer rows per micro-batch, or check the layer table's "
                "parameter and activation bytes", field="spec.placement.micro_batch_rows")
        self.flops = []
        self.traffic = []
        for i, layer in enumerate(self.layers):
            flops = layer.flops_per_sample
            if flops is None:
                flops = FLOPS_PER_PARAMETER * layer.parameter_count
            weights = layer.parameter_bytes + layer.shared_parameter_bytes
            self.flops.append(b * flops * factor)
            self.traffic.append((weights + self.act_in[i] + self.act[i]) * factor)
        self.total_flops = sum(self.flops)

    def __len__(self) -> int:
        return len(self.layers)

    def compute_seconds(self, layer: int, device: Device) -> float:
        rate = device.peak_tflops * 1e12 * CATALOG_EFFICIENCY
        bandwidth = device.memory_bandwidth_gbps * 1e9 * BANDWIDTH_EFFICIENCY
        flops_s = self.flops[layer] / rate if rate > 0 else (math.inf if self.flops[layer] else 0.0)
        bytes_s = self.traffic[layer] / bandwidth if bandwidth > 0 else 0.0
        return max(flops_s, bytes_s)

    def gradient_seconds(self, gradient_bytes: float, device: Device) -> float:
        """Seconds a trained stage's backward call takes to return `gradient_bytes` from `device`
        (the module docstring's gradient); linear in the bytes; 0 for inference."""
        if self.task.kind != TRAINING:
            return 0.0
        return gradient_bytes / (link_gbps(device) * 1e9 * BANDWIDTH_EFFICIENCY)

    def load_seconds(self, gradient_bytes: float, device: Device) -> float:
        """Per micro-batch, a trained stage device's share of receiving the step's new parameters
        once per optimizer step (the module docstring's load); linear in the bytes; 0 for inference."""
        steps = self.task.step_micro_batches or DEFAULT_STEP_MICRO_BATCHES
        return self.gradient_seconds(gradient_bytes, device) / steps

    def send_seconds(self, layer: int, device: Device) -> float:
        """Seconds to send layer's output from `device` to another device."""
        return self.act[layer] / (link_gbps(device) * 1e9 * BANDWIDTH_EFFICIENCY)

    def activation_bytes(self, layers: Sequence[int], run_starts: Sequence[int]) -> int:
        """Activation memory of a device holding `layers`, whose consecutive runs start at
        `run_starts` (the module docstring's formula)."""
        if not layers:
            return 0
        peak = max(self.work[i] for i in layers) * WORKING_COPIES[self.task.kind]
        if self.task.kind == TRAINING:
            return TRAINING_IN_FLIGHT * sum(self.act_in[i] for i in layers) + peak
        return sum(self.act_in[i] for i in run_starts) + peak

    def stage_needs(self, first: int) -> np.ndarray:
        """stage_needs(first)[j - first - 1]: the memory layers first..j-1 need as one stage, with
        their tied copies (non-decreasing in j): the formula of activation_bytes over arrays."""
        if self._arrays is None:
            self._arrays = tuple(np.array(x, np.int64) for x in (
                self.weights, self.shared_need, self.owner, self.work, self.act_in))
        weights, shared, owner, work, act_in = (a[first:] for a in self._arrays)
        held = np.cumsum(weights + np.where((owner >= 0) & (owner < first), shared, 0))
        peak = np.maximum.accumulate(work) * WORKING_COPIES[self.task.kind]
        if self.task.kind == TRAINING:
            return held + TRAINING_IN_FLIGHT * np.cumsum(act_in) + peak
        return held + act_in[0] + peak

    def stage_need(self, first: int, end: int) -> int:
        """Memory layers first..end-1 need as one stage, with their tied copies."""
        return int(self.stage_needs(first)[end - first - 1])

    def total_need(self) -> int:
        """Memory the whole model needs as one stage: the least any set of devices must offer."""
        return self.stage_need(0, len(self.layers))

    def intensity(self) -> float:
        """FLOP per byte of memory traffic over the whole model (B2's arithmetic intensity)."""
        traffic = sum(self.traffic)
        return self.total_flops / traffic if traffic > 0 else 0.0


def link_gbps(device: Device) -> float:
    return device.link_gbps if device.link_gbps > 0 else DEFAULT_LINK_GBPS


def capacity(device: Device, task: Task) -> int:
    return int(device.memory_free_bytes * (1.0 - task.headroom))


def capacities(devices: Sequence[Device], task: Task) -> np.ndarray:
    """``capacity`` of every device as an int64 array (the same product, truncated the same way)."""
    return (np.array([d.memory_free_bytes for d in devices], float) * (1.0 - task.headroom)).astype(np.int64)


def evaluate(model: Model, devices: Sequence[Device], assignment: Sequence[str],
             replicas: Mapping[str, Sequence[str]] | None = None) -> Evaluation:
    """The predicted step time, memory and transfers of `assignment` (device id per layer);
    `replicas[d]`: further devices that each hold d's layers and take micro-batches in turn."""
    by_id = {d.id: d for d in devices}
    replicas = replicas or {}
    weights: dict[str, int] = {}
    held: dict[str, list[int]] = {}
    starts: dict[str, list[int]] = {}
    compute: dict[str, float] = {}
    send: dict[str, float] = {}
    stages: list[Stage] = []
    layer_memory, layer_seconds = [], []
    cross = 0
    for i, device_id in enumerate(assignment):
        device = by_id[device_id]
        need = model.weights[i]
        if model.owner[i] >= 0 and assignment[model.owner[i]] != device_id:
            need += model.shared_need[i]
        seconds = model.compute_seconds(i, device)
        layer_memory.append(need)
        layer_seconds.append(seconds)
        weights[device_id] = weights.get(device_id, 0) + need
        held.setdefault(device_id, []).append(i)
        compute[device_id] = compute.get(device_id, 0.0) + seconds
        send.setdefault(device_id, 0.0)
        if stages and stages[-1].device_id == device_id:
            last = stages[-1]
            stages[-1] = dataclasses.replace(last, layer_count=last.layer_count + 1,
                                             compute_seconds=last.compute_seconds + seconds)
        else:  # a new stage: one more call per micro-batch on its device
            seconds += device.stage_overhead_s  # the stage's, not the layer's (layer_seconds)
            compute[device_id] += device.stage_overhead_s
            starts.setdefault(device_id, []).append(i)
            if stages:
                cross += 1
                prev = stages[-1]
                out = model.send_seconds(i - 1, by_id[prev.device_id])
                stages[-1] = dataclasses.replace(prev, transfer_seconds=out)
                send[prev.device_id] += out
            stages.append(Stage(len(stages), device_id, i, 1, seconds, 0.0, tuple(replicas.get(device_id, ()))))
    memory = {d: weights[d] + model.activation_bytes(held[d], starts[d]) for d in weights}
    gradients = {d: sum(model.layers[i].parameter_bytes for i in layers) for d, layers in held.items()}
    for device_id in held:
        if device_id not in replicas:
            device = by_id[device_id]
            send[device_id] += model.gradient_seconds(gradients[device_id], device) + \
                model.load_seconds(gradients[device_id], device)
    shares: dict[str, tuple[float, ...]] = {}
    for device_id, copies in replicas.items():  # each copy holds what its original holds; the work is shared
        group = [by_id[d] for d in (device_id, *copies)]
        layers = held[device_id]
        sends = [i for i in layers if i + 1 < len(assignment) and assignment[i + 1] != device_id]
        runs = len(starts[device_id])
        own = [(sum(model.compute_seconds(i, d) for i in layers) + runs * d.stage_overhead_s,
                sum(model.send_seconds(i, d) for i in sends) + model.gradient_seconds(gradients[device_id], d))
               for d in group]
        # micro-batches in proportion to speed, so every device of the group is as busy
        speed = [1.0 / (c + t) if c + t > 0 else 1.0 for c, t in own]
        share = [v / sum(speed) for v in speed]
        for d, w, (c, t) in zip(group, share, own):
            memory[d.id] = memory[device_id]
            compute[d.id], send[d.id] = w * c, w * t + model.load_seconds(gradients[device_id], d)
        shares[device_id] = tuple(share)
    stages = [dataclasses.replace(st, shares=shares[st.device_id]) if st.device_id in shares else st for st in stages]
    step = max((compute[d] + send[d] for d in compute), default=0.0)
    over = [d for d, used in memory.items() if used > capacity(by_id[d], model.task)]
    return Evaluation(
        feasible=not over, step_seconds=step,
        latency_seconds=sum(s.compute_seconds + s.transfer_seconds for s in stages),
        cross_transfers=cross, stages=stages, memory_bytes=memory, compute_seconds=compute,
        transfer_seconds=send, layer_memory=layer_memory, layer_seconds=layer_seconds, over_memory=over)


def alike_key(device: Device, task: Task) -> tuple:
    """What makes devices interchangeable to a placement: type, rates, link, usable memory."""
    return (device.target_type, device.peak_tflops, device.memory_bandwidth_gbps, link_gbps(device),
            capacity(device, task), device.stage_overhead_s)


# -- how many devices (B6) ----------------------------------------------------------------------


def initial_scores(devices: Sequence[Device], weights: Weights) -> dict[str, float]:
    return dict(zip((d.id for d in devices), initial_score_array(devices, weights).tolist()))


def initial_score_array(devices: Sequence[Device], weights: Weights) -> np.ndarray:
    """``initial_scores`` in the devices' order, as an array."""
    rate, bandwidth = rates(devices)
    free = np.array([d.memory_free_bytes for d in devices], float)
    return status_scores(rate, bandwidth, free, np.zeros(len(devices)), weights)


Scores = dict[str, float] | np.ndarray  # by device id, or in the devices' order


def rates(devices: Sequence[Device]) -> tuple[np.ndarray, np.ndarray]:
    """Each device's free compute (TFLOP/s) and memory bandwidth (GB/s), as arrays."""
    return (np.array([d.peak_tflops for d in devices], float),
            np.array([d.memory_bandwidth_gbps for d in devices], float))


def status_scores(rate: np.ndarray, bandwidth: np.ndarray, free: np.ndarray, load: np.ndarray,
                  weights: Weights) -> np.ndarray:
    """Each device's status score (B1, B2) with `free` bytes left and `load` (the fraction of its
    compute the placement has reserved): accelmesh.scoring's formula over arrays."""
    idle = np.clip(1.0 - load, 0.0, None)
    return weighted(normalised(rate * idle, free, bandwidth * idle), weights)


def required_devices(model: Model, devices: Sequence[Device], scores: Scores) -> int:
    """The client's count, else the fewest best-scored devices whose usable memory holds the model."""
    task = model.task
    if task.device_count:
        if task.device_count > len(devices):
            raise InvalidArgument(f"spec.placement.device_count is {task.device_count} but only {len(devices)} devices "
                                  "match the job's constraints; ask for fewer or leave it 0")
        return task.device_count
    total = model.total_need()
    usable = 0
    for count, device in enumerate(best_first(devices, scores), start=1):
        usable += capacity(device, task)
        if usable >= total:
            return count
    raise NoRoom(
        f"the model needs {total:,} bytes ({gib(total)}) for {task.kind} with micro-batches of "
        f"{task.micro_batch_rows} rows, but all {len(devices)} devices offer {usable:,} usable bytes "
        f"({gib(usable)}, after {task.headroom:.0%} headroom): short by {total - usable:,} bytes",
        shortfall_bytes=total - usable)


def by_score(devices: Sequence[Device], scores: dict[str, float]) -> list[Device]:
    return sorted(devices, key=lambda d: (-scores.get(d.id, 0.0), d.id))


FIRST_CHUNK = 64  # best_first's first helping; each next one is four times larger


def best_first(devices: Sequence[Device], scores: Scores) -> Iterator[Device]:
    """``by_score``'s order, a helping at a time: the best of the devices not yet given (every
    one tied with the last of them too), sorted. A caller that wants the best few of 80,000
    devices then sorts a few hundred, not all of them."""
    values = scores if isinstance(scores, np.ndarray) else np.array([scores.get(d.id, 0.0) for d in devices], float)
    remaining, chunk = np.arange(len(devices)), FIRST_CHUNK
    while remaining.size:
        if remaining.size > chunk:
            worst_taken = np.partition(-values[remaining], chunk - 1)[chunk - 1]
            taken = -values[remaining] <= worst_taken
            batch, remaining = remaining[taken], remaining[~taken]
        else:
            batch, remaining = remaining, remaining[:0]
        yield from (devices[i] for i in sorted(batch.tolist(), key=lambda i: (-values[i], devices[i].id)))
        chunk *= 4


def top_by_score(devices: Sequence[Device], scores: Scores, count: int) -> list[Device]:
    """``by_score(devices, scores)[:count]`` without sorting them all."""
    out = []
    for device in best_first(devices, scores):
        if len(out) == count:
            break
        out.append(device)
    return out


def summary(strategy: str, evaluation: Evaluation) -> str:
    fits = "fits" if evaluation.feasible else f"does NOT fit on {', '.join(evaluation.over_memory)}"
    return (f"{strategy}: step {evaluation.step_seconds * 1e3:.3f} ms per micro-batch on "
            f"{len(evaluation.memory_bytes)} device(s), {evaluation.cross_transfers} cross-device transfer(s); {fits}")


def gib(value: int) -> str:
    return f"{value / 2**30:.2f} GiB"
