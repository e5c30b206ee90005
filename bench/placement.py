"""Placement benchmark: how close each layer-placement strategy gets to the lower bound, and what planning costs.

    .venv/bin/python bench/placement.py [--quick]

Prints one JSON document on stdout (progress on stderr).

(a) Plan quality: every shipped model's layer table (the compile service's registry) on three
    device mixes: 2x a100-80gb + 2x v100-32gb + 1x t4; 4x h100-sxm-80gb + 4x l4; and a sample of
    the Alibaba PAI cluster (../shared/data/pai_machine_spec.csv, loaded as bench/planning.py
    does) with the cluster's type proportions. For inference and training, micro-batches of
    MICRO_BATCH_ROWS rows, and two device counts (the mix size; unset), five placements
    computed in the same run: place (auto, the default), place_ranked, place_balanced and the two baselines,
    sequential_fill (devices in listed order, as big-model loaders fill them) and parameter_split
    (equal parameter counts over as many devices as balanced uses). Each predicted step time is
    a ratio to lower_bound_seconds over every device of the mix (>= 1; lower is better).
(b) Planning cost: a 100-layer decoder (GPT-2 XL's own rows, its blocks repeated) over 1,000
    devices (a PAI-like pool and a catalog pool), against the goal of under PLANNING_GOAL_S per
    call, with the device count derived from memory and with PLANNING_WIDE_COUNT devices asked
    for. The baseline from the same run is sequential_fill on the same model and devices.
(c) Predicted against measured: transformer_encoder placed (balanced) and run as a pipeline on
    the embedded mesh, real processes on this machine, three times per device set: three
    emulated devices (2x a100-80gb + v100-32gb), whose catalog figures are an A100's and a
    V100's while the work runs on this CPU, and three of this machine's own CPU devices. The
    first run is planned from the catalog alone (its predictions are reported as
    `catalog_run`); its stage calls calibrate the dispatcher (dispatch_svc/planner/
    calibration.py), the second is planned calibrated (and compiles the stages it cuts anew);
    the third, planned calibrated with its stages built, is measured. Per stage: the predicted
    seconds per micro-batch (compute and the stage call's overhead) against the median stage
    call as the dispatcher saw it; per job: the predicted seconds against the pipeline's run
    (Job.measured_seconds, first stage call to the last outputs), and its wall time, end_time -
    create_time (planning and any stage builds included). --no-run skips it.
(a) and (b) come from one cost model (placement.py's), so the ratios compare strategies under
that model; they are predictions, not measurements of real devices; (c) says how far those
predictions are from what runs here.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import re
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import replace
from functools import partial
from pathlib import Path

import numpy as np
from common import geomean, progress, ratio, synthetic_node_ip
from planning import PAI_CSV, PAI_TYPES, pai_devices

import dispatch_svc.planner
from accelmesh.hardware.catalog import load_catalog, resolve_type
from accelmesh.hardware.model import DeviceSpec
from compile_svc.programs.registry import ProgramRegistry, default_registry
from compile_svc.rules import RuleTable, load_rules
from dispatch_svc.planner.placement import (
    BANDWIDTH_EFFICIENCY,
    INFERENCE,
    TRAINING,
    Device,
    Evaluation,
    LayerCost,
    Model,
    NoRoom,
    Placement,
    Task,
    capacity,
    check_layers,
    initial_scores,
    lower_bound_seconds,
    parameter_split,
    place,
    place_balanced,
    place_ranked,
    required_devices,
    sequential_fill,
)
from dispatch_svc.planner.throughput import CATALOG_EFFICIENCY

MODELS = ("transformer_encoder", "gpt2_xl", "bert_large", "llama_7b", "vit_l16")
CATALOG_MIXES = {
    "a100x2_v100x2_t4": (("a100-80gb", 2), ("v100-32gb", 2), ("t4", 1)),
    "h100x4_l4x4": (("h100-sxm-80gb", 4), ("l4", 4)),
}
PAI_MIX = "pai_sample_16"
PAI_SAMPLE_DEVICES = 16
MICRO_BATCH_ROWS = 8
KINDS = (INFERENCE, TRAINING)
MIX_SIZE, MEMORY_DERIVED = "mix_size", "count_unset"
STRATEGIES = ("auto", "ranked", "balanced", "sequential_fill", "parameter_split")
DEFAULT_STRATEGY = "auto"  # what a placed job gets (PlacementStrategy AUTO): the faster of ranked and balanced
GOAL_GEOMEAN = 1.05  # the default strategy's geometric-mean ratio to the lower bound over every device offered

PLANNING_DEVICES = 1_000
PLANNING_BLOCKS = 98  # + embedding + tied head = 100 layers
PLANNING_BASE_MODEL = "gpt2_xl"
PLANNING_GOAL_S = 1.0
# A second, larger device count: up to one device per layer, so the search has many stages to try.
PLANNING_WIDE_COUNT = 100
RUNS = {"full": 5, "quick": 2}


# -- devices ----------------------------------------------------------------------------------


def placement_device(spec: DeviceSpec, target_type: str, dtype: str) -> Device:
    """A free device as placement sees it: the peak rate at the dtype its compile rule builds in."""
    perf = spec.performance
    return Device(spec.id, target_type, perf.rate_tflops(dtype), perf.memory_bytes, perf.memory_bandwidth_gbps,
                  perf.interconnect_bandwidth_gbps)


def catalog_mix(rules: RuleTable, counts: Sequence[tuple[str, int]]) -> tuple[list[Device], dict[str, str]]:
    """Devices in the listed order, one node per type; and the rule's dtype of each type."""
    devices, dtypes = [], {}
    for node, (catalog_type, count) in enumerate(counts):
        entry = resolve_type(catalog_type)
        for local in range(count):
            spec = entry.device_spec(synthetic_node_ip(node), local)
            rule = rules.match(spec)
            dtypes[spec.type] = f"{rule.build.compute_dtype} (rule {rule.name})"
            devices.append(placement_device(spec, rules.target_type(spec).key, rule.build.compute_dtype))
    return devices, dtypes


