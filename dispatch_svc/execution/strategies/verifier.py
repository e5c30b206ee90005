"""A data-parallel inference job's spot checks (verification.py): a sampled shard's outputs are
compared with a second run on a device of another node before the shard counts as done.

Two runs that agree: the shard is MATCHED. Two that disagree: a third node referees, and a node
whose outputs the other two outvote is suspect (the inventory marks it, its devices stop being
candidates). With no third node neither can be told right, so both are suspect. A suspect node
gets none of the job's attempts from then on: its shards fail over to other nodes through the
device pool's retries, the sampled shard among them when it was the one found wrong. Outputs
taken unverified from a node found suspect later cannot be run again: the job fails rather than
return them (`check_finished`).
No device of another node: the shard is NOT_VERIFIABLE, said in the job's events, and stands.
A training step's shards are checked the same way (their outputs are the step's gradients and
loss, their parameters the step's): `check_finished` after each step, before the optimizer
applies them.
"""

from __future__ import annotations

import logging
import threading
import zlib
from collections.abc import Sequence

import numpy as np

from accelmesh import errors
from accelmesh.programs import Program
from dispatch_svc.dataplane.device_queues import Attempt, ShardFailed
from dispatch_svc.execution.output_checks import check_shard_outputs
from dispatch_svc.execution.strategies.context import JobContext
from dispatch_svc.execution.verification import Comparison, compare_outputs
from dispatch_svc.jobs import records as m
from dispatch_svc.ports import Build, JobDevice, ShardWork

log = logging.getLogger(__name__)


