"""What a node's report writes, inside the store's transaction: each device it reports added,
updated or recovered (one id reported by two live nodes is refused), its status samples stored
and pruned to the newest few; the lookup of the registered node every node write starts from; a
report or a missed poll written whole, with its change to the feed (``record_report``,
``record_miss``); and which inventory replica polls which node (``claim_nodes``: leases on the
node rows, fair shares counted from the replicas' heartbeats). Kept apart from ``store.py`` as
``reservations.py`` and ``removal.py`` are: the store holds the transactions, these the rules
applied within them. The statements go out in batches (one SELECT for all the reported devices,
one executemany per kind of write) because a poll cycle writes every node.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from accelmesh.errors import FailedPrecondition, NotFound
from accelmesh.hardware.model import DeviceSample, DeviceSpec, NodeDescription
from accelmesh.runtime.database import upsert
from inventory_svc.changes import Change, write_change
from inventory_svc.records import DeviceChange, NodeRecord
from inventory_svc.rows import NODE_BY_ADDRESS, NODE_SELECT, SPEC_COLUMNS, spec_values
from inventory_svc.tables import devices, inventory_replicas, nodes, status_samples


def node_record(conn: Connection, address: str) -> NodeRecord:
    row = conn.execute(NODE_BY_ADDRESS, {"address": address}).first()
    if row is None:
        raise NotFound(f"node {address!r} is not registered; register the node before reporting on it")
    return NodeRecord(*row)


_EXISTING = sa.select(
    devices.c.id, *(devices.c[c] for c in SPEC_COLUMNS), devices.c.node_address, devices.c.health
).where(devices.c.id.in_(sa.bindparam("ids", expanding=True)))
_INSERT_DEVICE = sa.insert(devices)
_UPDATE_DEVICE = (
    sa.update(devices).where(devices.c.id == sa.bindparam("b_id"))
    .values({**{c: sa.bindparam("v_" + c) for c in SPEC_COLUMNS}, "node_address": sa.bindparam("b_address"),
             "updated_at": sa.bindparam("b_now")})
)
_RECOVER_DEVICE = (
    sa.update(devices).where(devices.c.id == sa.bindparam("b_id"))
    .values(health="healthy", updated_at=sa.bindparam("b_now"))
)


def upsert_devices(conn: Connection, address: str, specs: Sequence[DeviceSpec], now: float) -> list[DeviceChange]:
    """Write the reported ``specs`` of node ``address``; the changes, in the order of ``specs``."""
    if not specs:
        return []
    existing = {row[0]: row[1:] for row in conn.execute(_EXISTING, {"ids": [s.id for s in specs]})}
    owners_active: dict[str, bool] = {}
    inserts, updates, recoveries, changes = [], [], [], []
    for spec in specs:
        values = spec_values(spec)
        row = existing.get(spec.id)
        if row is None:
            inserts.append({"id": spec.id, "node_address": address, **dict(zip(SPEC_COLUMNS, values)),
                            "first_seen_at": now, "updated_at": now})
            changes.append(DeviceChange("added", spec.id))
            continue
        owner, health = row[-2], row[-1]
        if owner != address:
            if owner not in owners_active:
                owners_active[owner] = node_record(conn, owner).state == "active"
            if owners_active[owner]:
                # Two live workers claiming one id would flip the row between them on every poll.
                raise FailedPrecondition(
                    f"device {spec.id} is already reported by node {owner}; run one worker per node IP, "
                    f"or give this worker its own IP with --advertise-ip"
                )
        if tuple(row[: len(SPEC_COLUMNS)]) != values or owner != address:
            updates.append({**{"v_" + c: v for c, v in zip(SPEC_COLUMNS, values)},
                            "b_id": spec.id, "b_address": address, "b_now": now})
            changes.append(DeviceChange("updated", spec.id))
        if health != "healthy":
            recoveries.append({"b_id": spec.id, "b_now": now})
            changes.append(DeviceChange("recovered", spec.id))
    for statement, params in ((_INSERT_DEVICE, inserts), (_UPDATE_DEVICE, updates), (_RECOVER_DEVICE, recoveries)):
        if params:
            conn.execute(statement, params)
    return changes


def store_samples(conn: Connection, samples: Sequence[DeviceSample]) -> None:
    """Insert the samples; one at a (device, ts) already stored replaces it (a worker re-sent it)."""
    if samples:
        conn.execute(upsert(conn, status_samples), [
            {"device_id": s.device_id, "ts": s.timestamp, "memory_total": s.memory_total_bytes,
             "memory_used": s.memory_used_bytes, "utilization": s.utilization,
             "temperature_c": s.temperature_c, "power_w": s.power_w}
            for s in samples
        ])


_n = status_samples.alias("n")
_DEVICE = sa.bindparam("b_device")
# Seeks on the (device_id, ts) key only: the age cut-off, and the ts of the Nth newest sample
# (NULL while a device has fewer than N, which deletes nothing). The newest sample always stays:
# it is the device's current status, even from a skewed clock.
_PRUNE = sa.delete(status_samples).where(
    status_samples.c.device_id == _DEVICE,
    status_samples.c.ts < sa.select(sa.func.max(_n.c.ts)).where(_n.c.device_id == _DEVICE).scalar_subquery(),
    sa.or_(
        status_samples.c.ts < sa.bindparam("b_cutoff"),
        status_samples.c.ts < sa.select(_n.c.ts).where(_n.c.device_id == _DEVICE)
        .order_by(_n.c.ts.desc()).limit(1).offset(sa.bindparam("b_keep", type_=sa.Integer)).scalar_subquery(),
    ),
)


def prune_samples(conn: Connection, device_ids: Sequence[str], *, cutoff: float, keep: int) -> None:
    """Drop each device's samples older than `cutoff` or beyond its newest `keep`."""
    if device_ids:
        conn.execute(_PRUNE, [{"b_device": d, "b_cutoff": cutoff, "b_keep": keep - 1} for d in device_ids])


