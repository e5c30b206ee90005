"""The `accelmesh` command: up, demo, devices, score."""

from __future__ import annotations

import argparse
import signal
import sys
import threading

import grpc

from accelmesh import errors
from accelmesh.common.v1 import common_pb2
from accelmesh.embedded import DEFAULT_DATA_DIR, DEFAULT_EMULATE, start_embedded_mesh
from accelmesh.inventory.v1 import inventory_service_pb2 as inv_pb
from accelmesh.inventory.v1 import inventory_service_pb2_grpc
from accelmesh.runtime.channels import open_channel

DEFAULT_INVENTORY = "127.0.0.1:50051"
GIB = 1024**3


def _gib(n: int) -> str:
    return f"{n / GIB:.1f}"


def format_devices(devices) -> str:
    rows = [("DEVICE", "TYPE", "KIND", "CAPABILITIES", "FREE/TOTAL GiB", "TFLOP/s fp32|bf16", "HEALTH")]
    for d in devices:
        peak = d.performance.peak_tflops
        caps = [c for c in d.capabilities if c in ("bf16", "fp16", "tf32", "fp8", "avx512f", "avx512_bf16", "amx_bf16", "avx2")]
        rows.append((
            d.id,
            d.type,
            d.kind,
            ",".join(caps) or "-",
            f"{_gib(d.status.memory_free_bytes)}/{_gib(d.status.memory_total_bytes or d.performance.memory_bytes)}",
            f"{peak.get('fp32', 0):.1f}|{peak['bf16']:.1f}" if "bf16" in peak else f"{peak.get('fp32', 0):.1f}|-",
            common_pb2.DeviceHealth.Name(d.health).removeprefix("DEVICE_HEALTH_").lower(),
        ))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def list_all_devices(stub, filter_text: str = "") -> list:
    devices, token = [], ""
    while True:
        page = stub.ListDevices(inv_pb.ListDevicesRequest(filter=filter_text, page_size=1000, page_token=token))
        devices.extend(page.devices)
        token = page.next_page_token
        if not token:
            return devices


def format_ranking(response) -> str:
    w = response.weights
    lines = [f"weights: compute {w.compute:.2f}  memory {w.memory:.2f}  bandwidth {w.bandwidth:.2f}"]
    for rank, s in enumerate(response.devices, 1):
        c = s.components
        lines.append(
            f"  {rank}. {s.device.id:<22} score {s.score:.3f}  (compute {c.compute:.2f}, memory {c.memory:.2f}, "
            f"bandwidth {c.bandwidth:.2f})  {s.device.type}"
        )
    return "\n".join(lines)


def cmd_devices(args) -> int:
    with open_channel(args.inventory) as channel:
        stub = inventory_service_pb2_grpc.InventoryServiceStub(channel)
        print(format_devices(list_all_devices(stub, args.filter)))
    return 0


def cmd_score(args) -> int:
    kind = inv_pb.TASK_KIND_TRAINING if args.kind == "training" else inv_pb.TASK_KIND_INFERENCE
    with open_channel(args.inventory) as channel:
        stub = inventory_service_pb2_grpc.InventoryServiceStub(channel)
        task = inv_pb.TaskProfile(kind=kind, precision=args.precision)
        print(format_ranking(stub.ScoreDevices(inv_pb.ScoreDevicesRequest(task=task, filter=args.filter))))
    return 0


def _start(args):
    emulate = tuple(p for p in args.emulate.split(",") if p) if args.emulate is not None else DEFAULT_EMULATE
    print(f"starting the mesh: inventory + one worker with {args.devices} CPU devices"
          f"{' emulating ' + ', '.join(emulate) if emulate else ''} ...", flush=True)
    return start_embedded_mesh(
        args.data_dir, devices=args.devices, emulate=emulate, inventory_listen=args.inventory_listen, echo=args.verbose
    )


def cmd_up(args) -> int:
    with _start(args) as mesh:
        print(f"inventory  {mesh.inventory.address}\nworker     {mesh.workers[0].address}")
        with open_channel(mesh.inventory.address) as channel:
            print(format_devices(list_all_devices(inventory_service_pb2_grpc.InventoryServiceStub(channel))))
        print("mesh is up; Ctrl-C stops it", flush=True)
        stop = threading.Event()
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        try:
            stop.wait()
        except KeyboardInterrupt:
            pass
    return 0


def cmd_demo(args) -> int:
    with _start(args) as mesh:
        with open_channel(mesh.inventory.address) as channel:
            stub = inventory_service_pb2_grpc.InventoryServiceStub(channel)
            devices = list_all_devices(stub)
            print(f"\n{len(devices)} devices in the inventory ({mesh.inventory.address}):\n")
            print(format_devices(devices))
            ids = [d.id for d in devices]
            fresh = stub.RefreshDevices(inv_pb.RefreshDevicesRequest(device_ids=ids))
            print(f"\nreal-time refresh: {len(fresh.devices)} devices re-sampled")
            for kind, name in ((inv_pb.TASK_KIND_TRAINING, "training"), (inv_pb.TASK_KIND_INFERENCE, "inference")):
                task = inv_pb.TaskProfile(kind=kind, precision="bf16")
                print(f"\nranking for {name} (bf16):")
                print(format_ranking(stub.ScoreDevices(inv_pb.ScoreDevicesRequest(task=task))))
    print("\nmesh stopped")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="accelmesh", description="run deep-learning jobs on a pool of mixed accelerators")
    sub = parser.add_subparsers(dest="command", required=True)

    def mesh_flags(p):
        p.add_argument("--devices", type=int, default=4, help="split the CPU into N XLA devices (default 4)")
        p.add_argument("--emulate", default=None,
                       help=f"comma list of catalog types emulated on the CPU devices (default {','.join(DEFAULT_EMULATE)}; '' for none)")
        p.add_argument("--data-dir", default=DEFAULT_DATA_DIR, help="where the inventory database lives")
        p.add_argument("--inventory-listen", default=f"{DEFAULT_INVENTORY.split(':')[0]}:0")
        p.add_argument("--verbose", action="store_true", help="echo the services' logs")

    up = sub.add_parser("up", help="run inventory and a worker on this machine until Ctrl-C")
    mesh_flags(up)
    up.set_defaults(func=cmd_up, inventory_listen=DEFAULT_INVENTORY)
    demo = sub.add_parser("demo", help="start the embedded mesh, show devices and rankings, stop")
    mesh_flags(demo)
    demo.set_defaults(func=cmd_demo)
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
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except grpc.RpcError as exc:
        print(f"accelmesh: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    except errors.AccelmeshError as exc:
        print(f"accelmesh: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
