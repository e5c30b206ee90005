"""Data-parallel inference on DATA_PATH_DIRECT (requirements A6, A7; docs/data-plane.md): every shard
runs once on its planned device on inputs the client put into that device's worker store, its
outputs kept there; the dispatcher only asks for the inputs, runs the shards by reference and
says at the end where each shard's outputs lie (execution/direct.py).

Every output must be concatenated by rows (its shards' rows are the job's rows in order): a
folded output (a sum, a mean) would have to come back to the dispatcher, which this path never
does. Spot checks compare outputs in the dispatcher too, so a job that samples shards runs on the
relay path. Both are refused before anything is reserved.
"""

from __future__ import annotations

from collections.abc import Sequence

from accelmesh import errors
from accelmesh.programs import Program
from dispatch_svc.dataplane.device_queues import DevicePool
from dispatch_svc.execution.strategies.context import JobContext
from dispatch_svc.jobs import records as m
from dispatch_svc.ports import JobDevice, ShardOutput, ShardWork


def check_direct(program: Program, verify_fraction: float) -> None:
    folded = [o.name for o in program.outputs if o.combine != "concat"]
    if folded:
        raise errors.FailedPrecondition(
            f"{program.ref} folds its output{'s' if len(folded) > 1 else ''} {', '.join(folded)} over the shards, "
            "which DATA_PATH_DIRECT cannot (the outputs never come to the dispatcher): run it with "
            "DATA_PATH_RELAY", field="spec.data_path")
    if verify_fraction > 0:
        raise errors.FailedPrecondition(
            f"the job's shards are spot-checked (verify fraction {verify_fraction:g}, the larger of "
            "spec.verify_fraction and the dispatcher's ACCELMESH_VERIFY_FRACTION), which compares outputs in the "
            "dispatcher: run it with DATA_PATH_RELAY", field="spec.data_path")


def collect(ctx: JobContext, program: Program, pool: DevicePool, devices: Sequence[JobDevice]):
    """Ask for every shard's inputs at its planned worker, submit each shard as its inputs are
    stored (an attempt waits for them, direct.py), and return the work that waits for the last."""
    job, direct = ctx.job, ctx.live.direct
    address = {d.id: d.node_address for d in devices}
    shards = [ShardWork(s.index, s.first_row, s.rows, s.device_id) for s in job.plan.shards]
    ctx.ensure_records(len(shards))
    total = sum(s.rows for s in shards)
    direct.ask([(s.index, s.first_row, s.rows, address[s.device_id]) for s in shards])

    def take(shard: ShardWork, out: ShardOutput) -> None:
        job.shards[shard.index].done = True
        with direct.lock:
            ctx.live.released_rows += shard.rows  # progress only: nothing is streamed from here
            job.progress = ctx.live.released_rows / max(1, total)
        ctx.book.emit(job, m.SHARD_FINISHED, shard=job.shards[shard.index],
                      message=f"shard {shard.index} done on {job.shards[shard.index].device_id}")

    pending = [pool.submit(shard, shard.device_id, on_done=lambda out, shard=shard: take(shard, out))
               for shard in shards]

    def work():
        pool.wait_all(pending)
    return work

