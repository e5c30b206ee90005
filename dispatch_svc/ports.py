"""What the runner works with: the `Mesh` port (dispatch_svc.clients.mesh implements it over
gRPC), the `InputFeed` a job's inputs arrive through, and the plain records that cross them."""

from __future__ import annotations

import threading
from collections.abc import Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from accelmesh.programs import Program
from accelmesh.runtime.tensors import Placed, PlaceTensor
from dispatch_svc.jobs import records as m
from dispatch_svc.dataplane.device_queues import CancelScope, DevicePool

# A job's reservations are a lease the inventory ends unless it is renewed: a dispatcher that dies
# frees its jobs' devices within one lease, a running job renews it (strategies.context.LeaseKeeper).
RESERVATION_TTL_S = 120  # lease length asked for, seconds; the dispatcher's ACCELMESH_RESERVATION_TTL_S
MIN_RESERVATION_TTL_S, MAX_RESERVATION_TTL_S = 1, 24 * 3600  # what the inventory grants
RENEW_FRACTION = 1 / 3  # renewed every third of the lease: two renewals may fail before it lapses
# An inventory that did not answer is asked again at half the lease left, between these bounds;
# the lease lapses only once it ran out with no answer.
RENEW_RETRY_S, RENEW_RETRY_MIN_S = 1.0, 0.05


@dataclass(frozen=True)
class ArtifactRef:
    key: str
    digest: str
    format: str  # "stablehlo" or "executable"
    batch_size: int


@dataclass(frozen=True)
class Build:
    target_type: str
    rule_name: str
    compute_dtype: str
    rule: Any  # the rule as the compile service sent it; passed on to workers untouched
    device_ids: tuple[str, ...]
    portable: ArtifactRef
    executables: dict[int, ArtifactRef]


@dataclass(frozen=True)
class JobDevice:
    spec: Any  # accelmesh.hardware.model.DeviceSpec
    node_address: str
    target_type: str = ""

    @property
    def id(self) -> str:
        return self.spec.id


@dataclass(frozen=True)
class ScoredStatus:
    """A device as the inventory's ScoreDevices ranked it (MISSION B1, B2)."""

    score: float
    free_compute_tflops: float  # at the scoring precision, after utilisation and reservations
    memory_free_bytes: int
    utilization: float
    reserved_compute_fraction: float


@dataclass(frozen=True)
class Scoring:
    devices: dict[str, ScoredStatus]
    weights: tuple[float, float, float]  # compute, memory, bandwidth; normalised
    rule: str  # how the weights were derived


@dataclass(frozen=True)
class RuleChoice:
    target_type: str
    rule_name: str
    compute_dtype: str


@dataclass(frozen=True)
class ShardOutput:
    outputs: list[np.ndarray | Placed]  # Placed: written where the shard's `place_outputs` said
    queue_seconds: float
    load_seconds: float
    execute_seconds: float
    load_kind: str


class Mesh(Protocol):
    def candidate_devices(self, constraints: m.Constraints) -> list[JobDevice]: ...
    def refresh(self, devices: Sequence[JobDevice]) -> list[JobDevice]: ...
    def describe_program(self, name: str, version: str) -> Program: ...
    # `device_ids`: score exactly these (the refreshed candidates), still narrowed by the constraints.
    def score_devices(self, kind: str, precision: str, intensity: float,
                      weights: tuple[float, float, float] | None, constraints: m.Constraints,
                      device_ids: Sequence[str] = ()) -> Scoring: ...
    # `precision`: the job's Constraints.precision (records.PRECISIONS); rules computing in a dtype it
    # does not allow are passed over, and FailedPrecondition names a device it leaves without a rule.
    def explain_rule(self, device: JobDevice, precision: str = "") -> RuleChoice: ...
    def compile(self, program: Program, devices: Sequence[JobDevice], batch_sizes: Sequence[int],
                precision: str = "") -> list[Build]: ...
    # `backward`: the stage's backward pass (compile_svc/programs/stages.py), for pipeline training.
    def compile_stage(self, program: Program, devices: Sequence[JobDevice], first: int, count: int,
                      batch_sizes: Sequence[int] = (), backward: bool = False,
                      precision: str = "") -> tuple[Program, list[Build]]: ...
    def fetch_parameters(self, program: Program, seed: int) -> list[np.ndarray]: ...
    def reserve(self, job_id: str, claims: Sequence[tuple[str, int]], ttl_s: int) -> None: ...
    # Moves the end of the job's leases on `device_ids` to `ttl_s` from now, all or none, within
    # `timeout_s`: NotFound when one lapsed or was released, Unavailable when the inventory did not answer.
    def renew(self, job_id: str, device_ids: Sequence[str], ttl_s: int, timeout_s: float) -> None: ...
    def release(self, job_id: str) -> None: ...
    # What decides whether a queued job could start: every live reservation and every device's
    # health, as a value compared with an earlier one (queue.py tries a job again only on a change).
    def pool_state(self) -> Hashable: ...
    # The devices any reservation holds now: a queue's scheduling round counts the others free.
    def reserved_device_ids(self) -> frozenset[str]: ...
    # `held_keys`: names in `arrays` -> keys unique per content within the job (the content under
    # a key never changes during the job); a worker gets such an input in full once, then by key.
    # `place_outputs`: where outputs go as they arrive (None, or None from it: returned in memory).
    def execute(self, job_id: str, shard_index: int, attempt: int, device: JobDevice, build: Build,
                artifact: ArtifactRef, arrays: Sequence[tuple[str, np.ndarray]], rows: int,
                scope: CancelScope, held_keys: Mapping[str, str] | None = None,
                place_outputs: PlaceTensor | None = None) -> ShardOutput: ...


class InputFeed(Protocol):
    def parameters(self) -> list[tuple[str, np.ndarray]]: ...
    def blocks(self) -> Iterator[tuple[int, list[np.ndarray]]]: ...


@dataclass
class ShardWork:
    index: int
    first_row: int
    rows: int
    device_id: str
    inputs: list[np.ndarray] = field(default_factory=list)
    nbytes: int = 0
    params: list[tuple[str, np.ndarray]] | None = None  # training: this step's parameters
    place_outputs: PlaceTensor | None = None  # inference: its outputs' rows on disk (JobOutputs.placer)


@dataclass
class LiveJob:
    """What only the running dispatcher knows about a job: how to stop it and what is final."""

    scope: CancelScope = field(default_factory=CancelScope)
    span: Any = None  # the job's span: opened by run, ended with the job
    released_rows: int = 0  # rows of concatenated outputs that are final, from row 0
    concat_names: tuple[str, ...] = ()  # the outputs those rows belong to
    error: BaseException | None = None
    failure: BaseException | None = None  # a shard that finally failed while inputs still arrive
    pool: DevicePool | None = None  # the job's devices, once it runs
    lease: Any = None  # its strategies.context.LeaseKeeper, once it reserved: `lapse` says why it stopped
    done: threading.Event = field(default_factory=threading.Event)
    # Set once the job holds its devices, went to the queue, or ended: what a queue pass waits for.
    settled: threading.Event = field(default_factory=threading.Event)

    def check(self) -> None:
        """Raise why the job must stop now: its lapsed lease, or Cancelled when it was cancelled.
        A lapse is raised as a copy: the one the keeper holds gathers no caller's frames."""
        lapse = self.lease.lapse if self.lease is not None else None
        if lapse is not None:
            raise type(lapse)(str(lapse), reason=lapse.reason, field=lapse.field)
        self.scope.check()
