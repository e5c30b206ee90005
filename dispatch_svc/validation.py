"""Checks of a job against its program, with messages that name the field and the fix, and of
what a worker returns for a shard against the program, before anything combines it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from accelmesh import errors
from accelmesh.programs import Program
from dispatch_svc import records as m
from dispatch_svc.device_queues import ShardFailed

INFERENCE_KINDS = ("function", "model", "uploaded")


def check_program_kind(program: Program, spec: m.JobSpec) -> None:
    if spec.kind == m.TRAINING:
        if program.kind != "training_step":
            raise errors.InvalidArgument(
                f"spec.kind is training but {program.ref} is a {program.kind}; train with a training_step program "
                f"such as mlp_train_step"
            )
        if spec.training is None:
            raise errors.InvalidArgument("spec.training is required for a training job (epochs, batch_size, ...)")
        names = {o.name for o in program.outputs}
        if "loss" not in names or not any(n.startswith("grad/") for n in names):
            raise errors.FailedPrecondition(f"{program.ref} does not return 'loss' and 'grad/...' outputs")
    elif program.kind not in INFERENCE_KINDS:
        raise errors.InvalidArgument(f"{program.ref} is a {program.kind}; run it as spec.kind = training")


def check_inputs(program: Program, spec: m.JobSpec) -> int:
    """The job's declared inputs match the program's signature; returns the row count."""
    if len(spec.inputs) != len(program.inputs):
        raise errors.InvalidArgument(
            f"spec.inputs declares {len(spec.inputs)} inputs; {program.ref} takes "
            f"{len(program.inputs)}: {', '.join(i.name for i in program.inputs)}"
        )
    rows = None
    for i, (given, wanted) in enumerate(zip(spec.inputs, program.inputs)):
        where = f"spec.inputs[{i}] '{given.name}'"
        if given.name != wanted.name:
            raise errors.InvalidArgument(f"{where}: {program.ref} expects input '{wanted.name}' here")
        if given.dtype != wanted.dtype:
            raise errors.InvalidArgument(f"{where}: dtype {given.dtype}, {program.ref} expects {wanted.dtype}")
        if len(given.shape) != len(wanted.shape) or tuple(given.shape[1:]) != tuple(wanted.shape[1:]):
            expected = ["rows", *wanted.shape[1:]]
            raise errors.InvalidArgument(f"{where}: shape {list(given.shape)}, {program.ref} expects {expected}")
        if rows is not None and given.rows != rows:
            raise errors.InvalidArgument(f"{where}: {given.rows} rows, the other inputs have {rows}")
        rows = given.rows
    if not rows:
        raise errors.InvalidArgument("spec.inputs: the batch is empty; send at least one row")
    return rows


def check_parameters(program: Program, given: list[tuple[str, np.ndarray]]) -> None:
    wanted = program.parameters
    if [name for name, _ in given] != [p.name for p in wanted]:
        raise errors.InvalidArgument(
            f"parameters: got {[name for name, _ in given]}, {program.ref} takes {[p.name for p in wanted]} in that order"
        )
    for (name, value), spec in zip(given, wanted):
        if str(value.dtype) != spec.dtype or tuple(value.shape) != tuple(spec.shape):
            raise errors.InvalidArgument(
                f"parameters '{name}': {value.dtype}{list(value.shape)}, {program.ref} expects {spec.dtype}{list(spec.shape)}"
            )


def check_shard_outputs(program: Program, outputs: Sequence[Any], shard_index: int, device_id: str,
                        rows: int) -> None:
    """What a worker returned for one shard of `rows` rows matches `program`'s outputs: their
    number, each one's dtype, and its shape (axis 0 is `rows` where the output is batched).

    A rogue or broken worker must not reach the combined result: a mismatch raises ShardFailed,
    so the attempt fails like a worker error and the shard is retried on another device."""
    where = f"shard {shard_index} on {device_id}"
    wanted = program.outputs
    if len(outputs) != len(wanted):
        names = ", ".join(f"'{o.name}'" for o in wanted)
        raise ShardFailed(f"{where} returned {len(outputs)} output{'' if len(outputs) == 1 else 's'}; "
                          f"{program.ref} returns {len(wanted)} ({names})")
    for value, spec in zip(outputs, wanted):
        got = np.asarray(value)
        if str(got.dtype) != spec.dtype:
            raise ShardFailed(f"{where} returned output '{spec.name}' of dtype {got.dtype}; "
                              f"{program.ref} declares {spec.dtype}")
        expected = (rows, *spec.shape[1:]) if spec.batched else tuple(spec.shape)
        if got.shape != expected:
            why = f"the shard has {rows} rows, so expected" if spec.batched else f"{program.ref} declares"
            raise ShardFailed(f"{where} returned output '{spec.name}' of shape {got.shape}; {why} {expected}")
