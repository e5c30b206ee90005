"""A placed model trained as a pipeline (requirements B7 for training): GPipe's schedule per step.

Every optimizer step takes one mini-batch (dispatch_svc/jobs/training_options.py's order), cut into
micro-batches of the plan's rows. Each micro-batch flows forward stage to stage as soon as the
previous stage returns it (micro-batches overlap across the stages' devices, a replicated stage
taking them in turn), the dispatcher keeping what entered each stage. Once every micro-batch's
output is back, the loss is taken here: mean softmax cross-entropy of the model's output (the
logits) against the job's integer `labels` input, and its gradient with respect to every
micro-batch's logits. The cotangents then flow backward: each stage's backward pass
(compile_svc/programs/stages.py) recomputes its forward from the stashed input, returns the
gradient of its parameters summed over the micro-batch's rows, and the cotangent of its input
for the stage before it. The gradients of a stage are accumulated over its micro-batches (and
over the stages that read a tied parameter), and the optimizer (SGD with momentum, the same
one data-parallel training uses) is applied here, in the dispatcher, which holds every stage's
parameters; each step's new parameters reach a stage's devices once, under keys of that step.

That is GPipe with rematerialisation, not 1F1B: the micro-batches' stage inputs are kept in the
dispatcher, not on the devices, so a device holds its stage's weights and one micro-batch's
working set at a time (less than the planner charges it, layer_model.py). The trained
parameters and the step losses are the job's results, as for data-parallel training.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from accelmesh import errors
from accelmesh.programs import Program
from dispatch_svc.dataplane.device_queues import DevicePool
from dispatch_svc.execution.strategies.context import JobContext
from dispatch_svc.execution.strategies.training import read_all
from dispatch_svc.jobs import records as m
from dispatch_svc.jobs.training_options import steps_per_epoch
from dispatch_svc.jobs.validation import check_inputs
from dispatch_svc.ports import ShardOutput

LABELS = "labels"  # a placed training job's second input: one class index per row
ALL_DONE_POLL_S = 0.5  # how often a waiting step checks for a cancel


def check_training_inputs(program: Program, spec: m.JobSpec) -> int:
    """A placed training job sends the model's input and `labels` (int32, one per row); the row count."""
    wanted = program.inputs[0]
    if len(program.inputs) != 1 or len(program.outputs) != 1 or len(program.outputs[0].shape) != 2:
        raise errors.FailedPrecondition(
            f"{program.ref} takes {len(program.inputs)} inputs and returns {len(program.outputs)} outputs; a placed "
            "training job needs a model of one input and one output of logits [rows, classes]")
    names = [i.name for i in spec.inputs]
    if names != [wanted.name, LABELS]:
        raise errors.InvalidArgument(
            f"spec.inputs are {names}; a placed training job of {program.ref} sends ['{wanted.name}', '{LABELS}']: "
            f"the model's input, then one int32 class index per row")
    rows = check_inputs(program, dataclasses.replace(spec, inputs=spec.inputs[:1]))  # the model's input, as any job's
    given, labels = spec.inputs
    if labels.dtype != "int32" or len(labels.shape) != 1:
        raise errors.InvalidArgument(f"spec.inputs[1] '{LABELS}': dtype {labels.dtype} shape {list(labels.shape)}; "
                                     "send int32 [rows], one class index per row")
    if labels.rows != rows:
        raise errors.InvalidArgument(f"spec.inputs: '{LABELS}' has {labels.rows} rows and '{given.name}' "
                                     f"{rows}; send one label per row")
    return rows


def cross_entropy(logits: np.ndarray, labels: np.ndarray, rows: int) -> tuple[float, np.ndarray]:
    """Mean softmax cross-entropy over `rows` (the mini-batch) of these logits, and its gradient
    with respect to them (float64 arithmetic, float32 out)."""
    z = np.asarray(logits, np.float64)
    z = z - z.max(axis=1, keepdims=True)
    log_p = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
    picked = log_p[np.arange(len(labels)), labels]
    grad = np.exp(log_p)
    grad[np.arange(len(labels)), labels] -= 1.0
    return float(-picked.sum() / rows), (grad / rows).astype(np.float32)


@dataclass
class TrainedStage:
    """A trained stage: its devices, its forward and backward programs."""

    index: int
    device_ids: tuple[str, ...]
    forward: Program
    backward: Program


