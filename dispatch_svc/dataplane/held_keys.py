"""Which keyed tensors each worker holds for each job, as far as this dispatcher knows: keys only,
never the tensors (ShardHeader.keep_tensors, ExecuteRequest.held).

A keyed tensor (a job's parameters) goes to a worker in full once, with a request to keep it;
once that call's inputs have arrived (the worker reports its first stage) the job's later calls
to that worker send a reference instead. A call that needs a key another call is sending right
now waits for it rather than sending the same bytes again. A worker may still lose a tensor
(evicted, expired, restarted): the caller reports the miss, which forgets what that worker holds
for the job, and sends everything in full once more. After MAX_MISSES losses of one job on one
worker, that worker gets the job's tensors in full without being asked to keep them: its limit
is below what the job needs, or jobs keep evicting each other there.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

MAX_MISSES = 3
WAIT_POLL_S = 0.05  # how often a call waiting for another call's transfer checks for cancellation


@dataclass(eq=False)
class Transfer:
    """One call's plan for its keyed inputs."""

    worker: str
    job_id: str
    refs: frozenset[str]  # keys to send as references
    full: frozenset[str]  # keys to send in full
    keep: bool  # ask the worker to keep the `full` ones
    settled: bool = field(default=False, repr=False)


@dataclass
class HeldCounts:
    """What the dispatcher sent for keyed inputs since it started."""

    full: int = 0  # keyed tensors sent in full
    full_bytes: int = 0
    refs: int = 0  # references sent in place of a tensor
    resends: int = 0  # calls sent again in full because the worker did not hold a tensor


class HeldKeys:
    def __init__(self):
        self._changed = threading.Condition()
        self._held: dict[tuple[str, str], set[str]] = {}  # (worker, job) -> keys it holds
        self._sending: dict[tuple[str, str], dict[str, Transfer]] = {}  # (worker, job) -> key -> call sending it
        self._misses: dict[tuple[str, str], int] = {}
        self.counts = HeldCounts()

    def plan(self, worker: str, job_id: str, keys: Collection[str], cancelled: Callable[[], bool], *,
             resend: bool = False) -> Transfer | None:
        """Which of `keys` to refer to and which to send in full; waits while another call is sending
        one of them, and returns None if `cancelled` says so meanwhile. `resend`: all in full, now."""
        pair, keys = (worker, job_id), frozenset(keys)
        with self._changed:
            if resend:
                self.counts.resends += 1
            if self._misses.get(pair, 0) >= MAX_MISSES:
                return Transfer(worker, job_id, frozenset(), keys, keep=False)
            while not resend and self._sending.get(pair, {}).keys() & keys:
                if cancelled():
                    return None
                self._changed.wait(WAIT_POLL_S)
            refs = frozenset() if resend else keys & self._held.get(pair, set())
            transfer = Transfer(worker, job_id, refs, keys - refs, keep=True)
            sending = self._sending.setdefault(pair, {})
            for key in transfer.full:
                sending.setdefault(key, transfer)
            return transfer

    def count(self, transfer: Transfer, full_bytes: int) -> None:
        with self._changed:
            self.counts.full += len(transfer.full)
            self.counts.full_bytes += full_bytes
            self.counts.refs += len(transfer.refs)

    def arrived(self, transfer: Transfer) -> None:
        """The worker has the call's inputs: it holds the kept ones from now on."""
        with self._changed:
            if transfer.settled:
                return
            if transfer.keep and transfer.full:
                self._held.setdefault((transfer.worker, transfer.job_id), set()).update(transfer.full)
            self._settle(transfer)

    def abandoned(self, transfer: Transfer) -> None:
        """The call ended before its inputs were known to have arrived: others may send them."""
        with self._changed:
            if not transfer.settled:
                self._settle(transfer)

    def missed(self, worker: str, job_id: str) -> None:
        """The worker did not hold a tensor it was thought to: forget what it holds for the job."""
        with self._changed:
            self._held.pop((worker, job_id), None)
            self._misses[(worker, job_id)] = self._misses.get((worker, job_id), 0) + 1

    def forget_worker(self, worker: str) -> None:
        """The worker went away; a process back on its address holds nothing."""
        with self._changed:
            self._drop(lambda pair: pair[0] == worker)

    def workers_of(self, job_id: str) -> set[str]:
        """The workers asked to keep tensors of the job (held, or being sent)."""
        with self._changed:
            return {worker for worker, job in (*self._held, *self._sending) if job == job_id}

    def forget_job(self, job_id: str) -> None:
        """The job ended: nothing will refer to its tensors again."""
        with self._changed:
            self._drop(lambda pair: pair[1] == job_id)

    def _drop(self, match: Callable[[tuple[str, str]], bool]) -> None:
        for table in (self._held, self._misses):
            for pair in [p for p in table if match(p)]:
                del table[pair]

    def _settle(self, transfer: Transfer) -> None:
        transfer.settled = True
        pair = (transfer.worker, transfer.job_id)
        sending = self._sending.get(pair, {})
        for key in transfer.full:
            if sending.get(key) is transfer:
                del sending[key]
        if not sending:
            self._sending.pop(pair, None)
        self._changed.notify_all()
