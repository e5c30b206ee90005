"""What the dispatcher's domain works with, and nothing of how it is reached: the `Inventory`,
`Compiler` and `Workers` ports (clients/ and dataplane/workers.py implement them over gRPC; tests
fake only the one they use), the `InputFeed` a job's inputs arrive through, the plain records that
cross them, and what only the running dispatcher knows of a job (`LiveJob`, `LiveJobs`)."""

from __future__ import annotations

import threading
from collections.abc import Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from accelmesh import errors
from accelmesh.programs import Program
from accelmesh.runtime.tensors import PlaceTensor
from dispatch_svc.dataplane.descriptors import ArtifactRef, Build, JobDevice, ShardCall, ShardOutput, StoredRefs
from dispatch_svc.dataplane.device_queues import CancelScope, DevicePool
from dispatch_svc.jobs import records as m
from dispatch_svc.jobs.stored_inputs import InputFeed

__all__ = ["ArtifactRef", "Build", "Compiler", "InputFeed", "Inventory", "JobDevice", "LiveJob", "LiveJobs",
           "RuleChoice", "ScoredStatus", "Scoring", "ShardCall", "ShardOutput", "ShardWork", "StoredRefs", "Workers"]


@dataclass(frozen=True)
class ScoredStatus:
    """A device as the inventory's ScoreDevices ranked it (requirements B1, B2)."""

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


class Inventory(Protocol):
    """The device database: candidates, real-time refreshes, scores and reservations."""

    def candidate_devices(self, constraints: m.Constraints) -> list[JobDevice]: ...
    def refresh(self, devices: Sequence[JobDevice]) -> list[JobDevice]: ...
    # `device_ids`: score exactly these (the refreshed candidates), still narrowed by the constraints.
    def score_devices(self, kind: str, precision: str, intensity: float,
                      weights: tuple[float, float, float] | None, constraints: m.Constraints,
                      device_ids: Sequence[str] = ()) -> Scoring: ...
    def reserve(self, job_id: str, claims: Sequence[tuple[str, int]], ttl_s: int) -> None: ...
    # Moves the end of the job's leases on `device_ids` to `ttl_s` from now, all or none, within
    # `timeout_s`: NotFound when one lapsed or was released, Unavailable when the inventory did not answer.
    def renew(self, job_id: str, device_ids: Sequence[str], ttl_s: int, timeout_s: float) -> None: ...
    def release(self, job_id: str) -> None: ...
    # A spot check found the node's outputs wrong (execution/verification.py): its devices stop
    # being candidates until an operator trusts it again.
    def mark_suspect(self, address: str, reason: str) -> None: ...
    # What decides whether a queued job could start: every live reservation and every device's
    # health, as a value compared with an earlier one (admission/queue.py tries a job again only on a change).
    def pool_state(self) -> Hashable: ...
    # The devices any reservation holds now: a queue's scheduling round counts the others free.
    def reserved_device_ids(self) -> frozenset[str]: ...
    # Which of `device_ids` the inventory holds lost now (their node stopped answering its polls),
    # from its own table, without polling any node: a running job asks this every few seconds.
    def lost_devices(self, device_ids: Sequence[str]) -> frozenset[str]: ...


class Compiler(Protocol):
    """The program registry and the builds per target type."""

    def describe_program(self, name: str, version: str) -> Program: ...
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


class Workers(Protocol):
    """The data plane: shards run on named devices of the workers."""

    # `held_keys`: names in `arrays` -> keys unique per content within the job (the content under
    # a key never changes during the job); a worker gets such an input in full once, then by key.
    # `place_outputs`: where outputs go as they arrive (None, or None from it: returned in memory).
    # `stored`: inputs that lie in the worker's store, and outputs kept there (ShardOutput.outputs
    # are then `Placed` records named by their object ids).
    def execute(self, job_id: str, shard_index: int, attempt: int, device: JobDevice, build: Build,
                artifact: ArtifactRef, arrays: Sequence[tuple[str, np.ndarray]], rows: int,
                scope: CancelScope, held_keys: Mapping[str, str] | None = None,
                place_outputs: PlaceTensor | None = None, stored: StoredRefs | None = None) -> ShardOutput: ...
    # Shards of one job for one device sent together (one message each way where the worker takes
    # batches): for each call, in order as it ends, its outputs or the ShardFailed of its attempt.
    def execute_group(self, calls: Sequence[ShardCall], scope: CancelScope) -> Iterator[ShardOutput | Exception]: ...
    # DATA_PATH_DIRECT: frees the objects `ticket` covers in the store of the worker at `address`,
    # or those of them in `object_ids` (best effort: the store's idle expiry frees what this does not).
    def release_objects(self, address: str, ticket: bytes, object_ids: Sequence[str] = ()) -> None: ...
    # The job's shards are over: its streams closed, the tensors workers hold for it dropped.
    def release(self, job_id: str) -> None: ...
    # The device is lost to the job: the shards in flight on it fail now with `cause` (their
    # stream cancelled), and no shard of the job is sent to it again.
    def drop_device(self, job_id: str, device_id: str, cause: str) -> None: ...


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
    lease: Any = None  # its admission.reservations.LeaseKeeper, once admitted: `lapse` says why it stopped
    done: threading.Event = field(default_factory=threading.Event)
    # Set once the job holds its devices, went to the queue, or ended: what a queue pass waits for.
    settled: threading.Event = field(default_factory=threading.Event)
    # The client's input refused as it arrived (a block header beyond the spec, while the job plans
    # or runs): why the job stopped, in place of the cancel that stopped it (`refuse`).
    refused: errors.AccelmeshError | None = None
    direct: Any = None  # DATA_PATH_DIRECT: its execution.direct.DirectJob (None: its bytes go through here)

    def refuse(self, error: errors.AccelmeshError) -> None:
        """Stop the job for `error`, the client's fault: its scope is cancelled, so whatever it waits
        for (a compile, a shard) ends now, and the job ends FAILED with `error`, not CANCELLED."""
        if self.refused is None:
            self.refused = error
        self.scope.cancel(str(error))

    def check(self) -> None:
        """Raise why the job must stop now: its lapsed lease, its refused input, or Cancelled when it
        was cancelled. A lapse or a refusal is raised as a copy: the one held gathers no caller's frames."""
        lapse = self.lease.lapse if self.lease is not None else None
        for held in (lapse, self.refused):
            if held is not None:
                raise type(held)(str(held), reason=held.reason, field=held.field)
        self.scope.check()


class LiveJobs:
    """The jobs this dispatcher runs now, by id: a job is in it from its start (or its claim from
    the queue, or its takeover) until it ended or went to the queue."""

    def __init__(self):
        self._jobs: dict[str, LiveJob] = {}
        self._changed = threading.Condition()

    def add(self, job_id: str) -> LiveJob:
        live = LiveJob()
        with self._changed:
            self._jobs[job_id] = live
        return live

    def get(self, job_id: str) -> LiveJob | None:
        with self._changed:
            return self._jobs.get(job_id)

    def remove(self, job_id: str) -> None:
        with self._changed:
            self._jobs.pop(job_id, None)
            self._changed.notify_all()

    def count(self) -> int:
        with self._changed:
            return len(self._jobs)

    def ids(self) -> list[str]:
        with self._changed:
            return list(self._jobs)

    def wait_empty(self, timeout_s: float) -> bool:
        with self._changed:
            return self._changed.wait_for(lambda: not self._jobs, timeout_s)

