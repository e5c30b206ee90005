"""What a shard is sent to and with, and what it answers: the device it runs on, the build and
artifact of that device's target type, and its outputs with the worker's timings. Plain records
shared by the clients that produce them (inventory, compiler) and the data plane that uses them."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from accelmesh.runtime.tensors import Placed, PlaceTensor


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
    tolerance: float = 1e-5  # the rule's: largest relative error against an fp32 reference


@dataclass(frozen=True)
class JobDevice:
    spec: Any  # accelmesh.hardware.model.DeviceSpec
    node_address: str
    target_type: str = ""

    @property
    def id(self) -> str:
        return self.spec.id


@dataclass(frozen=True)
class ShardOutput:
    outputs: list[np.ndarray | Placed]  # Placed: written where the shard's `place_outputs` said
    queue_seconds: float
    load_seconds: float
    execute_seconds: float
    load_kind: str


@dataclass(frozen=True)
class StoredRefs:
    """A DATA_PATH_DIRECT shard's inputs and outputs in its worker's object store (execution/direct.py)."""

    scope: str  # "<owner>|<job id>": whose objects
    inputs: tuple[tuple[str, str], ...]  # (input name, object id), after the tensors sent with the shard
    output_prefix: str  # the outputs are kept as "<prefix><output index>"


@dataclass(frozen=True)
class ShardCall:
    """One shard attempt as the `Workers` port sends it (Workers.execute's arguments, but the scope):
    for a group of them sent together (Workers.execute_group)."""

    job_id: str
    shard_index: int
    attempt: int
    device: JobDevice
    build: Build
    artifact: ArtifactRef
    arrays: Sequence[tuple[str, np.ndarray]]
    rows: int
    held_keys: Mapping[str, str] | None = None
    place_outputs: PlaceTensor | None = None
    stored: StoredRefs | None = None
    span: Any = None  # the shard's span, whose place in the trace the worker's span joins; None: the current one
