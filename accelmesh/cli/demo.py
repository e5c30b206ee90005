"""`accelmesh demo`: the embedded mesh on this machine running real jobs across mixed devices.

(a) batch inference of the transformer encoder over a few thousand inputs, checked against a
single-device fp32 run, its shards sized by costs measured on small jobs first (every shard's
predicted and measured seconds, every device's, and the job's makespan shown); (b)
data-parallel training of the MLP on the shipped digits data, checked by test accuracy; (c) the
transformer's layers placed on three devices of two types and run as a pipeline, checked
against the single-device run, then GPT-2 XL planned on the same devices. Every shard's device,
rule and time is shown.
"""

from __future__ import annotations

import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from accelmesh.cli.inventory import inventory_stub, list_all_devices
from accelmesh.cli.job_view import bytes_path
from accelmesh.cli.tables import format_devices, table
from accelmesh.client import MeshClient
from accelmesh.datasets import load_digits, train_test_split
from accelmesh.dispatch.v1 import job_pb2 as job_pb
from accelmesh.dispatch.v1 import plan_pb2 as plan_pb
from accelmesh.reference import reference_outputs
from accelmesh.runtime.channels import open_channel
from accelmesh.security.config import Security

BAR_WIDTH = 30
# What the big inference job's plan should meet: its predicted makespan within this fraction of
# the measured one, and no device's shards taking more than this many times another device's.
MAKESPAN_TOLERANCE = 0.25
DEVICE_SPREAD = 1.5


class Progress:
    """One progress bar on a terminal; a line per tenth elsewhere (logs, CI)."""

    def __init__(self, label: str):
        self.label = label
        self.tty = sys.stdout.isatty()
        self._last_tenth = -1

    def update(self, fraction: float, note: str = "") -> None:
        fraction = min(1.0, max(0.0, fraction))
        if self.tty:
            filled = int(fraction * BAR_WIDTH)
            print(f"\r{self.label} [{'#' * filled}{'.' * (BAR_WIDTH - filled)}] {fraction:5.1%} {note:<30}",
                  end="", flush=True)
        elif int(fraction * 10) > self._last_tenth:
            self._last_tenth = int(fraction * 10)
            print(f"{self.label} {fraction:5.1%} {note}", flush=True)

    def close(self) -> None:
        if self.tty:
            print()


def print_plan(plan: plan_pb.Plan) -> None:
    rows = [("TARGET TYPE", "RULE", "DTYPE", "ARTIFACT", "DEVICES", "FIXED ms", "ROWS/S", "FIT", "FROM")]
    for t in plan.targets:
        fit = f"{t.rate_samples} shards, +-{t.residual_seconds * 1e3:.0f} ms" if t.rate_samples else "-"
        rows.append((t.target_type, t.rule, t.compute_dtype, t.artifact_key[:12], ",".join(t.device_ids),
                     f"{t.fixed_seconds * 1e3:.1f}", f"{t.rows_per_second:,.0f}", fit, t.rate_source))
    print(table(rows))
    print(f"{len(plan.shards)} shards; predicted {plan.predicted_seconds:.3f} s "
          f"(equal shards: {plan.equal_split_predicted_seconds:.3f} s)")


def print_shards(job: job_pb.Job, limit: int = 12) -> None:
    """Each shard's times; OWN is its total less its wait behind the device's previous shard,
    the time PRED predicts."""
    rows = [("SHARD", "DEVICE", "RULE", "ROWS", "ATTEMPTS", "LOAD ms", "EXEC ms", "TOTAL ms", "OWN ms", "PRED ms")]
    for s in list(job.shards)[:limit]:
        rows.append((str(s.index), s.device_id, s.rule, str(s.rows), str(s.attempts), f"{s.load_seconds * 1e3:.1f}",
                     f"{s.execute_seconds * 1e3:.1f}", f"{s.total_seconds * 1e3:.1f}",
                     f"{(s.total_seconds - s.queue_seconds) * 1e3:.1f}", f"{s.predicted_seconds * 1e3:.1f}"))
    print(table(rows))
    if len(job.shards) > limit:
        print(f"... and {len(job.shards) - limit} more shards")


def device_seconds(job: job_pb.Job) -> dict[str, tuple[int, float, float]]:
    """Per device: rows, predicted and measured seconds of its shards (run one after another)."""
    totals: dict[str, tuple[int, float, float]] = {}
    for s in job.shards:
        rows, predicted, measured = totals.get(s.device_id, (0, 0.0, 0.0))
        totals[s.device_id] = (rows + s.rows, predicted + s.predicted_seconds,
                               measured + s.total_seconds - s.queue_seconds)
    return totals


