"""The data of a layer placement (requirements B3-B6): the devices and the task a placement is made for,
what a placement is predicted to cost, and the check of a task; the rows of a layer table and their
check are accelmesh.layer_table's (a client checks a table with them before it asks). The cost
model that fills them in is layer_model.py.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from accelmesh.errors import InvalidArgument, ResourceExhausted
from accelmesh.layer_table import MAX_LAYERS, LayerCost, check_layers  # noqa: F401 (re-exported)
from accelmesh.scoring import Weights

RANKED, BALANCED, AUTO = "ranked", "balanced", "auto"
STRATEGIES = (RANKED, BALANCED, AUTO)
INFERENCE, TRAINING = "inference", "training"

DEFAULT_HEADROOM = 0.1
DEFAULT_MICRO_BATCH_ROWS = 8
# Micro-batches per optimizer step a training job without its own figure is planned for: GPipe
# finds the pipeline bubble negligible from 4 micro-batches per stage on, and 32 covers 8 stages.
DEFAULT_STEP_MICRO_BATCHES = 32


@dataclass(frozen=True)
class Device:
    """A candidate device as placement sees it: its free status right now."""

    id: str
    target_type: str
    peak_tflops: float  # free peak rate at the device's rule dtype (after utilisation and reservations)
    memory_free_bytes: int
    memory_bandwidth_gbps: float
    link_gbps: float = 0.0  # interconnect, one direction; 0 means DEFAULT_LINK_GBPS
    stage_overhead_s: float = 0.0  # what every stage call on it costs beyond the compute (calibration.py)


@dataclass(frozen=True)
class Task:
    kind: str = INFERENCE
    micro_batch_rows: int = DEFAULT_MICRO_BATCH_ROWS
    headroom: float = DEFAULT_HEADROOM
    device_count: int = 0  # 0: derived from memory (B6)
    weights: Weights = Weights(1 / 3, 1 / 3, 1 / 3)
    # Training: micro-batches per optimizer step, over which a replicated stage's gradient
    # exchange is spread; 0: DEFAULT_STEP_MICRO_BATCHES.
    step_micro_batches: int = 0


@dataclass(frozen=True)
class Stage:
    index: int
    device_id: str
    first_layer: int
    layer_count: int
    compute_seconds: float
    transfer_seconds: float
    replicas: tuple[str, ...] = ()  # further devices running the stage
    shares: tuple[float, ...] = ()  # of the micro-batches, per device of device_ids (empty: no replicas)

    @property
    def device_ids(self) -> tuple[str, ...]:
        return (self.device_id, *self.replicas)


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
    layer_memory: list[int]  # each layer's weights (and shared copy) on its device; activations are per device
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

    replicas: Mapping[str, tuple[str, ...]] = field(default_factory=dict)  # device -> devices copying its stage

    @property
    def devices(self) -> list[str]:
        """Devices used, in order of first use along the forward pass (a stage's replicas after it)."""
        return list(dict.fromkeys(d for device in self.assignment for d in (device, *self.replicas.get(device, ()))))


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
    if task.step_micro_batches < 0:
        raise InvalidArgument(f"the micro-batches per training step must be >= 0, got {task.step_micro_batches}")
    if task.device_count < 0:
        raise InvalidArgument("spec.placement.device_count must be >= 0 (0 derives it from memory), "
                              f"got {task.device_count}")