def apportion(counts: Counter, total: int) -> dict[str, int]:
    """`total` split over the keys in proportion to `counts` (largest remainder, ties by name)."""
    whole = sum(counts.values())
    quotas = {k: total * v / whole for k, v in counts.items()}
    shares = {k: int(q) for k, q in quotas.items()}
    for k in sorted(quotas, key=lambda k: (-(quotas[k] - shares[k]), k))[:total - sum(shares.values())]:
        shares[k] += 1
    return shares


def pai_sample(pai: list[tuple[DeviceSpec, str, str]], types: Counter, size: int) -> tuple[list[Device], dict]:
    """`size` devices with the cluster's type proportions: the first of each type in CSV order."""
    wanted = apportion(types, size)
    taken: Counter = Counter()
    devices = []
    for spec, key, dtype in pai:  # CSV order is the listed order sequential_fill and parameter_split use
        if taken[spec.type] < wanted[spec.type]:
            taken[spec.type] += 1
            devices.append(placement_device(spec, key, dtype))
    dtypes = {}
    for spec, _, dtype in pai:
        dtypes.setdefault(spec.type, dtype)
    return devices, {"devices_by_type": dict(sorted(wanted.items())), "rule_dtypes": dict(sorted(dtypes.items()))}


def listed_order(devices: Sequence[Device]) -> list[str]:
    """The mix's target types in listed order, runs collapsed: ["cuda:a100-80gb[bf16] x2", ...]."""
    runs: list[list] = []
    for d in devices:
        name = d.target_type
        if runs and runs[-1][0] == name:
            runs[-1][1] += 1
        else:
            runs.append([name, 1])
    return [f"{name} x{n}" for name, n in runs]


# -- layer tables -----------------------------------------------------------------------------


