"""`accelmesh plan`: where a model's layers would go on a set of devices, and what that costs.

Without --dispatch an embedded mesh is started whose one worker emulates exactly the devices
--devices names (and no CPU share), so the plan sees those devices and nothing else; it is
stopped afterwards. With --dispatch the plan is made against a running mesh's inventory, which
decides the devices: --devices is refused there and --filter narrows the pool instead.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import tempfile
import time
from pathlib import Path

import grpc
from google.protobuf import json_format

from accelmesh import errors
from accelmesh.cli.arguments import at_least
from accelmesh.cli.compile import DEFAULT_COMPILE, compile_stub
from accelmesh.cli.placement_plot import plot_placement
from accelmesh.cli.placement_view import render_placement
from accelmesh.common.v1 import common_pb2
from accelmesh.compile.v1 import compile_service_pb2 as compile_pb
from accelmesh.compile.v1 import program_pb2 as program_pb
from accelmesh.dispatch.v1 import dispatch_service_pb2 as pb
from accelmesh.dispatch.v1 import dispatch_service_pb2_grpc
from accelmesh.dispatch.v1 import job_pb2 as job_pb
from accelmesh.dispatch.v1 import plan_pb2 as plan_pb
from accelmesh.embedded import start_embedded_mesh
from accelmesh.hardware.catalog import resolve_type
from accelmesh.layer_table import check_layers, layer_cost_from_proto
from accelmesh.runtime.channels import open_channel
from accelmesh.runtime.tensors import numpy_dtype

STRATEGIES = {
    "ranked": plan_pb.PLACEMENT_STRATEGY_RANKED,
    "balanced": plan_pb.PLACEMENT_STRATEGY_BALANCED,
    "auto": plan_pb.PLACEMENT_STRATEGY_AUTO,
}
DEFAULT_DEVICES = "2xa100-80gb,2xv100-32gb"
# PlacementOptions: micro_batch_rows 0 means 8; the job's rows default to this many micro-batches.
DEFAULT_MICRO_BATCH_ROWS = 8
DEFAULT_MICRO_BATCHES = 4
# Each emulated device is one XLA CPU device of the worker; beyond this the worker is mostly overhead.
MAX_EMULATED_DEVICES = 64
EMULATED_NOTE = "emulated devices: catalog figures, nothing ran"
DEVICE_TERM = re.compile(r"(?P<count>\d+)x(?P<type>\S+)")


# --- arguments -------------------------------------------------------------------------------

def parse_devices(text: str) -> tuple[str, ...]:
    """`2xa100-80gb,1xt4` -> one canonical catalog type per device, in the order given."""
    types: list[str] = []
    for term in (t.strip() for t in text.split(",")):
        match = DEVICE_TERM.fullmatch(term)
        if match is None:
            raise argparse.ArgumentTypeError(
                f"{term!r} is not COUNTxTYPE; write e.g. 2xa100-80gb,1xt4")
        count = int(match["count"])
        if count < 1:
            raise argparse.ArgumentTypeError(f"{term!r}: the count must be at least 1")
        try:
            entry = resolve_type(match["type"])
        except errors.NotFound as exc:
            raise argparse.ArgumentTypeError(f"{term!r}: {exc}") from None
        types.extend([entry.type] * count)
    if len(types) > MAX_EMULATED_DEVICES:
        raise argparse.ArgumentTypeError(
            f"{len(types)} devices; the embedded mesh emulates at most {MAX_EMULATED_DEVICES}")
    return tuple(types)


def parse_headroom(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number; give a fraction such as 0.1") from None
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"{value:g} is outside [0, 1); it is the fraction of free memory kept unused")
    return value


def load_layer_table(path: str) -> list[plan_pb.LayerCost]:
    """A JSON list of LayerCost objects (proto field names or their camelCase JSON names)."""
    try:
        rows = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise errors.InvalidArgument(f"--layers {path}: {exc}") from None
    if not isinstance(rows, list) or not rows:
        raise errors.InvalidArgument(f"--layers {path}: expected a non-empty JSON list of layer objects")
    layers = []
    for i, row in enumerate(rows):
        try:
            layers.append(json_format.ParseDict(row, plan_pb.LayerCost()))
        except json_format.ParseError as exc:
            raise errors.InvalidArgument(f"--layers {path}: layer [{i}]: {exc}") from None
    # the dispatcher's own check, here, before a mesh is started to ask it
    check_layers([layer_cost_from_proto(x) for x in layers], where=f"--layers {path}")
    return layers


# --- the request -------------------------------------------------------------------------------

def job_rows(args) -> int:
    return args.rows or DEFAULT_MICRO_BATCHES * (args.micro_batch_rows or DEFAULT_MICRO_BATCH_ROWS)


def declared_inputs(program: program_pb.Program, rows: int) -> list[common_pb2.TensorHeader]:
    """The program's data inputs with `rows` on the batch axis; PlanJob reads only their headers."""
    headers = []
    for spec in program.inputs:
        shape = [rows, *spec.shape[1:]]
        total = math.prod(shape) * numpy_dtype(spec.dtype, f"{program.name} input {spec.name}").itemsize
        headers.append(common_pb2.TensorHeader(name=spec.name, dtype=spec.dtype, shape=shape, total_bytes=total))
    return headers


