"""The data of a layer placement (MISSION B3-B6): the rows of a layer table, the devices and the
task a placement is made for, what a placement is predicted to cost, and the checks of a task and
a layer table. The cost model that fills them in is layer_model.py.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from accelmesh.errors import InvalidArgument, ResourceExhausted
from accelmesh.scoring import Weights

RANKED, BALANCED, AUTO = "ranked", "balanced", "auto"
STRATEGIES = (RANKED, BALANCED, AUTO)
INFERENCE, TRAINING = "inference", "training"

DEFAULT_HEADROOM = 0.1
DEFAULT_MICRO_BATCH_ROWS = 8
# Layers a table may have: placing 1,024 over 150 devices takes ~0.7 s (balanced) here.
MAX_LAYERS = 1024


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


class ByDevice(Mapping):
    """A value per device id, kept as an array in the candidates' order: a placement over 80,000
    candidates reads two of these back for the few devices it uses, so the index from id to
    position is made on the first lookup, not while planning."""

    def __init__(self, ids: Sequence[str], values: np.ndarray):
        self._ids, self._values = ids, values
        self._index: dict[str, int] | None = None

    def __getitem__(self, device_id: str):
        if self._index is None:
            self._index = {d: i for i, d in enumerate(self._ids)}
        return self._values[self._index[device_id]].item()

    def __iter__(self) -> Iterator[str]:
        return iter(self._ids)

    def __len__(self) -> int:
        return len(self._ids)


@dataclass
class Placement:
    strategy: str
    assignment: tuple[str, ...]  # device id of each layer, in layer order
    evaluation: Evaluation
    capacity_bytes: Mapping[str, int]  # usable memory of each candidate before placing
    scores: Mapping[str, float]  # each candidate's status score before placing
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
    if len(layers) > MAX_LAYERS:
        raise InvalidArgument(f"{where} has {len(layers)} rows; at most {MAX_LAYERS} can be placed (the balanced "
                              "search grows with their square): describe the model by blocks, not by operation")
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