def layer_table(registry: ProgramRegistry, name: str) -> list[LayerCost]:
    layers = [LayerCost(layer.name, layer.order, layer.parameter_count, layer.parameter_bytes,
                        layer.flops_per_sample, layer.bytes_accessed_per_sample, layer.activation_bytes_per_sample,
                        layer.shared_from, layer.shared_parameter_bytes)
              for layer in registry.get(name).layers]
    check_layers(layers)
    return layers


def stretched_decoder(base: list[LayerCost], blocks: int) -> list[LayerCost]:
    """The base decoder with its middle block repeated to `blocks` blocks: embedding, blocks, head."""
    head, block = base[-1], base[len(base) // 2]
    out = [base[0]]
    out += [LayerCost(f"block_{i}", 1 + i, block.parameter_count, block.parameter_bytes, block.flops_per_sample,
                      block.bytes_accessed_per_sample, block.activation_bytes_per_sample) for i in range(blocks)]
    out.append(LayerCost(head.name, blocks + 1, head.parameter_count, head.parameter_bytes, head.flops_per_sample,
                         head.bytes_accessed_per_sample, head.activation_bytes_per_sample, head.shared_from,
                         head.shared_parameter_bytes))
    check_layers(out)
    return out


# -- (a) plan quality -------------------------------------------------------------------------


def bandwidth_bound_share(model: Model, devices: Sequence[Device]) -> dict[str, float]:
    """Per target type: the share of the whole model's time on one such device spent in layers
    whose memory traffic, not their FLOPs, sets the time."""
    out = {}
    for d in {d.target_type: d for d in devices}.values():
        rate = d.peak_tflops * 1e12 * CATALOG_EFFICIENCY
        bandwidth = d.memory_bandwidth_gbps * 1e9 * BANDWIDTH_EFFICIENCY
        times = [(model.compute_seconds(i, d), model.traffic[i] / bandwidth > model.flops[i] / rate)
                 for i in range(len(model))]
        total = sum(t for t, _ in times)
        out[d.target_type] = round(sum(t for t, bound in times if bound) / total, 3) if total else 0.0
    return out


def outcome(placement: Placement | None, error: NoRoom | None, model: Model, devices: Sequence[Device],
            bound: float) -> dict:
    if placement is None:
        return {"feasible": False, "error": str(error), "shortfall_bytes": error.shortfall_bytes}
    ev = placement.evaluation
    by_id = {d.id: d for d in devices}
    fullest = max(used / capacity(by_id[d], model.task) for d, used in ev.memory_bytes.items())
    types = Counter(by_id[d].target_type for d in placement.devices)
    return {
        "feasible": ev.feasible,
        "step_ms": round(ev.step_seconds * 1e3, 6),
        "strategy_taken": placement.strategy,
        "ratio_to_lower_bound": ratio(ev.step_seconds, bound),
        "devices_used": len(placement.devices),
        "devices_used_by_type": dict(sorted(types.items())),
        "cross_transfers": ev.cross_transfers,
        "transfer_ms_on_busiest_device": round(ev.transfer_seconds[_busiest(ev)] * 1e3, 3),
        "fullest_device_memory_fraction": round(fullest, 3),
        "over_memory_devices": len(ev.over_memory),
    }


def _busiest(ev: Evaluation) -> str:
    return max(ev.compute_seconds, key=lambda d: ev.compute_seconds[d] + ev.transfer_seconds[d])


def attempt(call: Callable[[], Placement]) -> tuple[Placement | None, NoRoom | None]:
    try:
        return call(), None
    except NoRoom as exc:
        return None, exc


def plan_case(layers: list[LayerCost], devices: list[Device], kind: str, count_mode: str) -> dict:
    count = len(devices) if count_mode == MIX_SIZE else 0
    model = Model(layers, Task(kind=kind, micro_batch_rows=MICRO_BATCH_ROWS, device_count=count))
    bound = lower_bound_seconds(model, devices)
    ranked, ranked_err = attempt(lambda: place_ranked(model, devices))
    balanced, balanced_err = attempt(lambda: place_balanced(model, devices))
    auto, auto_err = attempt(lambda: place(model, devices)[2])
    derived = _derived_count(Model(layers, replace(model.task, device_count=0)), devices)
    if balanced is not None:
        split_count, split_from = len(balanced.devices), "devices balanced used"
    else:
        split_count = count or derived
        split_from = "the mix size (balanced found no placement)" if count else \
            "the memory-derived count (balanced found no placement)"
    placements = {
        "auto": (auto, auto_err),
        "ranked": (ranked, ranked_err),
        "balanced": (balanced, balanced_err),
        "sequential_fill": (sequential_fill(model, devices), None),
        "parameter_split": (parameter_split(model, devices, split_count) if split_count else None,
                            None if split_count else NoRoom("no device count: the model fits on no device set",
                                                            model.total_need())),
    }
    return {
        "model_need_bytes": model.total_need(),
        "memory_derived_device_count": derived,
        "arithmetic_intensity_flop_per_byte": round(model.intensity(), 2),
        "bandwidth_bound_time_share_by_type": bandwidth_bound_share(model, devices),
        "lower_bound_ms": round(bound * 1e3, 4),
        "parameter_split_devices": split_count,
        "parameter_split_count_from": split_from,
        "strategies": {name: outcome(p, e, model, devices, bound) for name, (p, e) in placements.items()},
    }


def _derived_count(model: Model, devices: Sequence[Device]) -> int:
    try:
        return required_devices(model, devices, initial_scores(devices, model.task.weights))
    except NoRoom:
        return 0


def _geomean_of(cases: list[dict], strategy: str, key: str) -> float | None:
    values = [c["strategies"][strategy][key] for c in cases if c["strategies"][strategy]["feasible"]]
    return round(geomean(values), 3) if values else None


def summarise(rows: list[dict]) -> dict:
    """Per count mode: feasibility and geometric-mean ratios per strategy (overall, where all
    fit, per mix); balanced against ranked; which strategies fail where another fits."""
    out = {}
    for mode in (MIX_SIZE, MEMORY_DERIVED):
        cases = [r for r in rows if r["count_mode"] == mode]
        all_feasible = [r for r in cases if all(r["strategies"][s]["feasible"] for s in STRATEGIES)]
        per = {s: {
            "feasible_cases": sum(r["strategies"][s]["feasible"] for r in cases),
            "geomean_ratio_to_lower_bound": _geomean_of(cases, s, "ratio_to_lower_bound"),
            "geomean_ratio_to_lower_bound_where_all_feasible":
                _geomean_of(all_feasible, s, "ratio_to_lower_bound"),
            "geomean_ratio_to_lower_bound_by_mix": {
                mix: _geomean_of([r for r in cases if r["mix"] == mix], s, "ratio_to_lower_bound")
                for mix in dict.fromkeys(r["mix"] for r in cases)},
        } for s in STRATEGIES}
        both = [r for r in cases if r["strategies"]["ranked"]["feasible"] and r["strategies"]["balanced"]["feasible"]]
        speedups = {f"{r['model']}/{r['mix']}/{r['kind']}":
                    r["strategies"]["ranked"]["step_ms"] / r["strategies"]["balanced"]["step_ms"] for r in both}
        out[mode] = {
            "cases": len(cases),
            "cases_all_feasible": len(all_feasible),
            "strategies": per,
            "balanced_vs_ranked": {
                "cases_both_feasible": len(both),
                "balanced_faster": sum(v > 1 + 1e-6 for v in speedups.values()),
                "ranked_faster": sum(v < 1 - 1e-6 for v in speedups.values()),
                "tied": sum(abs(v - 1) <= 1e-6 for v in speedups.values()),
                "geomean_ranked_step_over_balanced_step": round(geomean(list(speedups.values())), 3)
                if speedups else None,
                "max_ranked_step_over_balanced_step": round(max(speedups.values()), 3) if speedups else None,
                "cases_where_ranked_is_faster": {k: round(v, 3) for k, v in sorted(speedups.items()) if v < 1 - 1e-6},
            },
            "infeasible_where_another_fits": sorted(
                f"{r['model']}/{r['mix']}/{r['kind']}: {s}" for r in cases for s in STRATEGIES
                if not r["strategies"][s]["feasible"] and any(r["strategies"][o]["feasible"] for o in STRATEGIES)),
            "no_strategy_fits": sorted(f"{r['model']}/{r['mix']}/{r['kind']}" for r in cases
                                       if not any(r["strategies"][s]["feasible"] for s in STRATEGIES)),
        }
    return out


def goal(rows: list[dict]) -> dict:
    """The issue's bar: the default strategy, the client's count unset, over every device
    offered: geometric-mean ratio to the lower bound over those devices <= GOAL_GEOMEAN, and no
    case it cannot place that a sequential loader fills."""
    cases = [r for r in rows if r["count_mode"] == MEMORY_DERIVED]
    geomean_default = _geomean_of(cases, DEFAULT_STRATEGY, "ratio_to_lower_bound")
    refused = sorted(f"{r['model']}/{r['mix']}/{r['kind']}" for r in cases
                     if r["strategies"]["sequential_fill"]["feasible"]
                     and not r["strategies"][DEFAULT_STRATEGY]["feasible"])
    worst = sorted(((r["strategies"][DEFAULT_STRATEGY].get("ratio_to_lower_bound") or 0,
                     f"{r['model']}/{r['mix']}/{r['kind']}")
                    for r in cases), reverse=True)[:5]
    return {"strategy": DEFAULT_STRATEGY, "device_count": "unset (every device offered)",
            "geomean_ratio_to_lower_bound_over_offered": geomean_default, "target": GOAL_GEOMEAN,
            "met": geomean_default is not None and geomean_default <= GOAL_GEOMEAN and not refused,
            "infeasible_where_sequential_fill_fits": refused,
            "worst_cases": [{"case": c, "ratio": v} for v, c in worst]}


def bench_quality(registry: ProgramRegistry, mixes: dict[str, list[Device]]) -> list[dict]:
    rows = []
    for name in MODELS:
        layers = layer_table(registry, name)
        for mix, devices in mixes.items():
            for kind in KINDS:
                for mode in (MIX_SIZE, MEMORY_DERIVED):
                    started = time.perf_counter()
                    case = plan_case(layers, devices, kind, mode)
                    rows.append({"model": name, "layers": len(layers), "mix": mix, "mix_devices": len(devices),
                                 "kind": kind, "count_mode": mode, **case,
                                 "plan_wall_s": round(time.perf_counter() - started, 3)})
        progress(f"quality: {name} planned on {len(mixes)} mixes")
    return rows


# -- (b) planning cost ------------------------------------------------------------------------


def catalog_thousand(rules: RuleTable) -> list[Device]:
    """1,000 GPUs cycling over the catalog's CUDA and ROCm types (8 per node)."""
    types = [e for e in load_catalog().values() if e.platform in ("cuda", "rocm")]
    devices = []
    for index in range(PLANNING_DEVICES):
        entry = types[index % len(types)]
        spec = entry.device_spec(synthetic_node_ip(index // 8), index % 8)
        rule = rules.match(spec)
        devices.append(placement_device(spec, rules.target_type(spec).key, rule.build.compute_dtype))
    return devices


def median_times_ms(call: Callable[[], object], runs: int) -> dict:
    """Median wall and process-CPU milliseconds of `runs` calls after one warm-up. CPU time is
    what the call costs when it has a core to itself; wall time is what a caller waited."""
    call()
    wall, cpu = [], []
    for _ in range(runs):
        w, c = time.perf_counter(), time.process_time()
        call()
        wall.append((time.perf_counter() - w) * 1e3)
        cpu.append((time.process_time() - c) * 1e3)
    return {"median_wall_ms": round(statistics.median(wall), 3), "median_cpu_ms": round(statistics.median(cpu), 3)}


def bench_planning_cost(layers: list[LayerCost], pools: dict[str, list[Device]], runs: int) -> dict:
    """Each strategy's median planning time against sequential_fill on the same model and devices."""
    out = {}
    goal_ms = PLANNING_GOAL_S * 1e3
    for pool, devices in pools.items():
        for kind in KINDS:
            for label, count in ((MEMORY_DERIVED, 0), (f"device_count_{PLANNING_WIDE_COUNT}", PLANNING_WIDE_COUNT)):
                model = Model(layers, Task(kind=kind, micro_batch_rows=MICRO_BATCH_ROWS, device_count=count))
                baseline = median_times_ms(partial(sequential_fill, model, devices), runs)
                entry = {"device_count_planned_from": _derived_count(model, devices),
                         "baseline_sequential_fill": baseline}
                for strategy, planner in (("ranked", place_ranked), ("balanced", place_balanced)):
                    plan = partial(planner, model, devices)
                    placement, error = attempt(plan)
                    times = median_times_ms(partial(attempt, plan), runs)
                    entry[strategy] = {
                        **times,
                        "ratio_to_baseline_wall": ratio(times["median_wall_ms"], baseline["median_wall_ms"]),
                        "under_goal_wall": times["median_wall_ms"] < goal_ms,
                        "under_goal_cpu": times["median_cpu_ms"] < goal_ms,
                        "devices_used": len(placement.devices) if placement else None,
                        "step_ms": round(placement.evaluation.step_seconds * 1e3, 3) if placement else None,
                        "error": str(error) if error else None,
                    }
                    if strategy == "ranked" and placement is not None:
                        # place_ranked starts over with one more device when the chosen ones run out.
                        final = re.search(r"so (\d+) device\(s\)", placement.explain[0])
                        entry[strategy]["device_count_after_restarts"] = int(final[1]) if final else None
                    if strategy == "balanced" and placement is not None:
                        entry[strategy]["exact"] = not any("not exact" in line for line in placement.explain)
                out[f"{pool}/{kind}/{label}"] = entry
                progress(f"planning cost: {pool} {kind} {label}: ranked {entry['ranked']['median_wall_ms']} ms "
                         f"({entry['ranked']['median_cpu_ms']} CPU), balanced {entry['balanced']['median_wall_ms']} ms")
    return out


def ridge_points(devices: Sequence[Device]) -> dict[str, float]:
    """FLOP per byte above which a layer is compute-bound on each target type (placement's model)."""
    return {d.target_type: round(d.peak_tflops * 1e12 * CATALOG_EFFICIENCY
                                 / (d.memory_bandwidth_gbps * 1e9 * BANDWIDTH_EFFICIENCY), 1)
            for d in {d.target_type: d for d in devices}.values()}


def code_version() -> dict:
    """Which planner code was measured (it changes while benches run): a digest of its modules."""
    folder = Path(dispatch_svc.planner.__file__).resolve().parent
    digest = hashlib.sha256()
    files = sorted(folder.glob("*.py"))
    for path in files:
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    newest = max(path.stat().st_mtime for path in files)
    return {"package": str(folder.relative_to(Path(__file__).resolve().parents[1])),
            "sha256_12": digest.hexdigest()[:12],
            "newest_module_modified": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(newest))}


def machine() -> dict:
    return {"cores": os.cpu_count(), "python": platform.python_version(), "numpy": np.__version__,
            "platform": platform.platform(), "load_average_1m": round(os.getloadavg()[0], 2)}


# -- (c) predicted against measured ---------------------------------------------------------------

MEASURED_SETS = {"emulated_a100x2_v100": ("a100-80gb", "a100-80gb", "v100-32gb"), "host_cpu_x3": ()}
MEASURED_ROWS, MEASURED_MICRO_ROWS = 64, 8


def measured_pipelines() -> dict:
    """(c): each device set's warm pipeline run, predicted against measured."""
    import tempfile

    from accelmesh.client import MeshClient
    from accelmesh.dispatch.v1 import job_pb2 as job_pb
    from accelmesh.dispatch.v1 import plan_pb2 as plan_pb
    from accelmesh.embedded import start_embedded_mesh

    out = {}
    tokens = np.random.default_rng(0).integers(0, 512, size=(MEASURED_ROWS, 32), dtype=np.int32)
    options = plan_pb.PlacementOptions(strategy=plan_pb.PLACEMENT_STRATEGY_BALANCED,
                                       micro_batch_rows=MEASURED_MICRO_ROWS)
    for name, emulate in MEASURED_SETS.items():
        with tempfile.TemporaryDirectory(prefix="accelmesh-bench-placement-") as tmp, \
                start_embedded_mesh(Path(tmp), devices=3, emulate=emulate, nvml=False) as mesh, \
                MeshClient(mesh.dispatch.address, security=mesh.client) as client:
            jobs = []
            for run in ("catalog", "calibrating", "measured"):
                result = client.run("transformer_encoder", {"tokens": tokens}, placement=options)
                if result.job.state != job_pb.JOB_STATE_SUCCEEDED:
                    raise SystemExit(f"{name}: the pipeline job failed: {result.job.error}")
                jobs.append(result.job)
                progress(f"measured: {name} {run} run done")
        out[name] = {"emulated_types": list(emulate) or None, "catalog_run": _against(jobs[0]),
                     **_against(jobs[-1]),
                     "calibration": [line for line in jobs[-1].plan.placement.explain if line.startswith("calibrated")]}
    return out


def _against(job) -> dict:
    """A pipeline job's predicted stage and job seconds against what its records measured."""
    placement = job.plan.placement
    stages = []
    for stage in placement.stages:
        records = [r for r in job.shards if r.index % len(placement.stages) == stage.index]
        total = statistics.median(r.total_seconds - r.queue_seconds for r in records)
        stages.append({
            "stage": stage.index, "layers": stage.layer_count, "devices": 1 + len(stage.replica_device_ids),
            "target_type": stage.target_type,
            "predicted_ms": round(stage.compute_seconds * 1e3, 6),
            "measured_call_median_ms": round(total * 1e3, 3),
            "measured_over_predicted": ratio(total, stage.compute_seconds),
        })
    seconds = (job.end_time.ToNanoseconds() - job.create_time.ToNanoseconds()) / 1e9
    return {"micro_batches": placement.micro_batches, "micro_batch_rows": placement.micro_batch_rows,
            "stages": stages, "predicted_step_ms": round(placement.predicted_step_seconds * 1e3, 6),
            "predicted_job_s": round(placement.predicted_seconds, 6),
            # the pipeline's run (Job.measured_seconds: first stage call to the last outputs) ...
            "measured_job_s": round(job.measured_seconds, 3),
            "measured_job_over_predicted": ratio(job.measured_seconds, placement.predicted_seconds),
            # ... and the job's wall time, planning and any stage builds included
            "wall_s": round(seconds, 3)}


# -- main -------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few repetitions of the timing: a smoke run")
    parser.add_argument("--no-run", action="store_true", help="skip (c), the pipelines run on this machine")
    args = parser.parse_args(argv)
    mode = "quick" if args.quick else "full"
    started = time.perf_counter()
    machine_start = machine()
    code_at_start = code_version()
    rules = load_rules()
    registry = default_registry()

    mixes, mix_info = {}, {}
    for name, counts in CATALOG_MIXES.items():
        mixes[name], dtypes = catalog_mix(rules, counts)
        mix_info[name] = {"listed_order": listed_order(mixes[name]), "rule_dtypes": dtypes,
                          "ridge_flop_per_byte": ridge_points(mixes[name])}
    pai, pai_types, pai_skipped = None, None, None
    if PAI_CSV.exists():
        pai, pai_types = pai_devices(rules)
        mixes[PAI_MIX], info = pai_sample(pai, pai_types, PAI_SAMPLE_DEVICES)
        mix_info[PAI_MIX] = {"source": str(PAI_CSV), "cluster_gpus_by_type": dict(sorted(pai_types.items())),
                             "sample": info, "listed_order": listed_order(mixes[PAI_MIX]),
                             "ridge_flop_per_byte": ridge_points(mixes[PAI_MIX])}
    else:
        pai_skipped = f"{PAI_CSV} not found; the {PAI_MIX} mix and the PAI-like 1,000-device pool are skipped"
        progress(f"NOTE: {pai_skipped}")

    rows = bench_quality(registry, mixes)

    base = layer_table(registry, PLANNING_BASE_MODEL)
    decoder = stretched_decoder(base, PLANNING_BLOCKS)
    pools = {"catalog_1000": catalog_thousand(rules)}
    if pai is not None:
        pools["pai_like_1000"] = pai_sample(pai, pai_types, PLANNING_DEVICES)[0]
    cost = bench_planning_cost(decoder, pools, RUNS[mode])
    measured = None if args.no_run else measured_pipelines()
    wall = {f"{k}/{s}": v[s]["median_wall_ms"] for k, v in cost.items() for s in ("ranked", "balanced")}
    cpu = {f"{k}/{s}": v[s]["median_cpu_ms"] for k, v in cost.items() for s in ("ranked", "balanced")}

    result = {
        "benchmark": "placement",
        "mode": mode,
        "machine_at_start": machine_start,
        "machine_at_end": machine(),
        "placement_code": {**code_at_start, "changed_during_run": code_version() != code_at_start},
        "assumptions": [
            f"micro-batches of {MICRO_BATCH_ROWS} rows; every device free (memory_free_bytes = datasheet memory), "
            "default 10% headroom and default task weights",
            "each device's rate is its catalog peak at the compute dtype of the compile rule its type matches "
            "(compile_svc.rules.load_rules().match), e.g. bf16 on A100/H100/L4, fp32 on V100/T4/P100",
            "ratio_to_lower_bound = predicted step time / lower_bound_seconds(model, every device of the mix), "
            "both from the planner's own cost model (dispatch_svc.planner.placement)",
            f"count modes: {MIX_SIZE} sets Task.device_count to the mix size for ranked and balanced; "
            f"{MEMORY_DERIVED} leaves it 0: auto and balanced take as many of the devices offered as lower the "
            "step, ranked the fewest best-scored devices whose memory holds the model (B6)",
            "sequential_fill fills the mix's devices in listed order and ignores the count; parameter_split uses as "
            "many devices as balanced used (first N listed)",
            f"PAI: {', '.join(f'{k} -> {v}' for k, v in PAI_TYPES.items())} (as bench/planning.py); the sample "
            "takes each type's share of the cluster's GPUs by largest remainder, first devices in CSV order",
            f"planning cost: {PLANNING_BASE_MODEL}'s embedding, middle block (x{PLANNING_BLOCKS}) and tied head = "
            f"{PLANNING_BLOCKS + 2} layers; median of {RUNS[mode]} calls after one warm-up, against "
            "sequential_fill on the same model and devices; catalog_1000 cycles over the catalog's CUDA and ROCm "
            "types, pai_like_1000 takes the PAI cluster's type shares",
        ],
        "mixes": mix_info,
        "pai_skipped_reason": pai_skipped,
        "summary": summarise(rows),
        "goal": goal(rows),
        "predicted_vs_measured": measured,
        "planning_cost": {
            "layers": len(decoder), "devices": PLANNING_DEVICES, "goal_s": PLANNING_GOAL_S,
            "goal_met": all(ms < PLANNING_GOAL_S * 1e3 for ms in wall.values()),
            "goal_met_on_cpu_time": all(ms < PLANNING_GOAL_S * 1e3 for ms in cpu.values()),
            "slowest_wall_ms": max(wall.values()), "slowest_wall": max(wall, key=wall.get),
            "slowest_cpu_ms": max(cpu.values()), "slowest_cpu": max(cpu, key=cpu.get),
            "note": "goal_met is on wall time; on a loaded machine (see load_average_1m) CPU time shows "
                    "what a call costs with a core to itself",
            "cases": cost,
        },
        "cases": rows,
        "wall_s": round(time.perf_counter() - started, 1),
    }
    json.dump(result, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
