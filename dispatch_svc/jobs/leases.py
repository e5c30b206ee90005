"""Which dispatch replica runs each job (execution/takeover.py): with several replicas on one
book, each unfinished job is leased to the one running it, renewed while it runs; a lapsed lease
is claimed in one statement, so two replicas never both take a job over. A cancel asked through
a replica that does not run the job waits in the job's row for the one that does."""

from __future__ import annotations

from collections.abc import Callable, Collection

import sqlalchemy as sa

from accelmesh.runtime import database
from dispatch_svc.jobs import records as m
from dispatch_svc.jobs.rows import job_not_found
from dispatch_svc.jobs.schema.tables import jobs as jobs_table

_J = jobs_table.c
# The unfinished jobs no replica leases (from before leases, or an unleased dispatcher), taken by
# this one to be ended, with a lease so that a replica starting with it leaves them be.
_CLAIM_UNLEASED = jobs_table.update().where(_J.state.not_in((*m.FINAL_STATES, m.QUEUED)),
                                             _J.runner_until.is_(None)).values(
    runner=sa.bindparam("me"), runner_until=sa.bindparam("until")).returning(_J.job_id)
# Renewed in one statement for every job a replica runs: those it holds live, not every row naming
# it (a job it let go of unrecorded, while the database was away, must lapse to be taken over).
_RENEW = jobs_table.update().where(_J.runner == sa.bindparam("me"), _J.runner_until.is_not(None),
                                   _J.job_id.in_(sa.bindparam("jobs", expanding=True))).values(
    runner_until=sa.bindparam("until")).returning(_J.job_id, _J.cancel_requested)
_CLAIM = jobs_table.update().where(_J.runner_until.is_not(None), _J.runner_until < sa.bindparam("now")).values(
    runner=sa.bindparam("me"), runner_until=sa.bindparam("until")).returning(_J.job_id, _J.inputs_stored)
_INPUTS_STORED = jobs_table.update().where(_J.job_id == sa.bindparam("job")).values(inputs_stored=True)
_REQUEST_CANCEL = jobs_table.update().where(_J.job_id == sa.bindparam("job"), _J.runner_until.is_not(None)).values(
    cancel_requested=sa.bindparam("reason"))
_RUNNER = sa.select(_J.runner, _J.runner_until).where(_J.job_id == sa.bindparam("job_id"))


class JobLeases:
    """`lease_s` 0: the book's only dispatcher, nothing leased; above 0, jobs are leased to
    `replica` for `lease_s` at a time."""

    def __init__(self, engine: sa.Engine, *, lease_s: float, replica: str, clock: Callable[[], float]):
        self._engine, self.lease_s, self.replica, self._clock = engine, lease_s, replica, clock

    def renew(self, job_ids: Collection[str]) -> list[tuple[str, str | None]]:
        """Move this replica's leases of `job_ids` (the jobs it runs) on; (job id, cancel asked
        through another replica or None) for every unfinished one of them it still holds."""
        if not job_ids:
            return []
        values = {"me": self.replica, "until": self._clock() + self.lease_s, "jobs": sorted(job_ids)}
        return [tuple(row) for row in database.transaction(self._engine, lambda c: c.execute(_RENEW, values).all())]

    def claim_lapsed(self) -> list[tuple[str, bool]]:
        """Take the jobs whose runner stopped renewing: (job id, whether its inputs are stored)."""
        now = self._clock()
        values = {"me": self.replica, "now": now, "until": now + self.lease_s}
        rows = database.transaction(self._engine, lambda c: c.execute(_CLAIM, values).all())
        return [(job_id, bool(stored)) for job_id, stored in rows]

    def claim_unleased(self) -> list[str]:
        values = {"me": self.replica, "until": self._clock() + self.lease_s}
        return database.transaction(self._engine, lambda c: c.execute(_CLAIM_UNLEASED, values).scalars().all())

    def runner_of(self, job_id: str) -> tuple[str, float | None]:
        with database.connected(self._engine) as connection:
            row = connection.execute(_RUNNER, {"job_id": job_id}).first()
        if row is None:
            raise job_not_found(job_id)
        return row[0], row[1]

    def holds(self, job_id: str) -> bool:
        """Whether this replica still holds the job's lease (always, unleased)."""
        return not self.lease_s or self.runner_of(job_id)[0] == self.replica

    def inputs_stored(self, job_id: str) -> None:
        """Every input of the job is in the book's `inputs`: another replica can run it from there."""
        database.transaction(self._engine, lambda c: c.execute(_INPUTS_STORED, {"job": job_id}))

    def request_cancel(self, job_id: str, reason: str) -> bool:
        """Ask the replica running the job to cancel it (at its next renewal); False: not leased."""
        count = database.transaction(
            self._engine, lambda c: c.execute(_REQUEST_CANCEL, {"job": job_id, "reason": reason}).rowcount)
        return bool(count)