# -- a report or a missed poll, whole ----------------------------------------------------------

_HEALTHY_ON_NODE = (
    sa.select(devices.c.id)
    .where(devices.c.node_address == sa.bindparam("address"), devices.c.health == "healthy")
    .order_by(devices.c.id)
)
_NODE_SEEN = sa.update(nodes).where(nodes.c.address == sa.bindparam("b_address")).values(
    ip=sa.bindparam("b_ip"), hostname=sa.bindparam("b_hostname"), state="active",
    last_seen_at=sa.bindparam("b_now"), missed_polls=0, last_error="",
)
_MARK_LOST = (
    sa.update(devices).where(devices.c.id.in_(sa.bindparam("b_ids", expanding=True)))
    .values(health="lost", updated_at=sa.bindparam("b_now"))
)


def record_report(
    conn: Connection, writer: str, address: str, description: NodeDescription, now: float, *,
    retention_s: float, keep: int,
) -> tuple[list[DeviceChange], Change]:
    """Write what node ``address`` reported and the change to the feed (as ``writer``): the node
    seen, its devices upserted, those it no longer reports lost, its samples stored and pruned to
    ``retention_s`` and the newest ``keep``. The device changes, and the feed's change."""
    node_record(conn, address)
    conn.execute(_NODE_SEEN, {"b_address": address, "b_ip": description.ip,
                              "b_hostname": description.hostname, "b_now": now})
    reported = {spec.id for spec in description.devices}
    changes = upsert_devices(conn, address, description.devices, now)
    gone = [device for (device,) in conn.execute(_HEALTHY_ON_NODE, {"address": address})
            if device not in reported]
    if gone:
        conn.execute(_MARK_LOST, {"b_ids": gone, "b_now": now})
        changes.extend(DeviceChange("lost", device) for device in gone)
    # A sample for an unreported device has no row to belong to.
    samples = [s for s in description.samples if s.device_id in reported]
    store_samples(conn, samples)
    prune_samples(conn, sorted({s.device_id for s in samples}), cutoff=now - retention_s, keep=keep)
    change = Change(writer, now, tuple(changes), tuple(samples))
    write_change(conn, change)
    return changes, change


def record_miss(
    conn: Connection, writer: str, address: str, error: str, now: float, lost_after: int,
) -> tuple[list[str], Change]:
    """Count a missed poll of node ``address``; at the ``lost_after``-th in a row the node and its
    healthy devices become lost, and the change goes to the feed. The devices lost, and the change."""
    node_record(conn, address)
    missed = conn.execute(
        sa.update(nodes).where(nodes.c.address == address)
        .values(missed_polls=nodes.c.missed_polls + 1, last_error=error).returning(nodes.c.missed_polls)
    ).scalar_one()
    if missed < lost_after:
        return [], Change(writer, now)
    conn.execute(sa.update(nodes).where(nodes.c.address == address).values(state="lost"))
    lost = list(conn.execute(_HEALTHY_ON_NODE, {"address": address}).scalars())
    conn.execute(
        sa.update(devices).where(devices.c.node_address == address, devices.c.health == "healthy")
        .values(health="lost", updated_at=now)
    )
    change = Change(writer, now, tuple(DeviceChange("lost", device) for device in lost))
    write_change(conn, change)
    return lost, change


