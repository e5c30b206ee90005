"""`accelmesh programs`, `accelmesh rules`, `accelmesh compile`: talk to the compile service."""

from __future__ import annotations

from accelmesh import errors
from accelmesh.cli.inventory import DEFAULT_INVENTORY, inventory_stub, list_all_devices
from accelmesh.cli.tables import format_builds, format_programs, format_rules
from accelmesh.compile.v1 import compile_service_pb2 as pb
from accelmesh.compile.v1 import compile_service_pb2_grpc
from accelmesh.hardware.catalog import resolve_type
from accelmesh.runtime.channels import open_channel
from accelmesh.runtime.devices import device_to_proto

DEFAULT_COMPILE = "127.0.0.1:50061"


def compile_stub(channel) -> compile_service_pb2_grpc.CompileServiceStub:
    return compile_service_pb2_grpc.CompileServiceStub(channel)


def inventory_cpus(inventory: str) -> list:
    """The CPU devices the inventory lists, as their workers describe them."""
    with open_channel(inventory) as channel:
        cpus = list_all_devices(inventory_stub(channel), 'platform = "cpu"')
    if not cpus:
        raise errors.FailedPrecondition(f"--target cpu: the inventory at {inventory} lists no CPU device; start a "
                                        "worker (accelmesh up) or pass --inventory, or name catalog types instead")
    return cpus


def target_devices(names: list[str], emulated: bool, inventory: str) -> list:
    """Catalog types (`a100-80gb`, ...) or `cpu` (the inventory's CPU devices); emulated ones run on a CPU."""
    targets = []
    for i, name in enumerate(names):
        if name == "cpu":
            targets.extend(inventory_cpus(inventory))
        else:
            spec = resolve_type(name).device_spec("127.0.0.1", i, emulated_on=f"cpu:{i}" if emulated else "")
            targets.append(device_to_proto(spec))
    return targets


def cmd_programs(args) -> int:
    with open_channel(args.compile) as channel:
        print(format_programs(compile_stub(channel).ListPrograms(pb.ListProgramsRequest()).programs))
    return 0


def cmd_rules(args) -> int:
    with open_channel(args.compile) as channel:
        response = compile_stub(channel).ListRules(pb.ListRulesRequest())
    print(f"rules from {response.origin} (first match wins)\n")
    print(format_rules(response.rules))
    return 0


def cmd_compile(args) -> int:
    if args.from_inventory:
        with open_channel(args.inventory) as channel:
            targets = list_all_devices(inventory_stub(channel), args.filter)
    elif args.target:
        targets = target_devices(args.target, args.emulated, args.inventory)
    else:
        raise errors.InvalidArgument("name targets with --target TYPE (repeatable) or use --from-inventory")
    with open_channel(args.compile) as channel:
        response = compile_stub(channel).Compile(pb.CompileRequest(
            program=args.program, version=args.version, targets=targets, batch_sizes=args.batch_size or []))
    print(f"{response.program}@{response.version} for {len(targets)} device(s), "
          f"{len(response.builds)} target type(s):\n")
    print(format_builds(response.builds))
    return 0


def add_commands(sub) -> None:
    programs = sub.add_parser("programs", help="list the registered programs")
    programs.add_argument("--compile", default=DEFAULT_COMPILE, help="compile service address")
    programs.set_defaults(func=cmd_programs)
    rules = sub.add_parser("rules", help="list the compile rules in the order they are tried")
    rules.add_argument("--compile", default=DEFAULT_COMPILE)
    rules.set_defaults(func=cmd_rules)
    build = sub.add_parser("compile", help="build a program for target devices, one artifact per target type")
    build.add_argument("program")
    build.add_argument("--version", default="")
    build.add_argument("--target", action="append",
                       help="catalog type (a100-80gb, tpu-v4, ...) or 'cpu' (the inventory's CPU devices); repeatable")
    build.add_argument("--emulated", action="store_true", help="targets are emulated on this machine's CPU")
    build.add_argument("--from-inventory", action="store_true", help="build for every device the inventory lists")
    build.add_argument("--inventory", default=DEFAULT_INVENTORY)
    build.add_argument("--filter", default="", help="with --from-inventory: which devices")
    build.add_argument("--batch-size", type=int, action="append", help="also build executables for this batch size")
    build.add_argument("--compile", default=DEFAULT_COMPILE)
    build.set_defaults(func=cmd_compile)