def print_makespan(job: job_pb.Job) -> tuple[float, float]:
    """Per device and for the job, predicted against measured seconds; returns the makespan's
    relative error and the slowest device's time over the fastest's."""
    totals = device_seconds(job)
    rows = [("DEVICE", "ROWS", "PREDICTED s", "MEASURED s")]
    rows += [(d, str(n), f"{p:.3f}", f"{t:.3f}") for d, (n, p, t) in totals.items()]
    print(table(rows))
    predicted, measured = job.plan.predicted_seconds, job.measured_seconds
    error = abs(predicted - measured) / measured if measured > 0 else float("inf")
    times = [t for _, _, t in totals.values()]
    spread = max(times) / min(times) if times and min(times) > 0 else float("inf")
    print(f"makespan: predicted {predicted:.3f} s, measured {measured:.3f} s ({error:.0%} off); "
          f"slowest device {spread:.2f}x the fastest")
    return error, spread


def inference_demo(client: MeshClient, compile_address: str, samples: int, security: Security,
                   device_types: list[str]) -> float:
    tokens = np.random.default_rng(0).integers(0, 512, size=(samples, 32), dtype=np.int32)
    # One job per device type, all at once: across types the catalog would give a V100 (15.7
    # TFLOP/s fp32) no rows next to an A100 (312 bf16), and these emulated devices share the CPU,
    # so they are measured while all of them run, as in the big job. Each device's shard is as
    # large as its share of the big job (the types have as many devices each): on a shared CPU a
    # row costs more in a large shard than in a small one (measured here: 4.3 ms a row in shards
    # of 128 rows, 7.6 ms in shards of 1,024, all four devices busy), which a cost of a fixed
    # part plus one per row cannot carry from one size to the other.
    calibration = tokens[: max(8, samples // max(1, len(device_types)))]
    print(f"\n(a) inference: transformer_encoder, first a {len(calibration)}-sequence job on each device type at "
          f"once, twice (a device's first run of an executable is not measured), planned from catalog peak "
          f"rates; their shards' measured costs (a fixed part per shard plus one per row) then plan the "
          f"{samples}-sequence job")
    with ThreadPoolExecutor(len(device_types)) as pool:
        for _ in range(2):  # the first run of an executable on a device is not fitted (one-time costs)
            firsts = list(pool.map(lambda t: client.run("transformer_encoder", {"tokens": calibration},
                                                        parameter_seed=0, filter=f'type = "{t}"'), device_types))
    for first in firsts:
        print_plan(first.job.plan)
        print_shards(first.job)
    print(f"\n    {samples} sequences, planned from measured costs:")
    bar = Progress("    shards")

    def on_event(event: job_pb.JobEvent) -> None:
        if event.type == job_pb.JOB_EVENT_TYPE_PLANNED:
            print_plan(event.plan)
        elif event.type in (job_pb.JOB_EVENT_TYPE_SHARD_FINISHED, job_pb.JOB_EVENT_TYPE_SHARD_RETRIED):
            bar.update(event.progress, event.message)

    started = time.perf_counter()
    result = client.run("transformer_encoder", {"tokens": tokens}, on_event=on_event, parameter_seed=0,
                        data_path="direct")
    bar.close()
    wall = time.perf_counter() - started
    print_shards(result.job)
    print(f"    {bytes_path(result)}")
    error, spread = print_makespan(result.job)
    print(f"    predicted makespan {'within' if error <= MAKESPAN_TOLERANCE else 'OUTSIDE'} "
          f"{MAKESPAN_TOLERANCE:.0%} of the measured; devices {'within' if spread <= DEVICE_SPREAD else 'OUTSIDE'} "
          f"{DEVICE_SPREAD}x of one another")
    (reference,) = reference_outputs(compile_address, "transformer_encoder", [tokens], parameter_seed=0,
                                     security=security)
    error = float(np.max(np.abs(result.outputs["logits"] - reference)) / np.max(np.abs(reference)))
    tolerance = max(0.05, 1e-5)  # the loosest rule in the plan (bf16) allows 5e-2
    verdict = "within" if error <= tolerance else "OUTSIDE"
    print(f"combined logits {result.outputs['logits'].shape} in {wall:.2f} s; max relative error against a "
          f"single-device fp32 run: {error:.2e} ({verdict} the bf16 tolerance {tolerance:g})")
    return error


def training_demo(client: MeshClient, epochs: int) -> float:
    x, y = load_digits()
    split = train_test_split(x, y, test_fraction=0.2, seed=0)
    options = job_pb.TrainingOptions(epochs=epochs, batch_size=128, learning_rate=0.1, momentum=0.9, shuffle_seed=0)
    print(f"\n(b) training: mlp_train_step on {len(split.y_train)} digits, {epochs} epochs, data-parallel")
    bar = Progress("    steps")

    def on_event(event: job_pb.JobEvent) -> None:
        if event.type == job_pb.JOB_EVENT_TYPE_PLANNED:
            print_plan(event.plan)
        elif event.type == job_pb.JOB_EVENT_TYPE_TRAINING_STEP:
            bar.update(event.progress, f"step {event.step} loss {event.loss:.3f}")

    started = time.perf_counter()
    trained = client.run("mlp_train_step", {"x": split.x_train, "y": split.y_train}, training=options,
                         on_event=on_event, parameter_seed=0)
    bar.close()
    print(f"    {bytes_path(trained)}")
    losses = trained.job.losses
    print(f"{len(losses)} steps in {time.perf_counter() - started:.2f} s; loss {losses[0]:.3f} -> {losses[-1]:.3f}; "
          f"a step predicted {trained.job.plan.predicted_seconds * 1e3:.1f} ms, measured "
          f"{trained.job.measured_seconds * 1e3:.1f} ms (mean)")
    parameters = [(name, value) for name, value in trained.outputs.items() if name != "losses"]
    evaluated = client.run("mlp_classifier", {"x": split.x_test}, parameters=parameters, data_path="direct")
    accuracy = float(np.mean(np.argmax(evaluated.outputs["logits"], axis=1) == split.y_test))
    print(f"test accuracy on {len(split.y_test)} held-out digits: {accuracy:.1%} ({bytes_path(evaluated)})")
    return accuracy


def pipeline_demo(client: MeshClient, compile_address: str, samples: int, security: Security) -> float:
    from accelmesh.cli.placement_view import format_candidates, format_device_table, format_layer_table, format_summary

    tokens = np.random.default_rng(1).integers(0, 512, size=(samples, 32), dtype=np.int32)
    options = plan_pb.PlacementOptions(strategy=plan_pb.PLACEMENT_STRATEGY_AUTO, device_count=3, micro_batch_rows=16)
    print(f"\n(c) model-parallel: transformer_encoder's layers placed on 3 devices (ranked and balanced "
          f"predicted, the faster taken), {samples} sequences in micro-batches of 16 through the pipeline")
    bar = Progress("    micro-batches")

    def on_event(event: job_pb.JobEvent) -> None:
        if event.type == job_pb.JOB_EVENT_TYPE_SHARD_FINISHED:
            bar.update(event.progress, event.message)

    started = time.perf_counter()
    result = client.run("transformer_encoder", {"tokens": tokens}, placement=options, on_event=on_event,
                        parameter_seed=0)
    bar.close()
    print(f"    {bytes_path(result)}; a pipeline's activations pass the dispatcher too, for now")
    placement = result.job.plan.placement
    print(format_layer_table(placement))
    print(format_device_table(placement))
    print(format_candidates(placement))
    print(format_summary(placement))
    job = result.job
    calibrated = any(line.startswith("calibrated") for line in placement.explain)
    print(f"pipeline run: predicted {job.plan.predicted_seconds * 1e3:.3g} ms, measured "
          f"{job.measured_seconds * 1e3:.4g} ms (first stage call to the last outputs)"
          + ("" if calibrated else "; predicted at the catalog speed of the devices these emulate, which the "
             "stage calls just measured calibrate for the next plans"))
    (reference,) = reference_outputs(compile_address, "transformer_encoder", [tokens], parameter_seed=0,
                                     security=security)
    error = float(np.max(np.abs(result.outputs["logits"] - reference)) / np.max(np.abs(reference)))
    rules = ", ".join(f"stage {s.index}: {s.rule}" for s in placement.stages)
    print(f"pipeline of {len(placement.stages)} stages ({rules}) in {time.perf_counter() - started:.2f} s; max "
          f"relative error against a single-device fp32 run: {error:.2e}")
    plan = client.plan("gpt2_xl", {"tokens": np.zeros((32, 1024), np.int32)}, placement=plan_pb.PlacementOptions(
        strategy=plan_pb.PLACEMENT_STRATEGY_AUTO, device_count=4)).placement
    total = sum(layer.parameter_count for layer in plan.layers)
    calibrated = any(line.startswith("calibrated") for line in plan.explain)
    print(f"\n    gpt2_xl ({total / 1e9:.2f} billion parameters, {len(plan.layers)} layers) planned on the same "
          f"devices (planning only; its weights never exist here"
          + ("; priced at the speed these emulated devices showed in the pipeline above" if calibrated else "")
          + "):")
    print(format_candidates(plan))
    print(format_summary(plan))
    return error


def run_demo(mesh, *, samples: int, epochs: int) -> int:
    with open_channel(mesh.inventory.address, security=mesh.client) as channel:
        devices = list_all_devices(inventory_stub(channel))
    print(f"\n{len(devices)} devices in the inventory:\n")
    print(format_devices(devices))
    with MeshClient(mesh.dispatch.address, security=mesh.client) as client:
        error = inference_demo(client, mesh.compile.address, samples, mesh.client,
                               sorted({d.type for d in devices}))
        accuracy = training_demo(client, epochs)
        pipeline_error = pipeline_demo(client, mesh.compile.address, max(64, samples // 8), mesh.client)
    ok = error <= 0.05 and accuracy >= 0.9 and pipeline_error <= 0.05
    print(f"\ndemo {'passed' if ok else 'FAILED'}: inference error {error:.2e}, test accuracy {accuracy:.1%}, "
          f"pipeline error {pipeline_error:.2e}")
    return 0 if ok else 1