# -- who polls which node ----------------------------------------------------------------------

_node, _live = nodes.c, inventory_replicas.c
_HELD = nodes.c.poller == sa.bindparam("b_replica")
_LAPSED = sa.or_(
    _node.poller.is_(None), _node.poll_lease_until.is_(None), _node.poll_lease_until <= sa.bindparam("b_now"),
)


def _replica_update(new: sa.ColumnCollection) -> dict:
    return {"seen_at": new.seen_at, "live_until": new.live_until}


def heartbeat(conn: Connection, replica: str, now: float, lease_s: float) -> None:
    """Record ``replica`` as live until ``now + lease_s``, and forget replicas no longer live (each
    restart is a new id). Those rows are taken with SKIP LOCKED, so two replicas forgetting the
    same dead ones never wait on each other."""
    dead = (
        sa.select(_live.id).where(_live.live_until <= now, _live.id != replica)
        .with_for_update(skip_locked=True).scalar_subquery()
    )
    conn.execute(sa.delete(inventory_replicas).where(_live.id.in_(dead)))
    conn.execute(upsert(conn, inventory_replicas, _replica_update),
                 {"id": replica, "seen_at": now, "live_until": now + lease_s})


def claim_nodes(conn: Connection, replica: str, now: float, lease_s: float, renew: bool) -> list[NodeRecord]:
    """The nodes ``replica`` polls from ``now``: its fair share, ceil(nodes / live replicas).

    With ``renew`` (every poll cycle) the replica heartbeats, extends the leases it holds to
    ``now + lease_s`` and gives back what is over its share (the last by address), so a replica
    that just started finds nodes to take. Without it (the checks between cycles) it only takes:
    a replica that stops renewing lets its leases and its liveness lapse at the same time, so its
    nodes are never held back by a share still counting it.

    Free nodes (no poller, or a lapsed lease) are taken in address order. On PostgreSQL the rows
    are locked FOR UPDATE SKIP LOCKED: a row another replica is claiming at this moment is left
    to it, and one it claimed and committed no longer matches, so no node is taken by two. The
    replica's own rows are locked without SKIP: only a claim that finds their lease lapsed (a
    skewed clock) competes for them, and it never waits while holding them. SQLite's writers
    take the file's lock at BEGIN IMMEDIATE, where FOR UPDATE compiles to nothing.
    """
    until = now + lease_s
    if renew:
        heartbeat(conn, replica, now, lease_s)
    others = conn.execute(
        sa.select(sa.func.count()).where(_live.live_until > now, _live.id != replica)
    ).scalar_one()
    total = conn.execute(sa.select(sa.func.count()).select_from(nodes)).scalar_one()
    share = math.ceil(total / (others + 1))
    params = {"b_replica": replica, "b_now": now}
    held = list(conn.execute(
        sa.select(_node.address).where(_HELD, _node.poll_lease_until > sa.bindparam("b_now"))
        .order_by(_node.address).with_for_update(), params,
    ).scalars())
    if renew:
        held, over = held[:share], held[share:]
        if held:
            conn.execute(sa.update(nodes).where(_node.address.in_(held)).values(poll_lease_until=until))
        if over:
            conn.execute(sa.update(nodes).where(_node.address.in_(over)).values(poller=None, poll_lease_until=None))
    if len(held) < share:
        taken = list(conn.execute(
            sa.select(_node.address).where(_LAPSED).order_by(_node.address)
            .limit(share - len(held)).with_for_update(skip_locked=True), params,
        ).scalars())
        if taken:
            conn.execute(
                sa.update(nodes).where(_node.address.in_(taken)).values(poller=replica, poll_lease_until=until)
            )
            held += taken
    if not held:
        return []
    rows = conn.execute(NODE_SELECT.where(_node.address.in_(held)).order_by(_node.address))
    return [NodeRecord(*row) for row in rows]


def release_nodes(conn: Connection, replica: str) -> int:
    """Give back every node ``replica`` holds and leave the live replicas: at a clean shutdown, so
    the others take its nodes at their next claim instead of when its leases lapse."""
    conn.execute(sa.delete(inventory_replicas).where(_live.id == replica))
    return conn.execute(
        sa.update(nodes).where(_HELD).values(poller=None, poll_lease_until=None), {"b_replica": replica}
    ).rowcount
