"""`accelmesh up` and `accelmesh demo`: the embedded mesh on this machine."""

from __future__ import annotations

import signal
import sys
import time

from accelmesh.cli.compile import DEFAULT_COMPILE
from accelmesh.cli.inventory import DEFAULT_INVENTORY, inventory_stub, list_all_devices
from accelmesh.cli.tables import format_devices
from accelmesh.embedded import DEFAULT_DATA_DIR, DEFAULT_EMULATE, EmbeddedMesh, start_embedded_mesh
from accelmesh.runtime.channels import open_channel
from accelmesh.runtime.stopping import StopGuard

DEFAULT_DISPATCH = "127.0.0.1:50071"


def _start(args) -> EmbeddedMesh:
    emulate = tuple(p for p in args.emulate.split(",") if p) if args.emulate is not None else DEFAULT_EMULATE
    print(f"starting the mesh: inventory, compile, dispatch and one worker with {args.devices} CPU devices"
          f"{' emulating ' + ', '.join(emulate) if emulate else ''} ...", flush=True)
    return start_embedded_mesh(
        args.data_dir, devices=args.devices, emulate=emulate, inventory_listen=args.inventory_listen,
        compile_listen=args.compile_listen, dispatch_listen=args.dispatch_listen, echo=args.verbose,
        insecure=args.insecure, advertise=args.advertise,
    )


def cmd_up(args) -> int:
    """Serve until a signal (exit 0, every child stopped), or until a child exits on its own (the
    rest are stopped, exit 1: half a mesh would only fail later and further from the cause)."""
    # Before the first child starts: a signal at any moment of start-up stops every child begun.
    with StopGuard() as guard:
        mesh = _start(args)
        print(f"inventory  {mesh.inventory.address}\ncompile    {mesh.compile.address}\n"
              f"dispatch   {mesh.dispatch.address}\nworker     {mesh.workers[0].address}")
        if mesh.credentials is not None:
            print(f"credentials {mesh.credentials.folder}: ca.crt, client.crt, client.key and token (an operator's); "
                  f"the other commands find them there (or set ACCELMESH_CA_FILE, _CERT_FILE, _KEY_FILE, _TOKEN_FILE)")
        else:
            print("INSECURE: plaintext, no authentication; run the other commands with ACCELMESH_INSECURE=1")
        with open_channel(mesh.inventory.address, security=mesh.client) as channel:
            print(format_devices(list_all_devices(inventory_stub(channel))))
        print("mesh is up; Ctrl-C stops it", flush=True)
        ended = guard.children.wait_for_exit()
        # The launcher has logged its exit code and last output; leaving the guard stops the rest.
        print(f"accelmesh: {ended.name} {ended.exit_status()}: stopping the rest of the mesh",
              file=sys.stderr, flush=True)
        return 1
    print(f"accelmesh: {signal.Signals(guard.signum).name}: mesh stopped", file=sys.stderr, flush=True)
    return 0


def cmd_demo(args) -> int:
    from accelmesh.cli.demo import run_demo

    started = time.perf_counter()
    with _start(args) as mesh:
        code = run_demo(mesh, samples=args.samples, epochs=args.epochs)
    print(f"mesh stopped; demo took {time.perf_counter() - started:.1f} s")
    return code


def add_commands(sub) -> None:
    def mesh_flags(p):
        p.add_argument("--devices", type=int, default=4, help="split the CPU into N XLA devices (default 4)")
        p.add_argument("--emulate", default=None,
                       help="comma list of catalog types emulated on the CPU devices "
                            f"(default {','.join(DEFAULT_EMULATE)}; '' for none)")
        p.add_argument("--data-dir", default=DEFAULT_DATA_DIR, help="inventory database, artifact cache, uploads")
        p.add_argument("--inventory-listen", default="127.0.0.1:0")
        p.add_argument("--compile-listen", default="127.0.0.1:0")
        p.add_argument("--dispatch-listen", default="127.0.0.1:0")
        p.add_argument("--advertise", action="append", default=[], metavar="HOST",
                       help="a DNS name or IP clients reach the services at, named in their certificates besides "
                            "the hosts of the --*-listen addresses (for 0.0.0.0 or ::, this machine's name and "
                            "addresses); repeat for several")
        p.add_argument("--verbose", action="store_true", help="echo the services' logs")
        p.add_argument("--insecure", action="store_true",
                       help="plaintext without certificates or tokens (development only; every port is loopback)")

    up = sub.add_parser("up", help="run inventory, compile, dispatch and a worker on this machine until Ctrl-C or "
                                   "SIGTERM (or until one of them exits: then the rest stop too, exit 1)")
    mesh_flags(up)
    # `up` serves on the well-known ports, so the other commands' defaults find it.
    up.set_defaults(func=cmd_up, inventory_listen=DEFAULT_INVENTORY, compile_listen=DEFAULT_COMPILE,
                    dispatch_listen=DEFAULT_DISPATCH)
    demo = sub.add_parser(
        "demo", help="start the embedded mesh, run an inference and a training job across its devices, stop")
    mesh_flags(demo)
    demo.add_argument("--samples", type=int, default=4096, help="sequences for the inference job")
    demo.add_argument("--epochs", type=int, default=10, help="epochs of the training job")
    demo.set_defaults(func=cmd_demo)
