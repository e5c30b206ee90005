"""Per-tenant quotas: how many jobs a tenant (a job's owner, "user:alice") may have holding devices
at once, how many devices and how much reserved device memory those jobs hold together, and the
highest priority its jobs may ask for. Operators set them (SetQuota); they live in the job book's
database, so every dispatch replica applies the same ones. Tenant "*" is the default for every
tenant without a quota of its own; a tenant under neither has no limit.

A job is admitted (`admit`) in one transaction that reads what its owner's other admitted jobs
hold and records what this one will hold (the jobs table's held_devices and held_bytes), under a
lock on the tenant (PostgreSQL: an advisory lock; SQLite: the file's write lock), so two replicas
admitting two jobs of one tenant at once cannot both pass its last slot. A job's holding counts
while it is unfinished and not queued: it stops counting the moment the job ends or goes back to
the queue, with no sweep needed.

A job's place in the queue is taken the same way (`take_queue_place`): under a lock on the
tenant's queue, its other places are counted (the queued jobs, and those having their inputs
stored to join them: a queue time set, not running, not final) with the bytes their inputs take
on the dispatch dir (held_bytes, which a job holding no devices keeps for its stored inputs), and
this job's place is marked in the same transaction, before any of its inputs is stored. So every
replica on the book, and every thread of one, sees the places taken before it: no two can take
the last one.
"""

from __future__ import annotations

from dataclasses import dataclass

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from accelmesh import errors
from accelmesh.errors import quoted
from accelmesh.runtime import database
from dispatch_svc.jobs import records as m
from dispatch_svc.jobs.schema.tables import jobs as jobs_table
from dispatch_svc.jobs.schema.tables import quotas as quotas_table

DEFAULT_TENANT = "*"
MAX_TENANT_CHARS = 256
TENANT_ROLES = ("user", "operator")  # the roles that submit jobs (Job.owner is "<role>:<name>")
LIMITS = ("max_jobs", "max_devices", "max_memory_bytes", "max_priority")

_J, _Q = jobs_table.c, quotas_table.c
_HOLDING = sa.and_(_J.held_devices > 0, _J.state.not_in((*m.FINAL_STATES, m.QUEUED)))
_QUOTA = sa.select(_Q.tenant, *(_Q[name] for name in LIMITS)).where(
    _Q.tenant.in_(sa.bindparam("tenants", expanding=True)))
_HELD = sa.select(sa.func.count(), sa.func.coalesce(sa.func.sum(_J.held_devices), 0),
                  sa.cast(sa.func.coalesce(sa.func.sum(_J.held_bytes), 0), sa.BigInteger)).where(
    _J.owner == sa.bindparam("owner"), _J.job_id != sa.bindparam("job"), _HOLDING)
_HOLD = jobs_table.update().where(_J.job_id == sa.bindparam("job")).values(
    held_devices=sa.bindparam("devices"), held_bytes=sa.bindparam("nbytes"))
_USE = (sa.select(_J.owner, sa.func.count(), sa.func.coalesce(sa.func.sum(_J.held_devices), 0),
                  sa.cast(sa.func.coalesce(sa.func.sum(_J.held_bytes), 0), sa.BigInteger))
        .where(_HOLDING).group_by(_J.owner))
_QUEUED_BY_OWNER = sa.select(_J.owner, sa.func.count()).where(_J.state == m.QUEUED).group_by(_J.owner)
# A tenant's other places in the queue: queued, or placed and having its inputs stored (a queued
# job tried again counts until it holds devices).
_PLACES = sa.select(sa.func.count(), sa.cast(sa.func.coalesce(sa.func.sum(_J.held_bytes), 0), sa.BigInteger)).where(
    _J.owner == sa.bindparam("owner"), _J.job_id != sa.bindparam("job"), _J.held_devices == 0,
    sa.or_(_J.state == m.QUEUED, sa.and_(_J.queued_at.is_not(None), _J.state.not_in((*m.FINAL_STATES, m.RUNNING)))))
