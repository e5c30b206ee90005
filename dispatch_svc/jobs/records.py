"""Plain-Python shapes of jobs: what a client asks for, how it is planned, what became of it."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from dispatch_svc.jobs.training_options import TrainingOptions
from dispatch_svc.planner.placement import LayerCost

INFERENCE, TRAINING = "inference", "training"
# A job's precision (Constraints.precision), as the compile service names it: fp32 only, bf16
# allowed, fp16 allowed (inference only); "" lets each device's rules decide.
PRECISIONS = ("", "fp32", "bf16", "fp16")

# Job states, in the order a job moves through them; the last three are final. A job that cannot
# get its devices (or its owner's quota) goes from PLANNING or COMPILING to QUEUED, and back to
# PLANNING when the queue (dispatch_svc/admission/queue.py) starts it again.
PLANNING, COMPILING, RUNNING, SUCCEEDED, FAILED, CANCELLED, QUEUED = (
    "planning", "compiling", "running", "succeeded", "failed", "cancelled", "queued",
)
FINAL_STATES = (SUCCEEDED, FAILED, CANCELLED)
MAX_PRIORITY = 1000  # JobSpec.priority: 0 (the default) to this

# Event types.
PLANNED, COMPILED, SHARD_STARTED, SHARD_FINISHED, SHARD_RETRIED, TRAINING_STEP, TAKEN_OVER, QUEUED_EVENT = (
    "planned", "compiled", "shard_started", "shard_finished", "shard_retried", "training_step", "taken_over",
    "queued",
)
SHARD_VERIFIED = "shard_verified"
INPUTS_WANTED = "inputs_wanted"  # DATA_PATH_DIRECT: the client asked to put shards' inputs (execution/direct.py)
# JobSpec.data_path: how the job's tensor bytes travel (through the dispatcher, or worker stores).
RELAY, DIRECT = "relay", "direct"
EVENT_FOR_STATE = {SUCCEEDED: "succeeded", FAILED: "failed", CANCELLED: "cancelled"}


@dataclass(frozen=True)
class InputDecl:
    name: str
    dtype: str  # numpy name, e.g. "float32"
    shape: tuple[int, ...]  # full shape, rows first

    @property
    def rows(self) -> int:
        return self.shape[0] if self.shape else 0


@dataclass(frozen=True)
class Constraints:
    platforms: tuple[str, ...] = ()
    capabilities: tuple[str, ...] = ()
    max_devices: int = 0  # 0: no limit
    filter: str = ""
    precision: str = ""  # one of PRECISIONS: the least precise compute dtype allowed; "": the rules decide


@dataclass(frozen=True)
class PlacementSpec:
    """A model-parallel job: where its layers go and how micro-batches flow (requirements B)."""

    strategy: str  # placement.RANKED, BALANCED or AUTO
    device_count: int = 0  # 0: derived from memory
    headroom: float | None = None  # None: the default
    weights: tuple[float, float, float] | None = None  # compute, memory, bandwidth; None: derived
    micro_batch_rows: int = 0  # 0: the default
    layers: tuple[LayerCost, ...] = ()  # an explicit table, for planning only


@dataclass(frozen=True)
class JobSpec:
    program: str
    version: str = ""
    kind: str = INFERENCE
    constraints: Constraints = Constraints()
    inputs: tuple[InputDecl, ...] = ()
    client_parameters: bool = False
    parameter_seed: int = 0
    training: TrainingOptions | None = None
    name: str = ""
    placement: PlacementSpec | None = None
    request_id: str = ""  # the client's idempotency key (AIP-155); "" for none
    priority: int = 0  # its place in the queue: higher first (0..MAX_PRIORITY)
    queue_timeout_s: float | None = None  # how long it may wait queued; None: the dispatcher's limit; 0: never
    verify_fraction: float = 0.0  # of its shards run again on another node (never below the dispatcher's floor)
    data_path: str = RELAY  # RELAY or DIRECT (docs/data-plane.md)

    @property
    def row_bytes(self) -> int:
        """The bytes of one row of the job's data inputs together: what a shard pays per row to move."""
        return sum(math.prod(i.shape[1:]) * np.dtype(i.dtype).itemsize for i in self.inputs)


@dataclass(frozen=True)
class TargetPlan:
    target_type: str
    rule: str
    compute_dtype: str
    artifact_key: str
    device_ids: tuple[str, ...]
    rows_per_second: float  # the marginal rate: a shard of n rows takes fixed_seconds + n / rate
    rate_source: str  # "measured" or "catalog"
    fixed_seconds: float = 0.0  # every shard's, whatever its rows
    rate_samples: int = 0  # shards the measured figures were fitted to; 0 for the catalog
    residual_seconds: float = 0.0  # residual standard error of a shard's seconds; 0: unknown


@dataclass(frozen=True)
class ShardPlan:
    index: int
    device_id: str
    target_type: str
    first_row: int
    rows: int
    predicted_seconds: float


