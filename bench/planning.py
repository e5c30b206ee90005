"""Planning benchmark: what throughput-weighted shards buy, and what planning costs at cluster scale.

    .venv/bin/python bench/planning.py [--quick]

Prints one JSON document on stdout (progress on stderr).

(a) Plan quality on real measurements (Gavel, ../shared/data/gavel_isolated_throughputs.csv): for
    every job type at scale factor 1, one K80 + one P100 + one V100 split a 100,000-sample batch.
    Each GPU's rows/s is its measured steps/s x the job's batch size (1 when the name gives none),
    recorded into the ThroughputModel as a measured rate. The ratio is equal-shares makespan over
    throughput-weighted makespan from the same run (> 1: weighting is faster). A third split,
    weighted by catalog peak rates at the rule's dtype (what the planner uses before anything was
    measured), is scored against the measured rates too.
(b) Planning cost on a real inventory (Alibaba PAI, ../shared/data/pai_machine_spec.csv): one
    device per GPU (6,742); time to estimate every device's throughput and plan_shards over all of
    them, against a baseline from the same run: merely sorting the device list by peak rate.
Compare ratios across machines, not milliseconds.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import re
import sys
import time
from collections import Counter
from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np
from common import geomean, progress, ratio, summary_ms, synthetic_node_ip, time_calls

from accelmesh.hardware.catalog import resolve_type
from accelmesh.hardware.model import DeviceSpec
from compile_svc.rules import RuleTable, load_rules
from dispatch_svc.planner import PlannedDevice, ThroughputModel, plan_shards
from dispatch_svc.planner.apportion import makespan

DATA_DIR = Path(__file__).resolve().parents[1].parent / "shared" / "data"
GAVEL_CSV = DATA_DIR / "gavel_isolated_throughputs.csv"
PAI_CSV = DATA_DIR / "pai_machine_spec.csv"

GAVEL_ROWS = 100_000
GAVEL_GPUS = {"k80": "k80", "p100": "p100-16gb", "v100": "v100-16gb"}  # CSV column prefix -> catalog type
PAI_TYPES = {"P100": "p100-16gb", "T4": "t4", "V100": "v100-16gb", "V100M32": "v100-32gb", "MISC": "t4"}
PAI_ROWS = 1_000_000
PAI_MAX_SHARD_ROWS = 64  # a streaming-sized cap: about 16k shards over the PAI pool
# One ResNet-50 training sample: ~4.1 GFLOPs forward, x3 for forward + backward.
PAI_FLOPS_PER_ROW = 3 * 4.1e9
PROGRAM_REF = "resnet50-train@1"
RUNS = {"full": 25, "quick": 4}






def time_ms(call: Callable[[], object], runs: int) -> dict:
    call()  # warm-up: first-call costs (imports, caches) are not planning
    return summary_ms(time_calls(call, runs, warmup=0))






# -- (a) Gavel: weighted versus equal shares ------------------------------------------------------


def batch_size(job_type: str) -> int:
    found = re.search(r"batch size (\d+)", job_type)
    return int(found[1]) if found else 1


def gavel_devices(rules: RuleTable) -> list[tuple[DeviceSpec, str, str]]:
    """One device per GPU type: (spec, target type key, the rule's compute dtype)."""
    out = []
    for index, catalog_type in enumerate(GAVEL_GPUS.values()):
        spec = resolve_type(catalog_type).device_spec("10.0.0.1", index)
        out.append((spec, rules.target_type(spec).key, rules.match(spec).build.compute_dtype))
    return out


def bench_gavel(rules: RuleTable) -> dict:
    gpus = gavel_devices(rules)
    jobs = {}
    with GAVEL_CSV.open(newline="") as handle:
        for row in csv.DictReader(handle):
            if int(row["scale_factor"]) != 1:
                continue
            job, batch = row["job_type"], batch_size(row["job_type"])
            model = ThroughputModel()
            for (_, key, _), column in zip(gpus, GAVEL_GPUS):
                steps_per_s = float(row[f"{column}_steps_per_s"])
                model.record(job, key, rows=batch, seconds=1 / steps_per_s)  # one step of `batch` rows
            measured = [PlannedDevice(s.id, k, model.rate(job, k, s.performance, dt).rows_per_second)
                        for s, k, dt in gpus]
            plan = plan_shards(GAVEL_ROWS, measured)
            catalog_model = ThroughputModel()  # nothing measured yet: peak rates stand in
            by_peak = [PlannedDevice(s.id, k, catalog_model.rate(job, k, s.performance, dt).rows_per_second)
                       for s, k, dt in gpus]
            peak_rows = list(plan_shards(GAVEL_ROWS, by_peak).rows_by_device().get(s.id, 0) for s, _, _ in gpus)
            peak_makespan = makespan(peak_rows, [d.rows_per_second for d in measured])
            jobs[job] = {
                "rows_per_second": {c: round(d.rows_per_second, 3) for c, d in zip(GAVEL_GPUS, measured)},
                "weighted_rows": {c: plan.rows_by_device().get(d.device_id, 0) for c, d in zip(GAVEL_GPUS, measured)},
                "weighted_s": round(plan.predicted_seconds, 2),
                "equal_s": round(plan.equal_split_predicted_seconds, 2),
                "peak_weighted_s": round(peak_makespan, 2),
                "ratio_equal_over_weighted": ratio(plan.equal_split_predicted_seconds, plan.predicted_seconds),
                "ratio_equal_over_peak_weighted": ratio(plan.equal_split_predicted_seconds, peak_makespan),
            }
    gains = [j["ratio_equal_over_weighted"] for j in jobs.values()]
    peak_gains = [j["ratio_equal_over_peak_weighted"] for j in jobs.values()]
    progress(f"gavel: {len(jobs)} job types planned")
    return {
        "source": str(GAVEL_CSV), "rows": GAVEL_ROWS,
        "devices": {c: f"{s.type} ({k}, {dt})" for c, (s, k, dt) in zip(GAVEL_GPUS, gpus)},
        "assumptions": [
            "rows/s = measured steps/s x the batch size in the job name (1 for A3C and CycleGAN); "
            "the ratios do not depend on that constant",
            "one device of each type, each job alone on it (Gavel's isolated measurements)",
        ],
        "job_types": len(jobs),
        "geomean_ratio_equal_over_weighted": round(geomean(gains), 3),
        "min_ratio_equal_over_weighted": min(gains), "max_ratio_equal_over_weighted": max(gains),
        "geomean_ratio_equal_over_peak_weighted": round(geomean(peak_gains), 3),
        "job_types_where_peak_weighting_loses_to_equal": sorted(j for j, v in jobs.items()
                                                                if v["ratio_equal_over_peak_weighted"] < 1),
        "per_job_type": jobs,
    }


# -- (b) PAI: planning cost at cluster scale --------------------------------------------------------




def pai_devices(rules: RuleTable) -> tuple[list[tuple[DeviceSpec, str, str]], Counter]:
    """One device per GPU; rule and target type resolved once per type, as Compile answers per type."""
    per_type: dict[str, tuple[str, str]] = {}
    devices, types = [], Counter()
    with PAI_CSV.open(newline="") as handle:
        for index, row in enumerate(csv.DictReader(handle)):
            gpu_type = row["gpu_type"].strip()
            if gpu_type not in PAI_TYPES:
                continue  # CPU machines: no GPUs to shard over
            entry = resolve_type(PAI_TYPES[gpu_type])
            for local in range(int(row["cap_gpu"])):
                spec = entry.device_spec(synthetic_node_ip(index), local)
                if spec.type not in per_type:
                    per_type[spec.type] = (rules.target_type(spec).key, rules.match(spec).build.compute_dtype)
                devices.append((spec, *per_type[spec.type]))
                types[spec.type] += 1
    return devices, types


def bench_pai(rules: RuleTable, runs: int) -> dict:
    devices, types = pai_devices(rules)
    progress(f"pai: {len(devices)} GPUs expanded")
    model = ThroughputModel()

    def rates() -> list[PlannedDevice]:
        return [PlannedDevice(s.id, key, model.rate(PROGRAM_REF, key, s.performance, dtype,
                                                    flops_per_row=PAI_FLOPS_PER_ROW).rows_per_second)
                for s, key, dtype in devices]

    planned = rates()
    variants = {"proportional": {}, "exact": {"exact": True},
                "max_shard_rows_64": {"max_shard_rows": PAI_MAX_SHARD_ROWS}}
    baseline = time_ms(lambda: sorted(devices, key=lambda d: d[0].performance.rate_tflops(d[2])), runs)
    throughput = time_ms(rates, runs)
    result = {"baseline_sort_by_peak": baseline, "throughput_all_devices": throughput, "variants": {}}
    for name, options in variants.items():
        plan = plan_shards(PAI_ROWS, planned, **options)
        shard_only = time_ms(partial(plan_shards, PAI_ROWS, planned, **options), runs)
        end_to_end = time_ms(lambda options=options: plan_shards(PAI_ROWS, rates(), **options), runs)
        rows_by_type = Counter()
        for shard in plan.shards:
            rows_by_type[shard.target_type] += shard.rows
        result["variants"][name] = {
            "options": options, "shards": len(plan.shards), "devices_used": len(plan.rows_by_device()),
            "predicted_s": round(plan.predicted_seconds, 4),
            "equal_split_predicted_s": round(plan.equal_split_predicted_seconds, 4),
            "ratio_equal_over_weighted": ratio(plan.equal_split_predicted_seconds, plan.predicted_seconds),
            "row_share_by_target_type": {k: round(v / PAI_ROWS, 4) for k, v in sorted(rows_by_type.items())},
            "plan_shards": shard_only,
            "throughput_and_plan": end_to_end,
            "ratio_throughput_and_plan_over_baseline_p50": ratio(end_to_end["p50_ms"], baseline["p50_ms"]),
            "ratio_plan_shards_over_baseline_p50": ratio(shard_only["p50_ms"], baseline["p50_ms"]),
        }
        progress(f"pai: {name} planned {len(plan.shards)} shards, p50 {end_to_end['p50_ms']} ms")
    return {
        "source": str(PAI_CSV), "devices": len(devices), "devices_by_type": dict(sorted(types.items())),
        "rows": PAI_ROWS, "program": PROGRAM_REF, "flops_per_row": PAI_FLOPS_PER_ROW, "source_of_rates": "catalog",
        "assumptions": [
            "one device per GPU; CPU machines left out",
            "P100 -> p100-16gb, T4 -> t4, V100 -> v100-16gb, V100M32 -> v100-32gb; MISC -> t4 (PAI does not name them)",
            "catalog rates at each rule's compute dtype with the planner's default efficiency; "
            "ResNet-50 training at 3 x 4.1 GFLOPs per sample",
            "rule and target type resolved once per GPU type before timing (dispatch gets them from Compile)",
        ],
        **result,
    }


def skipped(path: Path, section: str) -> str:
    """Say plainly on stderr that a section did not run; the reason goes into the JSON beside its null."""
    progress(f"NOTE: {path} not found; skipping {section} (\"{section}\": null in the JSON)")
    return f"{path} not found"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few repetitions: a smoke run, not a measurement")
    args = parser.parse_args(argv)
    mode = "quick" if args.quick else "full"
    started = time.perf_counter()
    rules = load_rules()
    gavel = bench_gavel(rules) if GAVEL_CSV.exists() else None
    pai = bench_pai(rules, RUNS[mode]) if PAI_CSV.exists() else None
    result = {
        "benchmark": "planning",
        "mode": mode,
        "machine": {"cores": os.cpu_count(), "python": platform.python_version(), "numpy": np.__version__,
                    "platform": platform.platform()},
        "gavel_weighted_vs_equal": gavel,
        "gavel_skipped_reason": None if gavel is not None else skipped(GAVEL_CSV, "gavel_weighted_vs_equal"),
        "pai_planning_cost": pai,
        "pai_skipped_reason": None if pai is not None else skipped(PAI_CSV, "pai_planning_cost"),
        "wall_s": round(time.perf_counter() - started, 1),
    }
    json.dump(result, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