def plan_request(args, inputs: list[common_pb2.TensorHeader], layers: list[plan_pb.LayerCost]) -> pb.PlanJobRequest:
    placement = plan_pb.PlacementOptions(strategy=STRATEGIES[args.strategy], device_count=args.device_count,
                                         micro_batch_rows=args.micro_batch_rows, layers=layers)
    if args.headroom is not None:
        placement.memory_headroom = args.headroom
    spec = job_pb.JobSpec(program=args.model, inputs=inputs, placement=placement,
                          constraints=job_pb.JobConstraints(filter=args.filter))
    if args.kind == "training":
        # JobSpec requires training options for a training job; a plan reads only the kind and rows.
        spec.kind = job_pb.JOB_KIND_TRAINING
        spec.training.CopyFrom(job_pb.TrainingOptions(epochs=1, batch_size=job_rows(args), learning_rate=0.1))
    else:
        spec.kind = job_pb.JOB_KIND_INFERENCE
    return pb.PlanJobRequest(spec=spec)


def request_placement(args, layers: list[plan_pb.LayerCost], dispatch: str, compile_address: str) -> plan_pb.Placement:
    inputs = []
    if not layers:
        progress(f"describing {args.model} ...")
        with open_channel(compile_address) as channel:
            program = compile_stub(channel).DescribeProgram(compile_pb.DescribeProgramRequest(name=args.model)).program
        inputs = declared_inputs(program, job_rows(args))
    progress(f"planning {args.model} ({args.strategy}) ...")
    with open_channel(dispatch) as channel:
        plan = dispatch_service_pb2_grpc.DispatchServiceStub(channel).PlanJob(plan_request(args, inputs, layers)).plan
    if not plan.HasField("placement"):
        raise errors.FailedPrecondition(
            f"the dispatch service at {dispatch} answered with a data-parallel plan, not a placement; "
            f"it predates model-parallel planning (PlanJob with spec.placement): upgrade it")
    return plan.placement


# --- the command ---------------------------------------------------------------------------------

def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _summarise(types: tuple[str, ...]) -> str:
    counts: dict[str, int] = {}
    for t in types:
        counts[t] = counts.get(t, 0) + 1
    return ", ".join(f"{n}x {t}" for t, n in counts.items())


