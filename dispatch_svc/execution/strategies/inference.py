"""Data-parallel inference (requirements A6, A7): every shard runs once on its planned device (retried
elsewhere if that fails), and its outputs are taken as it finishes: concatenated outputs written
in place, the others folded in shard order, so RunJob streams rows while later shards still run.

A job taken over from another dispatch replica (`finished`: the shards that one finished) runs
only the rest: the finished shards' outputs are on disk already.
"""

from __future__ import annotations

from accelmesh.programs import Program
from dispatch_svc.dataplane.device_queues import DevicePool
from dispatch_svc.execution.outputs import JobOutputs
from dispatch_svc.execution.strategies.context import InflightBudget, JobContext
from dispatch_svc.execution.strategies.verifier import ShardVerifier
from dispatch_svc.jobs import records as m
from dispatch_svc.ports import ShardOutput, ShardWork


def collect(ctx: JobContext, program: Program, pool: DevicePool, finished: frozenset[int] = frozenset(),
            devices: dict[int, str] | None = None, verifier: ShardVerifier | None = None):
    """Submit every shard as the feed completes it (in this thread, so input errors reach the
    caller); returns the work that waits for the last one. `devices`: where each shard runs, if
    not on its planned device (one a job taken over no longer has). `verifier`: the job's spot
    checks; a sampled shard's outputs come back in memory, to be compared before they are written."""
    job = ctx.job
    devices = devices or {}
    shards = [ShardWork(s.index, s.first_row, s.rows, devices.get(s.index, s.device_id)) for s in job.plan.shards]
    ctx.ensure_records(len(shards))
    for index in finished:
        job.shards[index].done = True
    outputs = JobOutputs(ctx.book, job, ctx.live, program, shards, finished)
    sampled = verifier.sampled if verifier is not None else frozenset()
    for shard in shards:
        if shard.index not in sampled:
            shard.place_outputs = outputs.placer(shard)  # no copy of a shard's outputs is held whole
    budget = InflightBudget(ctx.limits.inflight_bytes, ctx.live)

    def take(shard: ShardWork, out: ShardOutput) -> None:
        job.shards[shard.index].done = True
        outputs.take(shard, out.outputs)
        budget.give(shard.nbytes)
        shard.inputs = []
        ctx.book.emit(job, m.SHARD_FINISHED, shard=job.shards[shard.index],
                      message=f"shard {shard.index} done on {job.shards[shard.index].device_id}")

    # Results are taken on the device threads as shards finish, which frees the in-flight
    # budget while this thread is still reading input blocks.
    def skipped(shard: ShardWork) -> bool:
        if shard.index not in finished:
            return False
        budget.give(shard.nbytes)
        shard.inputs = []
        return True

    try:
        pending = [pool.submit(shard, shard.device_id, on_done=lambda out, shard=shard: take(shard, out),
                               on_error=budget.fail)
                   for shard in ctx.shards_from_feed(shards, outputs.total, budget) if not skipped(shard)]
    except BaseException:
        _let_go(shards)
        raise

    def work():
        try:
            pool.wait_all(pending)
            if verifier is not None:
                verifier.check_finished()
        except BaseException:
            _let_go(shards)
            raise
        outputs.close()
    return work


def _let_go(shards: list[ShardWork]) -> None:
    """A job that fails drops its shards' inputs at once, rather than when its last queued or
    running attempt lets go of the shard (a finished shard drops them in `take`)."""
    for shard in shards:
        shard.inputs = []
