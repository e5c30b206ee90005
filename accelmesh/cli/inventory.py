"""`accelmesh devices` and `accelmesh score`: read the inventory."""

from __future__ import annotations

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


def cmd_devices(args) -> int:
    with open_channel(args.inventory) as channel:
        print(format_devices(list_all_devices(inventory_stub(channel), args.filter)))
    return 0


def cmd_score(args) -> int:
    kind = inv_pb.TASK_KIND_TRAINING if args.kind == "training" else inv_pb.TASK_KIND_INFERENCE
    with open_channel(args.inventory) as channel:
        task = inv_pb.TaskProfile(kind=kind, precision=args.precision)
        print(format_ranking(inventory_stub(channel).ScoreDevices(inv_pb.ScoreDevicesRequest(task=task, filter=args.filter))))
    return 0


def add_commands(sub) -> None:
    devices = sub.add_parser("devices", help="print the inventory as a table")
    devices.add_argument("--inventory", default=DEFAULT_INVENTORY)
    devices.add_argument("--filter", default="", help='e.g. platform = "cuda" AND capabilities:bf16')
    devices.set_defaults(func=cmd_devices)
    score = sub.add_parser("score", help="rank devices for a task")
    score.add_argument("--inventory", default=DEFAULT_INVENTORY)
    score.add_argument("--kind", choices=("training", "inference"), default="training")
    score.add_argument("--precision", default="fp32")
    score.add_argument("--filter", default="")
    score.set_defaults(func=cmd_score)
