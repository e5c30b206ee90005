"""Dispatch replicas on one job book (requirements D2): each unfinished job is leased to the
replica running it, and one whose replica stopped is taken over by another.

Every replica runs a `Takeover` thread that, every quarter lease:
- renews the leases of all the jobs it runs (holds live) in one statement, and cancels those of
  them that a CancelJob through another replica asked to cancel; a job it no longer holds without
  having recorded its end (the database was away: runner.py) is left to lapse;
- claims, in one statement (so two replicas never both get a job), the unfinished jobs whose
  lease ran out, and takes each over on a thread of its own (`JobRunner.take_over`): an inference
  job keeps its finished shards and runs the rest from its stored inputs; another kind runs again
  from its stored inputs; one whose inputs never all arrived ends FAILED, saying so.

A stopped replica's jobs are thus taken over within 1.25 leases (ACCELMESH_DISPATCH_LEASE_S) of
its last renewal. A
replica that could not renew in time (paused, cut off from the database) loses its jobs: the
book's writes are fenced on the runner, so it can no longer change a job another replica runs.
"""

from __future__ import annotations

import logging
import threading

from accelmesh.runtime.periodic import Periodic
from dispatch_svc.execution.runner import JobRunner

log = logging.getLogger(__name__)

CHECKS_PER_LEASE = 4


class Takeover:
    def __init__(self, runner: JobRunner):
        if not runner.book.lease_s:
            raise ValueError("the job book leases no jobs (lease_s is 0): nothing to take over")
        self._runner = runner
        self._book = runner.book
        self._loop = Periodic("job-leases", self.check, self._book.lease_s / CHECKS_PER_LEASE,
                              "renewing job leases and looking for lapsed ones")

    def start(self) -> Takeover:
        self._loop.start()
        return self

    def stop(self) -> None:
        self._loop.stop(timeout_s=5)

    def check(self) -> list[str]:
        """One round: renew, act on cancels, claim lapsed jobs. Returns the jobs claimed."""
        for job_id, reason in self._book.leases.renew(self._runner.live_jobs.ids()):
            if reason:
                live = self._runner.live(job_id)
                if live is not None:
                    live.scope.cancel(reason)
        claimed = self._book.leases.claim_lapsed()
        for job_id, stored in claimed:
            log.warning("taking over job %s: the dispatch replica running it stopped renewing its lease", job_id)
            threading.Thread(target=self._runner.take_over, args=(job_id, stored), name=f"takeover-{job_id}",
                             daemon=True).start()
        return [job_id for job_id, _ in claimed]
