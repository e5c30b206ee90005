"""Checks of a job against the dispatcher's limits (before anything is planned) and against its
program, with messages that name the field and the fix, and of what a worker returns for a shard
against the program, before anything combines it."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from accelmesh import errors
from accelmesh.errors import quoted
from accelmesh.programs import Program
from dispatch_svc.jobs import records as m
from dispatch_svc.jobs.limits import JobLimits
from dispatch_svc.planner.placement import DEFAULT_MICRO_BATCH_ROWS

INFERENCE_KINDS = ("function", "model", "uploaded")
MAX_INPUT_RANK = 32  # numpy's own limit on dimensions: a deeper declared shape could never arrive


def _over(limits: JobLimits, name: str, what: str, value: int, limit: int) -> errors.ResourceExhausted:
    return errors.ResourceExhausted(
        f"{what} is {value:,}; this dispatcher takes at most {limit:,} (raise {limits.variable(name)} to allow more)")


def check_name(value: str, where: str, limits: JobLimits) -> None:
    """A name or id from a request is at most `max_name_chars`: every one is kept in the job's
    record and quoted in messages."""
    if len(value) > limits.max_name_chars:
        raise errors.InvalidArgument(
            f"{where} {quoted(value)} is longer than the {limits.max_name_chars} characters a name may have "
            "(raise ACCELMESH_MAX_NAME_CHARS to allow longer)", field=where)


def check_job_id(job_id: str, limits: JobLimits) -> None:
    if len(job_id) > limits.max_name_chars:
        raise errors.InvalidArgument(
            f"job_id {quoted(job_id)} is not a job id: ids are 16 characters, and at most "
            f"{limits.max_name_chars} are read (ACCELMESH_MAX_NAME_CHARS); use the id SubmitJob returned",
            field="job_id")


def _check_entries(items: Sequence, where: str, limits: JobLimits) -> None:
    if len(items) > limits.max_spec_entries:
        raise errors.InvalidArgument(
            f"{where} lists {len(items):,} entries; a spec may list at most {limits.max_spec_entries} "
            f"(raise ACCELMESH_MAX_SPEC_ENTRIES to allow more)", field=where)


def input_bytes(spec: m.JobSpec) -> int:
    """Bytes of every input the spec declares, in exact integers (no int64 to overflow)."""
    return sum(math.prod(i.shape) * np.dtype(i.dtype).itemsize for i in spec.inputs)


def shards_needed(spec: m.JobSpec, max_shard_bytes: int) -> int:
    """The fewest shards (a pipeline: micro-batches) the job's size needs: what planning would
    make at least, known without planning. Data-parallel training runs a shard per device a step."""
    rows = spec.inputs[0].rows if spec.inputs else 0
    if spec.placement is not None:
        micro = spec.placement.micro_batch_rows or max(1, min(rows, DEFAULT_MICRO_BATCH_ROWS))
        return -(-rows // micro) if micro > 0 else 0
    if spec.kind == m.TRAINING or not rows:
        return 0
    return -(-rows // max(1, max_shard_bytes // max(1, spec.row_bytes)))


def check_limits(spec: m.JobSpec, limits: JobLimits, max_shard_bytes: int, *, running: bool) -> None:
    """Everything a spec declares against `limits`, before any planning, compiling or reserving:
    lengths and counts (INVALID_ARGUMENT), then sizes (RESOURCE_EXHAUSTED). `running`: SubmitJob or
    RunJob, whose spec is also kept in the job's record; PlanJob's is not."""
    for where, value in (("spec.program", spec.program), ("spec.version", spec.version), ("spec.name", spec.name)):
        check_name(value, where, limits)
    c = spec.constraints
    _check_entries(spec.inputs, "spec.inputs", limits)
    _check_entries(c.platforms, "spec.constraints.platforms", limits)
    _check_entries(c.capabilities, "spec.constraints.capabilities", limits)
    for i, capability in enumerate(c.capabilities):
        check_name(capability, f"spec.constraints.required_capabilities[{i}]", limits)
    if len(c.filter) > limits.max_filter_chars:
        raise errors.InvalidArgument(
            f"spec.constraints.filter is {len(c.filter):,} characters; at most {limits.max_filter_chars:,} are "
            "read (raise ACCELMESH_MAX_FILTER_CHARS to allow more)", field="spec.constraints.filter")
    for i, decl in enumerate(spec.inputs):
        check_name(decl.name, f"spec.inputs[{i}].name", limits)
        if len(decl.shape) > MAX_INPUT_RANK:
            raise errors.InvalidArgument(f"spec.inputs[{i}].shape has {len(decl.shape)} dimensions; at most "
                                         f"{MAX_INPUT_RANK} are possible", field=f"spec.inputs[{i}].shape")
    placement = spec.placement
    if placement is not None and placement.layers:
        if running:
            raise errors.InvalidArgument(
                "spec.placement.layers is a table of your own for PlanJob; to run a model, leave it empty and "
                "name a registered model program", field="spec.placement.layers")
        if len(placement.layers) > limits.max_layers:
            raise _over(limits, "max_layers", "spec.placement.layers' row count", len(placement.layers),
                        limits.max_layers)
        for i, layer in enumerate(placement.layers):
            check_name(layer.name, f"spec.placement.layers[{i}].name", limits)
            check_name(layer.shared_from, f"spec.placement.layers[{i}].shared_from", limits)
    rows = max((d.rows for d in spec.inputs), default=0)
    if rows > limits.max_rows:
        raise _over(limits, "max_rows", "the rows spec.inputs declares", rows, limits.max_rows)
    size = input_bytes(spec)
    if size > limits.max_bytes:
        raise _over(limits, "max_bytes", "the bytes spec.inputs declares", size, limits.max_bytes)
    shards = shards_needed(spec, max_shard_bytes)
    if shards > limits.max_shards:
        what = "the micro-batches the job needs" if placement is not None else (
            f"the shards the job needs (at most {max_shard_bytes:,} input bytes each, ACCELMESH_MAX_SHARD_BYTES)")
        raise _over(limits, "max_shards", what, shards, limits.max_shards)
    if spec.kind == m.TRAINING and spec.training is not None:
        if size > limits.max_training_bytes:
            raise _over(limits, "max_training_bytes", "a training job's input bytes (held whole in the dispatcher)",
                        size, limits.max_training_bytes)
        steps = spec.training.epochs * -(-rows // spec.training.batch_size)
        if steps > limits.max_training_steps:
            raise _over(limits, "max_training_steps", "training.epochs x the mini-batches per epoch", steps,
                        limits.max_training_steps)


def check_parameter_header(name: str, count: int, total_bytes: int, declared_bytes: int, limits: JobLimits,
                           max_parameter_bytes: int) -> None:
    """A client parameter as its header arrives: its name, how many came, and the bytes so far
    (of the parameters, and of the whole job with its declared inputs)."""
    check_name(name, f"parameter[{count - 1}].name", limits)
    if count > limits.max_parameter_tensors:
        raise _over(limits, "max_parameter_tensors", "the parameter tensors sent", count, limits.max_parameter_tensors)
    if total_bytes > max_parameter_bytes:
        raise errors.ResourceExhausted(
            f"parameters exceed {max_parameter_bytes:,} bytes; raise ACCELMESH_MAX_CLIENT_PARAMETER_BYTES")
    if declared_bytes + total_bytes > limits.max_bytes:
        raise _over(limits, "max_bytes", "the job's input and parameter bytes", declared_bytes + total_bytes,
                    limits.max_bytes)


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
            f"parameters: got {quoted([name for name, _ in given])}, {program.ref} takes "
            f"{quoted([p.name for p in wanted])} in that order"
        )
    for (name, value), spec in zip(given, wanted):
        if str(value.dtype) != spec.dtype or tuple(value.shape) != tuple(spec.shape):
            raise errors.InvalidArgument(
                f"parameters '{name}': {value.dtype}{list(value.shape)}, "
                f"{program.ref} expects {spec.dtype}{list(spec.shape)}"
            )


