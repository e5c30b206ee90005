"""Data-parallel training (requirements A7): each mini-batch split across the devices as the plan
splits a full batch, shard gradients averaged by rows, the optimizer applied here, the new
parameters sent with every step; the trained parameters and the losses are the job's results.
"""

from __future__ import annotations

import numpy as np

from accelmesh import errors
from accelmesh.programs import Program
from dispatch_svc.dataplane.device_queues import DevicePool
from dispatch_svc.execution.strategies.context import JobContext
from dispatch_svc.execution.strategies.verifier import ShardVerifier
from dispatch_svc.jobs import records as m
from dispatch_svc.jobs.training_options import minibatches, steps_per_epoch
from dispatch_svc.planner import BUCKET_RUNGS, PlannedDevice, plan_shards
from dispatch_svc.ports import ShardWork


def collect(ctx: JobContext, program: Program, pool: DevicePool, params: list[np.ndarray],
            verifier: ShardVerifier | None = None):
    """Take the whole training set (it is reused every epoch); returns the work that runs the steps.
    `verifier`: the job's spot checks; a step's gradients are applied only once no node they came
    from unverified has been found wrong."""
    job = ctx.job
    data = read_all(ctx)
    options = job.spec.training
    optimizer = options.optimizer()
    grad_outputs = [i for i, o in enumerate(program.outputs) if o.name.startswith("grad/")]
    loss_output = next(i for i, o in enumerate(program.outputs) if o.name == "loss")
    rows = job.spec.inputs[0].rows
    # Drawn a step at a time: a list of every step's row indices would hold epochs x rows of them.
    steps = minibatches(rows, options.batch_size, options.epochs, options.shuffle_seed)
    total_steps = options.epochs * steps_per_epoch(rows, options.batch_size)
    names = [p.name for p in program.parameters]
    splits: dict[int, list[tuple[int, int, str]]] = {}

    def step(batch, params: list[np.ndarray]) -> tuple[list[np.ndarray], float]:
        size = len(batch.indices)
        split = splits.setdefault(size, plan_rows(job.plan, size))
        handles = []
        for index, (first, count, device_id) in enumerate(split):
            idx = batch.indices[first: first + count]
            shard = ShardWork(index, first, count, device_id, [d[idx] for d in data], params=list(zip(names, params)))
            handles.append((shard, pool.submit(shard, device_id)))
        outs = [(s, pool.wait(h)) for s, h in handles]
        if verifier is not None:
            verifier.check_finished()
        for s, _ in outs:
            job.shards[s.index].done = True
        weights = [s.rows for s, _ in outs]
        grads = [weighted_mean([o.outputs[i] for _, o in outs], weights) for i in grad_outputs]
        loss = float(weighted_mean([o.outputs[loss_output] for _, o in outs], weights))
        return optimizer.step(params, grads), loss

    def work():
        nonlocal params
        for batch in steps:
            ctx.live.scope.check()
            params, loss = step(batch, params)
            job.losses.append(loss)
            job.progress = batch.step / total_steps
            ctx.book.emit(job, m.TRAINING_STEP, step=batch.step, loss=loss, message=f"epoch {batch.epoch}")
        for spec, value in zip(program.parameters, params):
            ctx.book.results.save(job.job_id, spec.name, np.asarray(value, np.dtype(spec.dtype)))
        ctx.book.results.save(job.job_id, "losses", np.asarray(job.losses, np.float32))
    return work


def read_all(ctx: JobContext) -> list[np.ndarray]:
    rows = ctx.spec.inputs[0].rows
    data = [np.empty(i.shape, np.dtype(i.dtype)) for i in ctx.spec.inputs]
    seen = 0
    for first_row, arrays in ctx.feed.blocks():
        for full, part in zip(data, arrays):
            full[first_row: first_row + part.shape[0]] = part
        seen = first_row + arrays[0].shape[0]
    if seen != rows:
        raise errors.InvalidArgument(f"the input blocks ended after {seen} of the {rows} rows the spec declares")
    return data


def weighted_mean(values: list[np.ndarray], weights: list[int]) -> np.ndarray:
    total = np.zeros_like(np.asarray(values[0], np.float32))
    for value, weight in zip(values, weights):
        total += np.asarray(value, np.float32) * weight
    return total / sum(weights)


def plan_rows(plan: m.Plan, rows: int) -> list[tuple[int, int, str]]:
    """(first row, rows, device) of each shard of a mini-batch of `rows`: the plan's own split for a
    full batch; for the last, partial one, a split over the same devices at the plan's rates in
    sizes from the bucket ladder of `rows` (planner/buckets.py), so every epoch, and every job of
    this input and batch size, runs it in the same few executables whatever the rates."""
    full = sum(s.rows for s in plan.shards)
    if rows == full:
        return [(s.first_row, s.rows, s.device_id) for s in plan.shards]
    rate = {t.target_type: t.rows_per_second for t in plan.targets}
    devices = [PlannedDevice(device, target, rate[target])
               for device, target in dict.fromkeys((s.device_id, s.target_type) for s in plan.shards)]
    split = plan_shards(rows, devices, exact=True, bucket_rungs=BUCKET_RUNGS)
    return [(s.first_row, s.rows, s.device_id) for s in split.shards]