def train(ctx: JobContext, program: Program, stages: list[TrainedStage], pool: DevicePool,
          params: list[tuple[str, np.ndarray]], micro_rows: int,
          submit_stage: Callable[..., None]):
    """The work of a placed training job: every step of every epoch, then the results saved.
    `submit_stage(stage, k, backward, inputs, params, held, on_done, on_error)` queues one
    micro-batch's pass of one stage on its device."""
    job = ctx.job
    options = job.spec.training
    data = read_all(ctx)
    x_all, labels_all = data[0], data[1].astype(np.int64)
    classes = program.outputs[0].shape[-1]
    bad = np.flatnonzero((labels_all < 0) | (labels_all >= classes))
    if bad.size:
        raise errors.InvalidArgument(f"'{LABELS}'[{int(bad[0])}] is {int(labels_all[bad[0]])}; {program.ref} has "
                                     f"{classes} classes, so labels must be within 0..{classes - 1}")
    rows = x_all.shape[0]
    names = [name for name, _ in params]
    values = dict(params)
    optimizer = options.optimizer()
    total_steps = options.epochs * steps_per_epoch(rows, options.batch_size)
    count = len(stages)

    def step(indices: np.ndarray, number: int) -> float:
        size = len(indices)
        firsts = list(range(0, size, micro_rows))
        stash: list[list[np.ndarray | None]] = [[None] * count for _ in firsts]
        logits: list[np.ndarray | None] = [None] * len(firsts)
        grads = {name: np.zeros_like(np.asarray(values[name], np.float32)) for name in names}
        held = f"step{number}"  # a key's content never changes within a job: new parameters, new keys
        stage_params = [[(p.name, values[p.name]) for p in st.forward.parameters] for st in stages]
        lock = threading.Lock()
        phase = _Phase(len(firsts), ctx)

        def forward(k: int, s: int, x: np.ndarray) -> None:
            stash[k][s] = x
            submit_stage(stages[s], k, False, [x], stage_params[s], held,
                         lambda out: forwarded(k, s, out), phase.fail)

        def forwarded(k: int, s: int, out: ShardOutput) -> None:
            if s + 1 < count:
                forward(k, s + 1, out.outputs[0])
            else:
                logits[k] = out.outputs[0]
                phase.one_done()

        def backward(k: int, s: int, dy: np.ndarray) -> None:
            submit_stage(stages[s], k, True, [stash[k][s], dy], stage_params[s], held,
                         lambda out: backwarded(k, s, out), phase.fail)

        def backwarded(k: int, s: int, out: ShardOutput) -> None:
            leaves = stages[s].forward.parameters
            with lock:
                for spec, value in zip(leaves, out.outputs):
                    grads[spec.name] += np.asarray(value, np.float32)
            if s > 0:
                backward(k, s - 1, out.outputs[len(leaves)])
            else:
                stash[k] = [None] * count
                phase.one_done()

        for k, first in enumerate(firsts):
            forward(k, 0, x_all[indices[first:first + micro_rows]])
        phase.wait()
        labels = labels_all[indices]
        loss, dlogits = cross_entropy(np.concatenate(logits), labels, size)
        phase = _Phase(len(firsts), ctx)
        for k, first in enumerate(firsts):
            backward(k, count - 1, dlogits[first:first + micro_rows])
        phase.wait()
        new = optimizer.step([values[n] for n in names], [grads[n] for n in names])
        values.update(zip(names, new))
        return loss

    def work():
        took = 0.0
        for batch in options.batches(rows):
            ctx.live.scope.check()
            started = time.perf_counter()
            loss = step(batch.indices, batch.step)
            took += time.perf_counter() - started
            job.measured_seconds = took / batch.step  # the mean step, beside plan.predicted_seconds
            job.losses.append(loss)
            job.progress = batch.step / total_steps
            ctx.book.emit(job, m.TRAINING_STEP, step=batch.step, loss=loss,
                          message=f"epoch {batch.epoch}, {count} stages")
        for spec in program.parameters:
            ctx.book.results.save(job.job_id, spec.name, np.asarray(values[spec.name], np.dtype(spec.dtype)))
        ctx.book.results.save(job.job_id, "losses", np.asarray(job.losses, np.float32))
    return work


class _Phase:
    """Waits for `pending` micro-batches to finish a pass, or for the first failure."""

    def __init__(self, pending: int, ctx: JobContext):
        self._pending, self._ctx = pending, ctx
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._failure: BaseException | None = None

    def one_done(self) -> None:
        with self._lock:
            self._pending -= 1
            if self._pending == 0:
                self._done.set()

    def fail(self, error: BaseException) -> None:
        with self._lock:
            self._failure = self._failure or error
        self._done.set()

    def wait(self) -> None:
        while not self._done.wait(ALL_DONE_POLL_S):
            self._ctx.live.scope.check()
        if self._failure is not None:
            raise self._failure
