"""Reservations: the rule that a job may claim only memory no other job holds, applied inside the
store's transaction so that two jobs claiming the same bytes cannot both succeed, even from two
inventory replicas on one PostgreSQL database (requirements B5); the renewal of a job's leases,
which extends what it holds and never claims anything anew; and the lease a request may ask for
(``lease_seconds``), checked before any transaction begins.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from accelmesh.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted, quoted
from accelmesh.hardware.model import free_memory_bytes
from accelmesh.runtime.database import upsert
from inventory_svc.records import Reservation
from inventory_svc.rows import DEVICE_BY_ID, RESERVATION_COLUMNS, device_record
from inventory_svc.tables import devices, reservations

_r = reservations.c

DEFAULT_RESERVATION_TTL_S = 300.0  # a lease asked for with ttl_seconds 0 (ReserveDevices, RenewReservations)
MAX_RESERVATION_TTL_S = 24 * 3600.0  # the longest lease one call may ask for


def lease_seconds(ttl_s: float) -> float:
    """The lease a request's ttl_seconds asks for: 0 means the default, the rest 1..MAX."""
    ttl_s = ttl_s or DEFAULT_RESERVATION_TTL_S
    if not 0 < ttl_s <= MAX_RESERVATION_TTL_S:
        raise InvalidArgument(f"ttl_seconds must be within 1..{int(MAX_RESERVATION_TTL_S)}, got {ttl_s:g}; "
                              "use 0 for the default", field="ttl_seconds")
    return ttl_s


def check_claims(job_id: str, claims: Sequence[tuple[str, int, float]], ttl_s: float) -> None:
    """Refuse malformed (device_id, memory_bytes, compute_fraction) claims before any is written."""
    for _, memory_bytes, compute_fraction in claims:
        _check_claim(job_id, memory_bytes, compute_fraction, ttl_s)
    devices_named = [claim[0] for claim in claims]
    repeated = sorted({d for d in devices_named if devices_named.count(d) > 1})
    if repeated:
        raise InvalidArgument(f"claims name device {repeated[0]!r} more than once; combine them into one claim")


def lock_devices(conn: Connection, device_ids: Sequence[str]) -> None:
    """Hold the claimed devices' rows until the transaction ends, so another replica's claim on one
    of them waits for this one and then sees its reservation (PostgreSQL: SELECT ... FOR UPDATE).
    In id order, so two claims over the same devices lock them in one order and cannot deadlock.
    SQLite needs nothing: the store's writers take the file's lock at BEGIN IMMEDIATE."""
    if conn.dialect.name != "sqlite":
        conn.execute(
            sa.select(devices.c.id).where(devices.c.id.in_(sorted(set(device_ids))))
            .order_by(devices.c.id).with_for_update()
        ).all()


def _claim_update(new: sa.ColumnCollection) -> dict:
    # A row whose lease already lapsed is a new reservation, so it gets a new created_at.
    return {
        "memory_bytes": new.memory_bytes, "compute_fraction": new.compute_fraction,
        "created_at": sa.case((_r.expires_at <= new.created_at, new.created_at), else_=_r.created_at),
        "expires_at": new.expires_at,
    }


def reserve_one(
    conn: Connection, job_id: str, device_id: str, memory_bytes: int, compute_fraction: float,
    ttl_s: float, now: float,
) -> Reservation:
    row = conn.execute(DEVICE_BY_ID, {"id": device_id, "now": now}).first()
    if row is None:
        raise NotFound(f"device {device_id!r} is not in the inventory; list devices with ListDevices")
    record = device_record(row)
    if record.health != "healthy":
        raise FailedPrecondition(f"device {device_id!r} is lost; reserve a healthy device instead")
    # The job's own earlier claim is being replaced, so only other jobs' claims count.
    others = conn.execute(
        sa.select(sa.cast(sa.func.coalesce(sa.func.sum(_r.memory_bytes), 0), sa.BigInteger))
        .where(_r.device_id == device_id, _r.job_id != job_id, _r.expires_at > now)
    ).scalar_one()
    free = free_memory_bytes(record.memory_total_bytes, record.memory_used_bytes, others)
    if memory_bytes > free:
        raise ResourceExhausted(
            f"memory_bytes: requested {memory_bytes} bytes on device {device_id!r} but only {free} bytes "
            f"are free after other jobs' reservations; request less or choose another device"
        )
    conn.execute(upsert(conn, reservations, _claim_update), {
        "job_id": job_id, "device_id": device_id, "memory_bytes": int(memory_bytes),
        "compute_fraction": float(compute_fraction), "created_at": now, "expires_at": now + ttl_s,
    })
    row = conn.execute(
        sa.select(*RESERVATION_COLUMNS).where(_r.job_id == job_id, _r.device_id == device_id)
    ).one()
    return Reservation(*row)


def renew_leases(
    conn: Connection, job_id: str, device_ids: Sequence[str] | None, ttl_s: float, now: float,
) -> list[Reservation]:
    """Move the end of `job_id`'s live leases (those on `device_ids`, or all) to `now + ttl_s`,
    amounts unchanged; all the named devices or none.

    Only a lease still live at `now` is renewed: one that lapsed or was released has had its
    memory free for other jobs, so handing it back silently could double-book the device. The
    caller learns it is gone (NOT_FOUND) and may reserve again, through the free-memory check."""
    rows = conn.execute(
        sa.select(*RESERVATION_COLUMNS).where(_r.job_id == job_id, _r.expires_at > now).order_by(_r.device_id)
    ).all()
    held = {row[1]: row for row in rows}
    if not held:
        raise NotFound(f"job {quoted(job_id)} holds no live reservation: it expired or was released; "
                       "reserve the devices again with ReserveDevices", field="job_id")
    wanted = sorted(set(device_ids)) if device_ids else sorted(held)
    missing = [device for device in wanted if device not in held]
    if missing:
        raise NotFound(f"device_ids: job {quoted(job_id)} holds no live reservation on {quoted(missing)} "
                       "(expired or released), so nothing was renewed; reserve those devices again with "
                       "ReserveDevices", field="device_ids")
    conn.execute(
        sa.update(reservations).where(_r.job_id == job_id, _r.device_id.in_(wanted)).values(expires_at=now + ttl_s)
    )
    return [Reservation(*held[device][:5], now + ttl_s) for device in wanted]


def _check_claim(job_id: str, memory_bytes: int, compute_fraction: float, ttl_s: float) -> None:
    if not job_id:
        raise InvalidArgument("job_id must not be empty; pass the id of the job that holds the reservation")
    if isinstance(memory_bytes, bool) or not isinstance(memory_bytes, int) or memory_bytes < 0:
        raise InvalidArgument(f"memory_bytes must be a whole number >= 0, got {memory_bytes!r}")
    if not (isinstance(compute_fraction, (int, float)) and 0.0 <= compute_fraction <= 1.0):
        raise InvalidArgument(f"compute_fraction must be between 0 and 1, got {compute_fraction!r}")
    check_ttl(ttl_s)


def check_ttl(ttl_s: float) -> None:
    if not (isinstance(ttl_s, (int, float)) and math.isfinite(ttl_s) and ttl_s > 0):
        raise InvalidArgument(f"ttl_s must be a finite number of seconds > 0, got {ttl_s!r}")
