"""Marking a node suspect, and trusting it again, inside the store's transaction.

A dispatcher marks a node suspect when a spot check (a shard run again on another node) found its
outputs wrong; while it is, its devices are not candidates for jobs (the dispatcher passes them
over). The mark stays through re-registrations and polls: only an operator's TrustNode, or
removing the node, clears it. The first reason is kept: later jobs finding the same node wrong
add nothing an operator needs. Marking and trusting write each of the node's devices UPDATED to
the change feed, so every replica's WatchDevices streams see their candidacy change.
"""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from accelmesh.errors import InvalidArgument, NotFound, quoted
from inventory_svc.changes import Change, write_change
from inventory_svc.polls import node_record
from inventory_svc.records import DeviceChange, NodeRecord
from inventory_svc.tables import devices, nodes

MAX_REASON_BYTES = 1024  # of MarkNodeSuspect's reason, kept


def mark_suspect(conn: Connection, writer: str, address: str, reason: str,
                 now: float) -> tuple[tuple[NodeRecord, list[DeviceChange]], Change]:
    if not reason:
        raise InvalidArgument("reason: say why the node is suspect (which job and shard, which outputs disagreed)",
                              field="reason")
    kept = reason.encode()[:MAX_REASON_BYTES].decode(errors="ignore")
    found = conn.execute(sa.update(nodes).where(nodes.c.address == address, nodes.c.suspect_at.is_(None))
                         .values(suspect_at=now, suspect_reason=kept)).rowcount
    if not found:
        _check_registered(conn, address)
    return _changed(conn, writer, address, now, bool(found))


def trust_node(conn: Connection, writer: str, address: str,
               now: float) -> tuple[tuple[NodeRecord, list[DeviceChange]], Change]:
    found = conn.execute(sa.update(nodes).where(nodes.c.address == address, nodes.c.suspect_at.is_not(None))
                         .values(suspect_at=None, suspect_reason="")).rowcount
    if not found:
        _check_registered(conn, address)
    return _changed(conn, writer, address, now, bool(found))


def _changed(conn: Connection, writer: str, address: str, now: float,
             changed: bool) -> tuple[tuple[NodeRecord, list[DeviceChange]], Change]:
    ids = conn.execute(sa.select(devices.c.id).where(devices.c.node_address == address).order_by(devices.c.id))
    events = [DeviceChange("updated", device_id) for device_id in ids.scalars()] if changed else []
    change = Change(writer, now, tuple(events))
    write_change(conn, change)
    return (node_record(conn, address), events), change


def _check_registered(conn: Connection, address: str) -> None:
    if conn.execute(sa.select(nodes.c.address).where(nodes.c.address == address)).first() is None:
        raise NotFound(f"address: node {quoted(address)} is not registered; list the nodes with `accelmesh nodes "
                       "list` (ListNodes) and name one by its address as shown there", field="address")
