"""`accelmesh devices` and `accelmesh score`: read the inventory.

`devices` lists lost devices too, marked LOST (a node gone is news; `--hide-lost` leaves them
out), with each device's reserved memory, utilisation and, for a caller who may list
reservations (operators), the jobs holding it. A filter that matches nothing because a value it
names is not one any device has (a misspelt type) says so, with the values that exist."""

from __future__ import annotations

import re
import sys

import grpc

from accelmesh.cli.tables import format_devices, format_ranking
from accelmesh.inventory.v1 import inventory_service_pb2 as inv_pb
from accelmesh.inventory.v1 import inventory_service_pb2_grpc
from accelmesh.runtime.channels import open_channel

DEFAULT_INVENTORY = "127.0.0.1:50051"


def inventory_stub(channel) -> inventory_service_pb2_grpc.InventoryServiceStub:
    return inventory_service_pb2_grpc.InventoryServiceStub(channel)


def list_all_devices(stub, filter_text: str = "") -> list:
    devices, token = [], ""
    while True:
        page = stub.ListDevices(inv_pb.ListDevicesRequest(filter=filter_text, page_size=1000, page_token=token))
        devices.extend(page.devices)
        token = page.next_page_token
        if not token:
            return devices


# The string fields a filter term compares with `=`, and where a device message keeps each.
FIELDS = {"type": lambda d: d.type, "kind": lambda d: d.kind, "node": lambda d: d.node_address}


def cmd_devices(args) -> int:
    with open_channel(args.inventory) as channel:
        stub = inventory_stub(channel)
        devices = list_all_devices(stub, args.filter)
        if not args.hide_lost and "health" not in args.filter:
            lost = 'health = "lost"' + (f" AND {args.filter}" if args.filter.strip() else "")
            devices += list_all_devices(stub, lost)
        if not devices and args.filter.strip():
            everywhere = list_all_devices(stub, "") + list_all_devices(stub, 'health = "lost"')
            unknown = unknown_values(args.filter, everywhere)
            if unknown:
                print(f"accelmesh: no device matches: {unknown}", file=sys.stderr)
                return 1
        print(format_devices(sorted(devices, key=lambda d: d.id), jobs_by_device(stub)))
    return 0


def jobs_by_device(stub) -> dict[str, list[str]] | None:
    """Device id -> the jobs holding a reservation on it; None when this caller may not list them."""
    try:
        reservations = stub.ListReservations(inv_pb.ListReservationsRequest()).reservations
    except grpc.RpcError as exc:
        if exc.code() == grpc.StatusCode.PERMISSION_DENIED:
            return None
        raise
    jobs: dict[str, list[str]] = {}
    for r in reservations:
        jobs.setdefault(r.device_id, []).append(r.job_id)
    return jobs


def unknown_values(filter_text: str, devices) -> str:
    """The filter's `field = "value"` terms whose value no device has, with the values there are."""
    said = []
    for field, value in re.findall(r'\b(type|kind|node)\s*=\s*"([^"]*)"', filter_text):
        known = sorted({FIELDS[field](d) for d in devices})
        if value not in known:
            said.append(f'no device has {field} "{value}"; the {field}s known are: {", ".join(known) or "none"}')
    return "; ".join(said)


def cmd_score(args) -> int:
    kind = inv_pb.TASK_KIND_TRAINING if args.kind == "training" else inv_pb.TASK_KIND_INFERENCE
    with open_channel(args.inventory) as channel:
        task = inv_pb.TaskProfile(kind=kind, precision=args.precision)
        ranking = inventory_stub(channel).ScoreDevices(inv_pb.ScoreDevicesRequest(task=task, filter=args.filter))
        print(format_ranking(ranking))
    return 0


def add_commands(sub) -> None:
    devices = sub.add_parser("devices", help="print the inventory as a table")
    devices.add_argument("--inventory", default=DEFAULT_INVENTORY)
    devices.add_argument("--filter", default="", help='e.g. platform = "cuda" AND capabilities:bf16')
    devices.add_argument("--hide-lost", action="store_true",
                         help="leave out the devices of nodes that stopped answering")
    devices.set_defaults(func=cmd_devices)
    score = sub.add_parser("score", help="rank devices for a task")
    score.add_argument("--inventory", default=DEFAULT_INVENTORY)
    score.add_argument("--kind", choices=("training", "inference"), default="training")
    score.add_argument("--precision", default="fp32")
    score.add_argument("--filter", default="")
    score.set_defaults(func=cmd_score)