_PLACE = jobs_table.update().where(_J.job_id == sa.bindparam("job")).values(
    queued_at=sa.bindparam("now"), held_devices=0, held_bytes=sa.bindparam("nbytes"))


@dataclass(frozen=True)
class Quota:
    tenant: str
    max_jobs: int | None = None  # None: no limit
    max_devices: int | None = None
    max_memory_bytes: int | None = None
    max_priority: int | None = None


@dataclass(frozen=True)
class Use:
    """What a tenant's jobs hold now, and the quota that applies to it (None: none)."""

    tenant: str
    quota: Quota | None
    jobs: int = 0
    devices: int = 0
    memory_bytes: int = 0
    queued: int = 0


class OverQuota(errors.ResourceExhausted):
    """The job would take its owner over a quota now (it waits in the queue until it fits)."""


def check_quota(quota: Quota) -> Quota:
    """The quota if every field is usable; InvalidArgument naming the field otherwise."""
    role, _, name = quota.tenant.partition(":")
    if quota.tenant != DEFAULT_TENANT and (
            role not in TENANT_ROLES or not name or len(quota.tenant) > MAX_TENANT_CHARS):
        raise errors.InvalidArgument(
            f"quota.tenant {quoted(quota.tenant, 80)} is not a tenant: give a job owner as Job.owner shows it "
            f"(\"user:alice\", \"operator:ops\"), or \"*\" for every tenant without a quota of its own",
            field="quota.tenant")
    for name in LIMITS:
        value = getattr(quota, name)
        if value is not None and value < 0:
            raise errors.InvalidArgument(f"quota.{name} is {value}; use a number >= 0, or leave it unset for no limit",
                                         field=f"quota.{name}")
    if quota.max_priority is not None and quota.max_priority > m.MAX_PRIORITY:
        raise errors.InvalidArgument(f"quota.max_priority is {quota.max_priority}; priorities go up to "
                                     f"{m.MAX_PRIORITY}", field="quota.max_priority")
    return quota