@dataclass(frozen=True)
class LayerPlacement:
    layer: str
    order: int
    device_id: str
    target_type: str
    parameter_count: int
    memory_bytes: int
    compute_seconds: float
    stage: int


@dataclass(frozen=True)
class StagePlan:
    index: int
    device_id: str
    target_type: str
    first_layer: int
    layer_count: int
    compute_seconds: float
    transfer_seconds: float
    artifact_key: str = ""
    rule: str = ""
    replicas: tuple[str, ...] = ()  # further devices running the stage
    shares: tuple[float, ...] = ()  # of the micro-batches, per device of device_ids (with replicas)

    @property
    def device_ids(self) -> tuple[str, ...]:
        return (self.device_id, *self.replicas)


@dataclass(frozen=True)
class DeviceLoad:
    device_id: str
    target_type: str
    memory_bytes: int
    memory_capacity_bytes: int
    compute_seconds: float
    transfer_seconds: float
    layers: tuple[str, ...]
    score: float


@dataclass(frozen=True)
class PlacementSummary:
    strategy: str
    feasible: bool
    predicted_step_seconds: float = 0.0
    cross_device_transfers: int = 0
    device_count: int = 0
    error: str = ""
    devices: tuple[DeviceLoad, ...] = ()


@dataclass(frozen=True)
class PlacementPlan:
    strategy: str
    layers: tuple[LayerPlacement, ...]
    stages: tuple[StagePlan, ...]
    devices: tuple[DeviceLoad, ...]
    predicted_step_seconds: float
    cross_device_transfers: int
    device_count: int
    micro_batch_rows: int
    micro_batches: int
    predicted_seconds: float
    lower_bound_step_seconds: float
    weights: tuple[float, float, float]
    weights_rule: str
    candidates: tuple[PlacementSummary, ...]
    explain: tuple[str, ...]
    lower_bound_offered_step_seconds: float = 0.0  # over every device offered (0 in records made before it)


@dataclass(frozen=True)
class Plan:
    targets: tuple[TargetPlan, ...]
    shards: tuple[ShardPlan, ...]
    predicted_seconds: float
    equal_split_predicted_seconds: float
    placement: PlacementPlan | None = None


# How a sampled shard's second run on another node came out (ShardVerification.outcome).
MATCHED, NOT_VERIFIABLE = "matched", "not_verifiable"


@dataclass
class ShardVerification:
    outcome: str  # MATCHED or NOT_VERIFIABLE
    node_address: str  # the node whose outputs are the shard's
    verifier_device_id: str = ""
    verifier_node_address: str = ""
    error_ratio: float = 0.0  # largest difference in units of the tolerance
    tolerance: str = ""


@dataclass
class ShardRecord:
    index: int
    device_id: str
    target_type: str
    rule: str
    first_row: int
    rows: int
    attempts: int = 0
    failures: list[str] = field(default_factory=list)
    queue_seconds: float = 0.0
    load_seconds: float = 0.0
    execute_seconds: float = 0.0
    total_seconds: float = 0.0
    done: bool = False
    predicted_seconds: float = 0.0  # the plan's figure for its rows on the type that ran it
    verification: ShardVerification | None = None  # set on a shard sampled for verification

    @property
    def own_seconds(self) -> float:
        """The shard's own time, what the planner predicts: all the dispatcher saw, less the wait
        on the worker behind the device's previous shard (never below its execution)."""
        return max(self.total_seconds - self.queue_seconds, self.execute_seconds)


@dataclass
class QueueStatus:
    """Where a queued job waits and why. `position` is worked out when it is read (1: tried next)."""

    reason: str
    since: float  # when it was queued (first: a job tried again keeps its place)
    deadline: float  # when it fails if it has not started
    position: int = 0


@dataclass
class Event:
    index: int
    type: str
    time: float
    progress: float = 0.0
    message: str = ""
    plan: Plan | None = None
    shard: ShardRecord | None = None
    step: int = 0
    loss: float = 0.0
    queue: QueueStatus | None = None


@dataclass
class JobRecord:
    job_id: str
    spec: JobSpec
    state: str = PLANNING
    plan: Plan | None = None
    shards: list[ShardRecord] = field(default_factory=list)
    error: str = ""
    progress: float = 0.0
    created: float = 0.0
    ended: float | None = None
    losses: list[float] = field(default_factory=list)
    expires: float | None = None
    owner: str = ""  # Principal.key of whoever submitted it; "" for jobs from before owners existed
    # The measured makespan to set beside plan.predicted_seconds: first shard dispatched to the last
    # shard's outputs (training: the mean over its steps); 0 until a shard finished.
    measured_seconds: float = 0.0
    queue: QueueStatus | None = None  # while QUEUED
    verify_fraction: float = 0.0  # what it runs with: the larger of its spec's and the dispatcher's

    @property
    def final(self) -> bool:
        return self.state in FINAL_STATES