def cmd_plan(args) -> int:
    if args.dispatch and args.devices is not None:
        raise errors.InvalidArgument(
            "--devices describes the devices of the embedded mesh; with --dispatch the running mesh's inventory "
            "decides, narrow it with --filter")
    if args.layers and args.rows:
        raise errors.InvalidArgument("--rows sizes a registered program's inputs; a --layers table has none")
    if args.plot and not Path(args.plot).resolve().parent.is_dir():
        raise errors.InvalidArgument(f"--plot {args.plot}: the folder {Path(args.plot).parent} does not exist")
    layers = load_layer_table(args.layers) if args.layers else []  # read before a mesh is started for nothing
    note = ""
    if args.dispatch:
        placement = request_placement(args, layers, args.dispatch, args.compile)
    else:
        note = EMULATED_NOTE
        types = args.devices or parse_devices(DEFAULT_DEVICES)
        started = time.perf_counter()
        progress(f"starting an embedded mesh with {len(types)} emulated device(s): {_summarise(types)} ...")
        with (tempfile.TemporaryDirectory(prefix="accelmesh-plan-") as data_dir,
              # exactly the devices asked for: a GPU of this machine would join the pool otherwise
              start_embedded_mesh(data_dir, devices=len(types), emulate=types, nvml=False) as mesh):
            progress(f"mesh up in {time.perf_counter() - started:.1f} s")
            try:
                placement = request_placement(args, layers, mesh.dispatch.address, mesh.compile.address)
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                    raise
                raise errors.ResourceExhausted(
                    f"RESOURCE_EXHAUSTED: {exc.details()}; add devices to --devices or lower --headroom") from None
            progress("stopping the mesh ...")
    print(render_placement(placement, args.model, explain=args.explain, note=note))
    if args.plot:
        plot_placement(placement, args.plot, model=args.model, note=note)
        progress(f"wrote {args.plot}")
    return 0


def add_commands(sub) -> None:
    plan = sub.add_parser(
        "plan", help="place a model's layers on devices (pipeline) and predict the step time, without running it",
        description="Place a model's layers on devices and print where each goes, each device's memory and time, "
                    "the strategies compared and the predicted step time against its lower bound.")
    plan.add_argument("model", help="registered program (e.g. gpt2_xl); with --layers only a label")
    plan.add_argument("--devices", type=parse_devices, default=None, metavar="NxTYPE,...",
                      help=f"catalog types the embedded mesh emulates (default {DEFAULT_DEVICES}); "
                           "not with --dispatch")
    plan.add_argument("--strategy", choices=tuple(STRATEGIES), default="auto",
                      help="ranked (largest layers to the best device), balanced (contiguous stages), "
                           "auto (predict both, take the faster; default)")
    plan.add_argument("--kind", choices=("inference", "training"), default="inference",
                      help="training also holds gradients and optimizer state and runs the backward pass")
    plan.add_argument("--micro-batch-rows", type=at_least(0), default=0, metavar="N",
                      help=f"rows per micro-batch (default {DEFAULT_MICRO_BATCH_ROWS})")
    plan.add_argument("--rows", type=at_least(1), default=0, metavar="N",
                      help=f"rows of the job's inputs (default {DEFAULT_MICRO_BATCHES} micro-batches)")
    plan.add_argument("--device-count", type=at_least(0), default=0, metavar="N",
                      help="the most devices to use (default: every device offered; auto and balanced take as many "
                      "as lower the predicted step, ranked the fewest whose memory holds the model)")
    plan.add_argument("--headroom", type=parse_headroom, default=None, metavar="F",
                      help="fraction of each device's free memory left unused, in [0, 1) (default 0.1)")
    plan.add_argument("--layers", metavar="FILE.json", help="plan this layer table (a JSON list of LayerCost "
                      "objects) instead of the registered program's")
    plan.add_argument("--filter", default="", help='inventory filter on the devices, e.g. platform = "cuda"')
    plan.add_argument("--explain", action="store_true", help="also print every step of the placement")
    plan.add_argument("--plot", metavar="PLAN.png", help="also draw per-device memory and time to this PNG")
    plan.add_argument("--dispatch", metavar="HOST:PORT",
                      help="plan against this running mesh instead of an embedded one")
    plan.add_argument("--compile", default=DEFAULT_COMPILE, metavar="HOST:PORT",
                      help="with --dispatch: the compile service that describes the program")
    plan.set_defaults(func=cmd_plan)