class Quotas:
    def __init__(self, engine: Engine):
        self._engine = engine
        self._upsert = database.upsert(engine, quotas_table)

    def set(self, quota: Quota) -> Quota:
        check_quota(quota)
        row = {"tenant": quota.tenant, **{name: getattr(quota, name) for name in LIMITS}}
        database.transaction(self._engine, lambda c: c.execute(self._upsert, row))
        return quota

    def remove(self, tenant: str) -> bool:
        """Remove the tenant's own quota; False if it had none."""
        statement = quotas_table.delete().where(_Q.tenant == tenant)
        return bool(database.transaction(self._engine, lambda c: c.execute(statement).rowcount))

    def all(self) -> tuple[Quota, ...]:
        """Every quota set, by tenant."""
        with database.connected(self._engine) as connection:
            rows = connection.execute(sa.select(_Q.tenant, *(_Q[n] for n in LIMITS)).order_by(_Q.tenant)).all()
        return tuple(Quota(*row) for row in rows)

    def of(self, tenant: str, connection: Connection | None = None) -> Quota | None:
        """The quota that applies to `tenant`: its own, else the default ("*"), else None."""
        if connection is None:
            with database.connected(self._engine) as connection:
                return self.of(tenant, connection)
        rows = {row[0]: Quota(*row) for row in connection.execute(_QUOTA, {"tenants": [tenant, DEFAULT_TENANT]})}
        return rows.get(tenant) or rows.get(DEFAULT_TENANT)

    def check_priority(self, tenant: str, priority: int) -> None:
        """PermissionDenied if the tenant's quota does not allow `priority`."""
        if not priority:
            return
        quota = self.of(tenant)
        if quota is not None and quota.max_priority is not None and priority > quota.max_priority:
            raise errors.PermissionDenied(
                f"spec.priority is {priority}, but the quota of {tenant} allows at most {quota.max_priority}; ask for "
                "less, or ask an operator to raise the quota's max_priority", field="spec.priority")

    def admit(self, job_id: str, tenant: str, devices: int, nbytes: int) -> None:
        """Record that the job holds `devices` devices and `nbytes` reserved bytes, if its owner's
        quota allows it besides what the owner's other jobs hold now. OverQuota (it may wait) when
        they hold too much now; ResourceExhausted (it never fits) when the job alone is over."""
        def work(connection: Connection) -> None:
            if database.is_postgres(self._engine):
                connection.execute(sa.text("SELECT pg_advisory_xact_lock(hashtext(:t))"), {"t": "quota:" + tenant})
            quota = self.of(tenant, connection)
            if quota is not None:
                jobs, held_devices, held_bytes = connection.execute(_HELD, {"owner": tenant, "job": job_id}).one()
                _check(quota, tenant, (1, devices, nbytes), (jobs, held_devices, held_bytes))
            connection.execute(_HOLD, {"job": job_id, "devices": devices, "nbytes": nbytes})
        database.transaction(self._engine, work)

    def take_queue_place(self, job_id: str, tenant: str, nbytes: int, now: float, *, max_jobs: int,
                         max_bytes: int) -> tuple[int, int] | None:
        """Mark the job's place in the queue, its stored inputs taking `nbytes`, if the tenant's other
        places number fewer than `max_jobs` and take at most `max_bytes` with this one; None when it
        is taken, else (places, bytes) of the others, the job left as it was."""
        def work(connection: Connection) -> tuple[int, int] | None:
            if database.is_postgres(self._engine):
                connection.execute(sa.text("SELECT pg_advisory_xact_lock(hashtext(:t))"), {"t": "queue:" + tenant})
            places, held = connection.execute(_PLACES, {"owner": tenant, "job": job_id}).one()
            if places >= max_jobs or held + nbytes > max_bytes:
                return places, held
            connection.execute(_PLACE, {"job": job_id, "now": now, "nbytes": nbytes})
            return None
        return database.transaction(self._engine, work)

    def usage(self, tenant: str | None = None) -> list[Use]:
        """Every tenant with a quota, jobs holding devices or jobs queued (only `tenant`, if given), by name."""
        quotas = {quota.tenant: quota for quota in self.all()}
        with database.connected(self._engine) as connection:
            held = {row[0]: tuple(row[1:]) for row in connection.execute(_USE)}
            queued = dict(connection.execute(_QUEUED_BY_OWNER).all())
        names = sorted(set(quotas) | set(held) | set(queued))
        if tenant is not None:
            names = [tenant]
        return [Use(name, quotas.get(name) or (quotas.get(DEFAULT_TENANT) if name != DEFAULT_TENANT else None),
                    *held.get(name, (0, 0, 0)), queued.get(name, 0)) for name in names]


_WHAT = (("max_jobs", "jobs holding devices"), ("max_devices", "devices"),
         ("max_memory_bytes", "bytes of device memory"))


def _check(quota: Quota, tenant: str, wanted: tuple[int, int, int], held: tuple[int, int, int]) -> None:
    whose = (f"the quota of {tenant}" if quota.tenant == tenant
             else f"the default quota (\"*\"), which applies to {tenant},")
    for (name, what), want, have in zip(_WHAT, wanted, held):
        limit = getattr(quota, name)
        if limit is None:
            continue
        if want > limit:
            raise errors.ResourceExhausted(
                f"the job needs {want:,} {what} and {whose} allows {limit:,} at once, so it can never start; ask for "
                "less (spec.constraints.max_devices for devices) or ask an operator to raise the quota",
                field="spec")
        if have + want > limit:
            raise OverQuota(f"{tenant}'s other jobs hold {have:,} {what} and {whose} allows {limit:,}; the job needs "
                            f"{want:,}: it starts once they let go of enough")