class ShardVerifier:
    """Thread-safe: attempts run on every device thread of the job's pool."""

    def __init__(self, ctx: JobContext, program: Program, builds: Sequence[Build], devices: Sequence[JobDevice],
                 sampled: frozenset[int], shard_count: int, params: list[tuple[str, np.ndarray]], held: str | None):
        """`sampled` among the plan's `shard_count` shards; a training step split otherwise (its
        last, partial mini-batch) has shard i sampled when shard i % shard_count of the plan is."""
        self._ctx, self._program, self._params, self._held = ctx, program, params, held
        self._builds = {b.target_type: b for b in builds}
        self._devices = sorted(devices, key=lambda d: d.id)
        self._node_of = {d.id: d.node_address for d in devices}
        self.sampled, self._count = sampled, max(1, shard_count)
        self._suspects: dict[str, str] = {}  # node address -> why
        # node address -> shards whose outputs it gave were taken without a second run agreeing
        self._unverified: dict[str, set[int]] = {}
        self._lock = threading.Lock()

    def refuse(self, attempt: Attempt) -> None:
        """A suspect node runs none of the job's shards: ShardFailed moves the attempt elsewhere."""
        node = attempt.device.node_address
        with self._lock:
            why = self._suspects.get(node)
        if why is not None:
            raise ShardFailed(f"node {node} is suspect: {why}")

    def check(self, attempt: Attempt, outputs: Sequence[np.ndarray]) -> None:
        """Verify a sampled shard's outputs; ShardFailed when they are found wrong. Outputs it
        returns on are taken: unless another node agreed, they count against their node should
        it be found wrong later (`check_finished`)."""
        shard, primary = attempt.shard, attempt.device
        if shard.index % self._count not in self.sampled:
            self._taken_unverified(primary.node_address, shard.index)
            return
        first = [np.asarray(o) for o in outputs]
        second = self._rerun(attempt, {primary.node_address})
        if second is None:
            self._taken_unverified(primary.node_address, shard.index)
            self._record(shard, m.ShardVerification(m.NOT_VERIFIABLE, primary.node_address),
                         f"shard {shard.index} on {primary.id} could not be verified: no device of another "
                         f"node than {primary.node_address} answered; its outputs stand unchecked")
            return
        verifier, again = second
        comparison = self._compare(primary, verifier, first, again)
        if comparison.matched:
            self._matched(shard, primary, verifier, comparison)
            return
        third = self._rerun(attempt, {primary.node_address, verifier.node_address})
        where = f"shard {shard.index}'s outputs on {primary.id} and on {verifier.id}"
        if third is None:
            why = (f"{where} differ ({comparison.output}: {comparison.error_ratio:.3g}x the tolerance) and no "
                   "third node could tell which is right")
            self._suspect(primary.node_address, why)
            self._suspect(verifier.node_address, why)
            raise ShardFailed(why)
        referee, judged = third
        with_first = self._compare(primary, referee, first, judged)
        with_second = self._compare(verifier, referee, again, judged)
        if with_first.matched:  # the referee sides with the shard's own outputs
            if not with_second.matched:
                self._suspect(verifier.node_address, f"{where} differ; {referee.id} agrees with {primary.id}")
            self._matched(shard, primary, referee, with_first)
            return
        sides = f"with {verifier.id}" if with_second.matched else "with neither"
        why = (f"{where} differ ({comparison.output}: {comparison.error_ratio:.3g}x the tolerance); "
               f"{referee.id} agrees {sides}")
        self._suspect(primary.node_address, why)
        if not with_second.matched:
            self._suspect(verifier.node_address, why)
        raise ShardFailed(why)

    def check_finished(self) -> None:
        """Before the outputs so far are final (an inference job's end, each training step): outputs
        taken unverified from a node found wrong since fail the job; they cannot be run again (their
        inputs are gone, or a training step's gradients are applied)."""
        with self._lock:
            tainted = {node: sorted(self._unverified[node]) for node in self._suspects if node in self._unverified}
            why = {node: self._suspects[node] for node in tainted}
        if tainted:
            nodes = sorted(tainted)
            shards = sorted({i for indices in tainted.values() for i in indices})
            raise errors.Unavailable(
                f"shards {', '.join(map(str, shards))} were taken unverified from {', '.join(nodes)}, found returning "
                f"wrong outputs since ({why[nodes[0]]}); run the job again: suspect nodes get no more shards")

    def _taken_unverified(self, node: str, index: int) -> None:
        with self._lock:
            self._unverified.setdefault(node, set()).add(index)

    def _compare(self, a: JobDevice, b: JobDevice, first, second) -> Comparison:
        tolerance = max(self._builds[a.target_type].tolerance, self._builds[b.target_type].tolerance)
        return compare_outputs([o.name for o in self._program.outputs], first, second, tolerance)

    def _rerun(self, attempt: Attempt, nodes: set[str]) -> tuple[JobDevice, list[np.ndarray]] | None:
        """The shard run on the first device (in an order drawn from the job and shard) of a node not
        in `nodes` and not suspect that answers with outputs of the program's shape."""
        shard: ShardWork = attempt.shard
        with self._lock:
            others = [d for d in self._devices if d.node_address not in nodes and d.node_address not in self._suspects]
        if not others:
            return None
        start = zlib.crc32(f"{self._ctx.job.job_id}/{shard.index}".encode()) % len(others)
        for device in others[start:] + others[:start]:
            build = self._builds[device.target_type]
            artifact = build.executables.get(shard.rows, build.portable)
            shard_params = self._params if shard.params is None else shard.params
            arrays = [*shard_params, *zip((i.name for i in self._program.inputs), shard.inputs)]
            held_keys = {name: f"{self._held}:{name}" for name, _ in shard_params} if self._held else None
            try:
                out = self._ctx.workers.execute(self._ctx.job.job_id, shard.index, attempt.number, device, build,
                                                artifact, arrays, shard.rows, self._ctx.live.scope,
                                                held_keys=held_keys)
                check_shard_outputs(self._program, out.outputs, shard.index, device.id, shard.rows)
            except ShardFailed as exc:
                self._ctx.live.scope.check()
                log.warning("verifying shard %s of %s on %s failed: %s", shard.index, self._ctx.job.job_id,
                            device.id, exc.cause)
                continue
            return device, [np.asarray(o) for o in out.outputs]
        return None

    def _matched(self, shard: ShardWork, primary: JobDevice, verifier: JobDevice, comparison: Comparison) -> None:
        self._record(shard, m.ShardVerification(m.MATCHED, primary.node_address, verifier.id,
                                                verifier.node_address, comparison.error_ratio, comparison.describe()),
                     f"shard {shard.index} on {primary.id} verified on {verifier.id}: outputs agree within "
                     f"{comparison.describe()}")

    def _record(self, shard: ShardWork, verification: m.ShardVerification, message: str) -> None:
        record = self._ctx.job.shards[shard.index]
        record.verification = verification
        self._ctx.metrics.verified(verification.outcome)
        self._ctx.book.emit(self._ctx.job, m.SHARD_VERIFIED, shard=record, message=message)

    def _suspect(self, node: str, why: str) -> None:
        with self._lock:
            if node in self._suspects:
                return
            self._suspects[node] = why
        job = self._ctx.job
        reason = f"job {job.job_id}: {why}"
        self._ctx.metrics.verified("mismatched")
        self._ctx.book.emit(job, m.SHARD_VERIFIED, message=f"node {node} is suspect: {why}")
        try:
            self._ctx.inventory.mark_suspect(node, reason)
        except errors.AccelmeshError as exc:  # this job avoids the node all the same
            log.warning("marking node %s suspect failed: %s", node, exc)
