"""`accelmesh nodes list`, `accelmesh nodes remove` and `accelmesh nodes trust`: the inventory's
worker nodes (operators).

Removal is how a node that will not come back (a worker restarted on another port, a machine
retired) stops being polled before the inventory forgets it by itself (`--forget-lost-after`).
A node whose devices jobs hold is refused unless `--force`, which ends those reservations: the
service says which jobs, so the operator decides knowing what they cut off.

A node a dispatcher's spot check found returning wrong outputs is SUSPECT in the list, with why
under the table; its devices get no jobs until the operator, having looked into it, trusts it
again (`accelmesh nodes trust ADDRESS`) or removes it.
"""

from __future__ import annotations

import time

from accelmesh.cli.inventory import DEFAULT_INVENTORY, inventory_stub
from accelmesh.cli.tables import table
from accelmesh.inventory.v1 import inventory_service_pb2 as inv_pb
from accelmesh.runtime.channels import open_channel

STATES = {inv_pb.NODE_STATE_ACTIVE: "active", inv_pb.NODE_STATE_LOST: "LOST"}


def format_nodes(nodes, now: float) -> str:
    rows = [("ADDRESS", "HOSTNAME", "IP", "STATE", "DEVICES", "SUSPECT", "LAST SEEN", "MISSED POLLS", "LAST ERROR")]
    for n in nodes:
        seen = "never"
        if n.HasField("last_seen_time"):
            seen = f"{max(0.0, now - n.last_seen_time.ToNanoseconds() / 1e9):.0f}s ago"
        rows.append((n.address, n.hostname or "-", n.ip, STATES.get(n.state, "unknown"), str(n.device_count),
                     "SUSPECT" if n.suspect else "no", seen, str(n.missed_polls), n.last_error or "-"))
    reasons = [f"{n.address} is suspect since {_ago(n.suspect_time, now)}: {n.suspect_reason}"
               for n in nodes if n.suspect]
    return "\n".join([table(rows), *reasons])


def _ago(ts, now: float) -> str:
    return f"{max(0.0, now - ts.ToNanoseconds() / 1e9):.0f}s ago"


def cmd_list(args) -> int:
    with open_channel(args.inventory) as channel:
        nodes = inventory_stub(channel).ListNodes(inv_pb.ListNodesRequest()).nodes
    if not nodes:
        print("no nodes registered; a worker registers its node when it starts")
        return 0
    print(format_nodes(nodes, time.time()))
    return 0


def cmd_remove(args) -> int:
    with open_channel(args.inventory) as channel:
        removed = inventory_stub(channel).RemoveNode(inv_pb.RemoveNodeRequest(address=args.address, force=args.force))
    devices = ", ".join(removed.device_ids) or "none"
    jobs = sorted({r.job_id for r in removed.released_reservations})
    ended = f"; ended the reservations of job(s) {', '.join(jobs)}" if jobs else ""
    print(f"removed node {removed.node.address} and its {len(removed.device_ids)} device(s) ({devices}){ended}")
    return 0


def cmd_trust(args) -> int:
    with open_channel(args.inventory) as channel:
        node = inventory_stub(channel).TrustNode(inv_pb.TrustNodeRequest(address=args.address)).node
    print(f"node {node.address} is trusted again: its {node.device_count} device(s) are candidates for jobs")
    return 0


def add_commands(sub) -> None:
    group = sub.add_parser("nodes", help="the inventory's worker nodes: list them, remove or trust one (operators)")
    nodes = group.add_subparsers(dest="nodes_command", required=True)
    listing = nodes.add_parser("list", help="registered nodes and whether they answer polls")
    listing.set_defaults(func=cmd_list)
    remove = nodes.add_parser(
        "remove", help="remove a node and its devices; it is no longer polled (it may register again)",
        description="Remove a node and its devices from the inventory. Refused while jobs hold its devices, "
                    "unless --force.")
    remove.add_argument("address", metavar="ADDRESS", help="the node's host:port, as `accelmesh nodes list` shows it")
    remove.add_argument("--force", action="store_true",
                        help="remove it even while jobs hold its devices; their reservations end with it")
    remove.set_defaults(func=cmd_remove)
    trust = nodes.add_parser(
        "trust", help="clear a node's suspect mark: its devices are candidates for jobs again",
        description="Clear the suspect mark a dispatcher's spot check put on a node (see `accelmesh nodes list`).")
    trust.add_argument("address", metavar="ADDRESS", help="the node's host:port, as `accelmesh nodes list` shows it")
    trust.set_defaults(func=cmd_trust)
    for command in (listing, remove, trust):
        command.add_argument("--inventory", default=DEFAULT_INVENTORY, metavar="HOST:PORT",
                             help="the inventory service (default %(default)s)")
