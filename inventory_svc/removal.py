"""Removing a node, inside the store's transaction: what goes with it (its devices, their samples
and reservations), when that is refused (a job holds one of its devices), and which lost nodes
have been silent long enough to be forgotten. Kept apart from ``store.py`` as ``polls.py`` and
``reservations.py`` are: the store holds the transactions, these the rules applied within them.
"""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from accelmesh.errors import FailedPrecondition, NotFound, quoted
from inventory_svc.changes import Change, write_change
from inventory_svc.records import DeviceChange, NodeRecord, RemovedNode, Reservation
from inventory_svc.reservations import lock_devices
from inventory_svc.rows import DEVICES_BY_IDS, NODE_SELECT, RESERVATION_COLUMNS, device_record
from inventory_svc.tables import devices, nodes, reservations, status_samples

_DEVICES_OF_NODE = (
    sa.select(devices.c.id).where(devices.c.node_address == sa.bindparam("address")).order_by(devices.c.id)
)
_LIVE_ON = (
    sa.select(*RESERVATION_COLUMNS)
    .where(reservations.c.device_id.in_(sa.bindparam("ids", expanding=True)),
           reservations.c.expires_at > sa.bindparam("now"))
    .order_by(reservations.c.job_id, reservations.c.device_id)
)
# A node is forgotten from its last answer (registration, if it never answered): the polls missed
# before it was declared lost count, a few poll intervals against a limit of an hour by default.
_LOST_SINCE = (
    sa.select(nodes.c.address)
    .where(nodes.c.state == "lost",
           sa.func.coalesce(nodes.c.last_seen_at, nodes.c.registered_at) < sa.bindparam("before"))
    .order_by(nodes.c.address)
)


def lost_since(conn: Connection, before: float) -> list[str]:
    """The lost nodes that have not answered since before ``before``, by address."""
    return list(conn.execute(_LOST_SINCE, {"before": before}).scalars())


def remove_node(
    conn: Connection, writer: str, address: str, now: float, force: bool, silent_since: float | None = None,
) -> tuple[RemovedNode | None, Change]:
    """Delete node ``address`` with its devices, their samples and reservations, and write the
    change (each device removed) to the feed as ``writer``. Refused (FailedPrecondition naming
    the jobs) while a job holds a live reservation on one of its devices, unless ``force``.

    With ``silent_since`` (forgetting, not an operator's removal) a node that is gone already or
    answered since is left alone: the result is None and the change empty."""
    # Locked first, as a poll's writes lock it first (then its devices): the orders agree.
    row = conn.execute(NODE_SELECT.where(nodes.c.address == address).with_for_update()).first()
    if row is None:
        if silent_since is not None:
            return None, Change(writer, now)
        raise NotFound(f"address: node {quoted(address)} is not registered; list the nodes with `accelmesh nodes "
                       "list` (ListNodes) and name one by its address as shown there", field="address")
    node = NodeRecord(*row)
    if silent_since is not None and not _silent_since(node, silent_since):
        return None, Change(writer, now)
    ids = list(conn.execute(_DEVICES_OF_NODE, {"address": address}).scalars())
    lock_devices(conn, ids)  # a claim on one of them waits, then finds the device gone
    records = sorted((device_record(r) for r in conn.execute(DEVICES_BY_IDS, {"ids": ids, "now": now})),
                     key=lambda record: record.id)
    live = [Reservation(*r) for r in conn.execute(_LIVE_ON, {"ids": ids, "now": now})]
    if live and not force:
        jobs = sorted({r.job_id for r in live})
        raise FailedPrecondition(
            f"node {quoted(address)} has devices reserved by job(s) {', '.join(jobs)}; wait for them to end or "
            "cancel them, or remove the node anyway with force (`accelmesh nodes remove --force`), which ends "
            "their reservations", field="force")
    for table in (reservations, status_samples):
        conn.execute(sa.delete(table).where(table.c.device_id.in_(ids)))
    conn.execute(sa.delete(devices).where(devices.c.node_address == address))
    conn.execute(sa.delete(nodes).where(nodes.c.address == address))
    change = Change(writer, now, tuple(DeviceChange("removed", device) for device in ids))
    write_change(conn, change)
    return RemovedNode(node, tuple(records), tuple(live)), change


def _silent_since(node: NodeRecord, since: float) -> bool:
    """``_LOST_SINCE`` for one node already read."""
    heard = node.registered_at if node.last_seen_at is None else node.last_seen_at
    return node.state == "lost" and heard < since
