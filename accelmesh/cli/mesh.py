"""`accelmesh up` and `accelmesh demo`: the embedded mesh on this machine."""

from __future__ import annotations

import signal
import threading

from accelmesh.cli.compile import compile_stub
from accelmesh.cli.inventory import DEFAULT_INVENTORY, inventory_stub, list_all_devices
from accelmesh.cli.tables import format_builds, format_devices, format_ranking, format_rules
from accelmesh.compile.v1 import compile_service_pb2 as compile_pb
from accelmesh.embedded import DEFAULT_DATA_DIR, DEFAULT_EMULATE, EmbeddedMesh, start_embedded_mesh
from accelmesh.inventory.v1 import inventory_service_pb2 as inv_pb
from accelmesh.runtime.channels import open_channel


def _start(args) -> EmbeddedMesh:
    emulate = tuple(p for p in args.emulate.split(",") if p) if args.emulate is not None else DEFAULT_EMULATE
    print(f"starting the mesh: inventory, compile and one worker with {args.devices} CPU devices"
          f"{' emulating ' + ', '.join(emulate) if emulate else ''} ...", flush=True)
    return start_embedded_mesh(
        args.data_dir, devices=args.devices, emulate=emulate, inventory_listen=args.inventory_listen, echo=args.verbose
    )


def cmd_up(args) -> int:
    with _start(args) as mesh:
        print(f"inventory  {mesh.inventory.address}\ncompile    {mesh.compile.address}\nworker     {mesh.workers[0].address}")
        with open_channel(mesh.inventory.address) as channel:
            print(format_devices(list_all_devices(inventory_stub(channel))))
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
        with open_channel(mesh.inventory.address) as inv_channel, open_channel(mesh.compile.address) as compile_channel:
            inventory, compiler = inventory_stub(inv_channel), compile_stub(compile_channel)
            devices = list_all_devices(inventory)
            print(f"\n{len(devices)} devices in the inventory ({mesh.inventory.address}):\n")
            print(format_devices(devices))
            fresh = inventory.RefreshDevices(inv_pb.RefreshDevicesRequest(device_ids=[d.id for d in devices]))
            print(f"\nreal-time refresh: {len(fresh.devices)} devices re-sampled")
            for kind, name in ((inv_pb.TASK_KIND_TRAINING, "training"), (inv_pb.TASK_KIND_INFERENCE, "inference")):
                task = inv_pb.TaskProfile(kind=kind, precision="bf16")
                print(f"\nranking for {name} (bf16):")
                print(format_ranking(inventory.ScoreDevices(inv_pb.ScoreDevicesRequest(task=task))))
            rules = compiler.ListRules(compile_pb.ListRulesRequest())
            print(f"\ncompile rules ({rules.origin}):\n")
            print(format_rules(rules.rules))
            print("\ncompiling transformer_encoder for every device (one build per target type) ...", flush=True)
            built = compiler.Compile(compile_pb.CompileRequest(
                program="transformer_encoder", targets=fresh.devices, batch_sizes=[args.batch_size]))
            print(format_builds(built.builds))
    print("\nmesh stopped")
    return 0


def add_commands(sub) -> None:
    def mesh_flags(p):
        p.add_argument("--devices", type=int, default=4, help="split the CPU into N XLA devices (default 4)")
        p.add_argument("--emulate", default=None,
                       help=f"comma list of catalog types emulated on the CPU devices (default {','.join(DEFAULT_EMULATE)}; '' for none)")
        p.add_argument("--data-dir", default=DEFAULT_DATA_DIR, help="inventory database, artifact cache, uploads")
        p.add_argument("--inventory-listen", default="127.0.0.1:0")
        p.add_argument("--verbose", action="store_true", help="echo the services' logs")

    up = sub.add_parser("up", help="run inventory, compile and a worker on this machine until Ctrl-C")
    mesh_flags(up)
    up.set_defaults(func=cmd_up, inventory_listen=DEFAULT_INVENTORY)
    demo = sub.add_parser("demo", help="start the embedded mesh, show devices, rankings, rules and builds, stop")
    mesh_flags(demo)
    demo.add_argument("--batch-size", type=int, default=64, help="shard size to build executables for")
    demo.set_defaults(func=cmd_demo)
