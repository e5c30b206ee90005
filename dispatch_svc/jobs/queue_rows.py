"""The queue's rows in the jobs table (admission/queue.py): a QUEUED job's priority, when it was
first queued, its deadline and why it waits. The order jobs are tried in: priority first (higher
first), then when each was first queued. A queued job holds no devices, and its held_bytes are
the bytes its stored inputs take, for its owner's bound on them (admission/quotas.py)."""

from __future__ import annotations

from collections.abc import Callable

import sqlalchemy as sa

from accelmesh.runtime import database
from dispatch_svc.jobs import records as m
from dispatch_svc.jobs.schema.tables import jobs as jobs_table
from dispatch_svc.jobs.validation import input_bytes

_J = jobs_table.c
_QUEUE_ORDER = (_J.priority.desc(), _J.queued_at, _J.job_id)
_QUEUED_JOBS = sa.select(_J.job_id, _J.owner, _J.priority, _J.queued_at, _J.queue_deadline).where(
    _J.state == m.QUEUED).order_by(*_QUEUE_ORDER)
_ENQUEUE = jobs_table.update().where(_J.job_id == sa.bindparam("job")).values(
    priority=sa.bindparam("priority"), queued_at=sa.bindparam("since"), queue_deadline=sa.bindparam("deadline"),
    queue_reason=sa.bindparam("reason"), held_devices=0, held_bytes=sa.bindparam("stored"), runner_until=None)
# Taken from the queue by one replica only: the state moves on in the same statement.
_CLAIM_QUEUED = jobs_table.update().where(_J.job_id == sa.bindparam("job"), _J.state == m.QUEUED).values(
    state=m.PLANNING, runner=sa.bindparam("me"), runner_until=sa.bindparam("until")).returning(_J.job_id)
_QUEUE_KEY = sa.select(_J.priority, _J.queued_at).where(_J.job_id == sa.bindparam("job"), _J.state == m.QUEUED)


def _ahead(priority: int, since: float, job_id: str):
    return sa.select(sa.func.count()).select_from(jobs_table).where(_J.state == m.QUEUED, sa.or_(
        _J.priority > priority, sa.and_(_J.priority == priority, sa.or_(
            _J.queued_at < since, sa.and_(_J.queued_at == since, _J.job_id < job_id)))))


class QueueRows:
    def __init__(self, engine: sa.Engine, *, lease_s: float, replica: str, clock: Callable[[], float]):
        self._engine, self._lease_s, self._replica, self._clock = engine, lease_s, replica, clock

    def place(self, job: m.JobRecord, status: m.QueueStatus) -> None:
        """The job's row says where it waits (its record, QUEUED, is saved by the caller first)."""
        database.transaction(self._engine, lambda c: c.execute(_ENQUEUE, {
            "job": job.job_id, "priority": job.spec.priority, "since": status.since, "deadline": status.deadline,
            "reason": status.reason, "stored": input_bytes(job.spec)}))

    def position(self, job_id: str) -> int:
        """1 for the queued job tried next; 0 for a job not queued."""
        with database.connected(self._engine) as connection:
            key = connection.execute(_QUEUE_KEY, {"job": job_id}).first()
            if key is None:
                return 0
            return 1 + connection.execute(_ahead(key[0], key[1], job_id)).scalar_one()

    def queued(self, limit: int) -> list[tuple[str, str, int, float, float]]:
        """The first `limit` queued jobs in the order they are tried: (job id, owner, priority,
        queued at, deadline)."""
        with database.connected(self._engine) as connection:
            return [tuple(row) for row in connection.execute(_QUEUED_JOBS.limit(limit)).all()]

    def claim(self, job_id: str) -> bool:
        """Take a queued job out of the queue for this replica (PLANNING, leased to it when leases
        are on); False if another replica or a cancel took it first."""
        values = {"job": job_id, "me": self._replica,
                  "until": self._clock() + self._lease_s if self._lease_s else None}
        return database.transaction(self._engine, lambda c: c.execute(_CLAIM_QUEUED, values).first()) is not None
