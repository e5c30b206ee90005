"""What the dispatcher allows a job: what its spec may declare (`JobLimits`, refused before it is
planned) and what it may hold while it runs (`Limits`: shard and in-flight bytes, its
reservations' lease)."""

from __future__ import annotations

from dataclasses import dataclass

from accelmesh import errors
from dispatch_svc.planner.placement_types import MAX_LAYERS

# A job's reservations are a lease the inventory ends unless it is renewed: a dispatcher that dies
# frees its jobs' devices within one lease, a running job renews it (admission/reservations.py).
RESERVATION_TTL_S = 120  # lease length asked for, seconds; the dispatcher's ACCELMESH_RESERVATION_TTL_S
MIN_RESERVATION_TTL_S, MAX_RESERVATION_TTL_S = 1, 24 * 3600  # what the inventory grants

# How often a running job asks the inventory which of its devices are lost (execution/device_watch.py);
# the dispatcher's ACCELMESH_DEVICE_WATCH_S, 0 never asks.
DEVICE_WATCH_S = 2.0

MIB = 1024 * 1024
GIB = 1024 * MIB


@dataclass(frozen=True)
class JobLimits:
    """What one job may declare. Each costs the dispatcher memory or time before a byte of input
    arrives (planning makes an object per shard, a record keeps every name), so a spec over any
    of them is refused before it is planned, compiled or reserved, naming the variable to raise."""

    max_rows: int = 1 << 26  # ACCELMESH_MAX_JOB_ROWS: rows of a job's inputs (67,108,864)
    max_bytes: int = 16 * GIB  # ACCELMESH_MAX_JOB_BYTES: a job's declared input bytes plus its client parameters
    # ACCELMESH_MAX_JOB_SHARDS: shards a job's size needs (ACCELMESH_MAX_SHARD_BYTES each); a
    # pipeline's micro-batches, and once placed its micro-batches x stages
    max_shards: int = 4096
    max_training_bytes: int = 2 * GIB  # ACCELMESH_MAX_TRAINING_BYTES: a training job's inputs, held whole
    max_training_steps: int = 100_000  # ACCELMESH_MAX_TRAINING_STEPS: epochs x mini-batches (a loss each)
    max_layers: int = MAX_LAYERS  # ACCELMESH_MAX_MODEL_LAYERS: rows of spec.placement.layers (1,024 at most)
    max_spec_entries: int = 64  # ACCELMESH_MAX_SPEC_ENTRIES: inputs, platforms or capabilities one spec lists
    max_parameter_tensors: int = 4096  # ACCELMESH_MAX_PARAMETER_TENSORS: client parameter tensors (gpt2_xl: 772)
    # ACCELMESH_MAX_NAME_CHARS: a job id, program, version, job, input, parameter, layer or capability name
    max_name_chars: int = 256
    max_filter_chars: int = 4096  # ACCELMESH_MAX_FILTER_CHARS: spec.constraints.filter

    @staticmethod
    def variable(name: str) -> str:
        """The environment variable that sets limit `name`: what a refusal tells the operator to raise."""
        return LIMIT_VARIABLES[name]


LIMIT_VARIABLES = {
    "max_rows": "ACCELMESH_MAX_JOB_ROWS",
    "max_bytes": "ACCELMESH_MAX_JOB_BYTES",
    "max_shards": "ACCELMESH_MAX_JOB_SHARDS",
    "max_training_bytes": "ACCELMESH_MAX_TRAINING_BYTES",
    "max_training_steps": "ACCELMESH_MAX_TRAINING_STEPS",
    "max_layers": "ACCELMESH_MAX_MODEL_LAYERS",
    "max_spec_entries": "ACCELMESH_MAX_SPEC_ENTRIES",
    "max_parameter_tensors": "ACCELMESH_MAX_PARAMETER_TENSORS",
    "max_name_chars": "ACCELMESH_MAX_NAME_CHARS",
    "max_filter_chars": "ACCELMESH_MAX_FILTER_CHARS",
}
# The smallest value each may be set to: a job id is 16 characters, a program has a few inputs.
LIMIT_MINIMUMS = {"max_name_chars": 32, "max_spec_entries": 4, "max_filter_chars": 64}


@dataclass(frozen=True)
class Limits:
    max_shard_bytes: int  # inputs of one shard at most (ACCELMESH_MAX_SHARD_BYTES)
    inflight_bytes: int  # shard inputs held at once per job (ACCELMESH_INFLIGHT_BYTES)
    reservation_ttl_s: int = RESERVATION_TTL_S  # lease of a job's reservations, renewed while it runs
    # Of every data-parallel job's shards, at least, run again on another node and compared
    # (ACCELMESH_VERIFY_FRACTION): the floor a job's spec.verify_fraction can raise, never lower.
    verify_fraction: float = 0.0
    device_watch_s: float = DEVICE_WATCH_S  # how often a running job asks for its lost devices (0: never)

    def __post_init__(self):
        if not MIN_RESERVATION_TTL_S <= self.reservation_ttl_s <= MAX_RESERVATION_TTL_S:
            raise errors.InvalidArgument(
                f"reservation_ttl_s is {self.reservation_ttl_s}; set ACCELMESH_RESERVATION_TTL_S within "
                f"{MIN_RESERVATION_TTL_S}..{MAX_RESERVATION_TTL_S} seconds, the leases the inventory grants")
        if not 0.0 <= self.verify_fraction <= 1.0:
            raise errors.InvalidArgument(f"verify_fraction is {self.verify_fraction}; set ACCELMESH_VERIFY_FRACTION "
                                         "within 0 (off) .. 1 (every shard run again on another node)")
