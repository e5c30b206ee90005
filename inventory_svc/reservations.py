"""Reservations: the rule that a job may claim only memory no other job holds, applied inside the
store's transaction so that two jobs claiming the same bytes cannot both succeed (MISSION B5);
and the renewal of a job's leases, which extends what it holds and never claims anything anew.
"""

from __future__ import annotations

import math
import sqlite3
from collections.abc import Sequence

from accelmesh.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted, quoted
from accelmesh.hardware.model import free_memory_bytes
from inventory_svc.records import Reservation
from inventory_svc.rows import DEVICE_SELECT, device_record

RESERVATION_COLUMNS = "job_id, device_id, memory_bytes, compute_fraction, created_at, expires_at"


def check_claims(job_id: str, claims: Sequence[tuple[str, int, float]], ttl_s: float) -> None:
    """Refuse malformed (device_id, memory_bytes, compute_fraction) claims before any is written."""
    for _, memory_bytes, compute_fraction in claims:
        _check_claim(job_id, memory_bytes, compute_fraction, ttl_s)
    devices = [claim[0] for claim in claims]
    repeated = sorted({d for d in devices if devices.count(d) > 1})
    if repeated:
        raise InvalidArgument(f"claims name device {repeated[0]!r} more than once; combine them into one claim")


def reserve_one(
    conn: sqlite3.Connection, job_id: str, device_id: str, memory_bytes: int, compute_fraction: float,
    ttl_s: float, now: float,
) -> Reservation:
    row = conn.execute(DEVICE_SELECT + " WHERE d.id = :id", {"id": device_id, "now": now}).fetchone()
    if row is None:
        raise NotFound(f"device {device_id!r} is not in the inventory; list devices with ListDevices")
    record = device_record(row)
    if record.health != "healthy":
        raise FailedPrecondition(f"device {device_id!r} is lost; reserve a healthy device instead")
    # The job's own earlier claim is being replaced, so only other jobs' claims count.
    (others,) = conn.execute(
        "SELECT COALESCE(SUM(memory_bytes), 0) FROM reservations "
        "WHERE device_id = ? AND job_id != ? AND expires_at > ?",
        (device_id, job_id, now),
    ).fetchone()
    free = free_memory_bytes(record.memory_total_bytes, record.memory_used_bytes, others)
    if memory_bytes > free:
        raise ResourceExhausted(
            f"memory_bytes: requested {memory_bytes} bytes on device {device_id!r} but only {free} bytes "
            f"are free after other jobs' reservations; request less or choose another device"
        )
    # A row whose lease already lapsed is a new reservation, so it gets a new created_at.
    conn.execute(
        "INSERT INTO reservations (job_id, device_id, memory_bytes, compute_fraction, created_at, expires_at) "
        "VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT(job_id, device_id) DO UPDATE SET "
        "memory_bytes = excluded.memory_bytes, compute_fraction = excluded.compute_fraction, "
        "created_at = CASE WHEN reservations.expires_at <= excluded.created_at "
        "THEN excluded.created_at ELSE reservations.created_at END, expires_at = excluded.expires_at",
        (job_id, device_id, int(memory_bytes), float(compute_fraction), now, now + ttl_s),
    )
    row = conn.execute(
        f"SELECT {RESERVATION_COLUMNS} FROM reservations WHERE job_id = ? AND device_id = ?", (job_id, device_id)
    ).fetchone()
    return Reservation(*row)


def renew_leases(
    conn: sqlite3.Connection, job_id: str, device_ids: Sequence[str] | None, ttl_s: float, now: float,
) -> list[Reservation]:
    """Move the end of `job_id`'s live leases (those on `device_ids`, or all) to `now + ttl_s`,
    amounts unchanged; all the named devices or none.

    Only a lease still live at `now` is renewed: one that lapsed or was released has had its
    memory free for other jobs, so handing it back silently could double-book the device. The
    caller learns it is gone (NOT_FOUND) and may reserve again, through the free-memory check."""
    rows = conn.execute(
        f"SELECT {RESERVATION_COLUMNS} FROM reservations WHERE job_id = ? AND expires_at > ? ORDER BY device_id",
        (job_id, now),
    ).fetchall()
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
    conn.executemany("UPDATE reservations SET expires_at = ? WHERE job_id = ? AND device_id = ?",
                     [(now + ttl_s, job_id, device) for device in wanted])
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
