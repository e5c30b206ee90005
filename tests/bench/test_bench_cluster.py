"""bench/cluster.py without ../shared: its trace generator, its round-based simulation and lower
bounds on traces small enough to work out by hand, and `--quick` end to end on a synthetic
throughput table and machine list written to tmp_path (the JSON's keys and ratios; nothing about
how fast this host is), including the skip when the data folder is absent."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest

# bench/ is no package: its scripts import each other by path, as this test does.
sys.path.append(str(Path(__file__).resolve().parents[2] / "bench"))
import cluster

SYNTHETIC_THROUGHPUTS = """job_type,scale_factor,k80_steps_per_s,p100_steps_per_s,v100_steps_per_s
Conv (batch size 32),1,1.0,4.0,8.0
Conv (batch size 32),2,1.8,7.5,15.0
Recsys,1,3.0,4.0,2.0
Language,1,2.0,5.0,6.0
Language,2,3.5,9.0,11.0
"""
SYNTHETIC_MACHINES = """machine,gpu_type,cap_cpu,cap_mem,cap_gpu
m0,V100,96,512,8
m1,T4,96,512,4
m2,MISC,96,512,2
m3,CPU,96,512,0
"""


def write_data(folder: Path, machines: bool = True) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / cluster.GAVEL_FILE).write_text(SYNTHETIC_THROUGHPUTS)
    if machines:
        (folder / cluster.PAI_FILE).write_text(SYNTHETIC_MACHINES)
    return folder


def run_bench(capsys, *args: str) -> dict:
    assert cluster.main(["--quick", *args]) == 0
    return json.loads(capsys.readouterr().out)


def test_quick_run_on_a_synthetic_table_reports_every_policy_against_fifo_and_the_bounds(tmp_path, capsys):
    out = tmp_path / "cluster.json"
    result = run_bench(capsys, "--data", str(write_data(tmp_path / "data")), "--out", str(out))
    assert json.loads(out.read_text()) == result
    assert result["benchmark"] == "cluster" and result["mode"] == "quick" and "skipped" not in result
    simulation = result["simulation"]
    assert simulation["pool"] == cluster.GAVEL_POOL and simulation["trace"]["seed"] == cluster.SEED
    for case in [*simulation["by_rate"], simulation["all_at_once"]]:
        assert set(case["policies"]) == {"fifo", "max_min_fairness", "min_total_time"}
        for figures in case["policies"].values():
            for key in ("ratio_avg_jct_to_fifo", "ratio_makespan_to_fifo"):
                assert figures[key] is not None and 0 < figures[key] < math.inf
            # Lower bounds hold: no schedule finishes a job before it could alone on its best type.
            assert figures["ratio_avg_jct_to_bound"] >= 1 and figures["ratio_makespan_to_bound"] >= 1
        assert case["policies"]["fifo"]["ratio_avg_jct_to_fifo"] == 1.0
        # The same policies as the queue runs them, nothing preempted: ratios to FIFO's without preemption.
        assert set(case["queue"]) == set(case["policies"]) and case["queue"]["fifo"]["ratio_avg_jct_to_fifo"] == 1.0
        assert all(f["ratio_avg_jct_to_bound"] >= 1 for f in case["queue"].values())
    decision = result["decision_time"]
    assert decision["devices"] == 14 and decision["devices_by_type"] == {"MISC": 2, "T4": 4, "V100": 8}
    assert decision["jobs"] == cluster.MODES["quick"]["decision_jobs"]
    for figures in decision["policies"].values():
        assert sum(figures["devices_used"].values()) <= 14 and figures["median_s"] >= 0


def test_without_the_data_folder_the_bench_says_why_and_exits_zero(tmp_path, capsys):
    result = run_bench(capsys, "--data", str(tmp_path / "absent"))
    assert result["simulation"] is None and result["decision_time"] is None
    assert "not found" in result["skipped"] and "not found" in result["simulation_skipped_reason"]


def test_without_the_machine_list_only_the_decision_time_is_skipped(tmp_path, capsys):
    result = run_bench(capsys, "--data", str(write_data(tmp_path, machines=False)))
    assert result["simulation"] is not None and result["decision_time"] is None
    assert cluster.PAI_FILE in result["decision_time_skipped_reason"] and "skipped" not in result


def test_the_trace_is_reproducible_and_draws_only_measured_scale_factors(tmp_path):
    catalog = cluster.read_catalog(write_data(tmp_path) / cluster.GAVEL_FILE)
    first = cluster.generate_trace(catalog, 200, 2.0, np.random.default_rng(3))
    assert first == cluster.generate_trace(catalog, 200, 2.0, np.random.default_rng(3))
    assert {job.scale_factor for job in first} <= {1, 2}
    assert all(job.key in catalog.throughputs for job in first)
    arrivals = [job.arrival_s for job in first]
    assert arrivals == sorted(arrivals) and len(set(arrivals)) == len(arrivals)
    # Lengths as Gavel draws them: 10^1.5 to 10^4 minutes on the reference type.
    minutes = [job.steps / catalog.throughputs[job.key][cluster.REFERENCE_TYPE] / 60 for job in first]
    assert 10 ** 1.5 <= min(minutes) and max(minutes) <= 10 ** 4


def job(index: int, arrival_s: float, steps: float) -> cluster.TraceJob:
    return cluster.TraceJob(f"job-{index}", "t", 1, arrival_s, steps)


def test_rounds_run_the_first_arrival_first_and_a_job_arriving_mid_round_waits_for_the_next():
    # One device at 1 step/s, rounds of 360 s: the first job takes two rounds; the second arrives
    # 10 s in, waits for both, and then takes one.
    trace = [job(0, 0.0, 720.0), job(1, 10.0, 360.0)]
    run = cluster.simulate(trace, {"a": 1}, {"t": {"a": 1.0}}, "fifo")
    assert run["completion_s"] == {"job-0": 720.0, "job-1": 1080.0}
    assert run["rounds"] == 3
    bound = cluster.lower_bounds(trace, {"a": 1}, {"t": {"a": 1.0}})
    assert bound["alone_s"] == [720.0, 360.0]
    assert bound["makespan_s"] == pytest.approx(1080.0, rel=1e-5)  # the LP: 1,080 s of work on one device


def test_an_idle_pool_skips_to_the_round_after_the_next_arrival():
    trace = [job(0, 0.0, 100.0), job(1, 5000.0, 100.0)]
    run = cluster.simulate(trace, {"a": 1}, {"t": {"a": 1.0}}, "max_min_fairness")
    assert run["completion_s"] == {"job-0": 100.0, "job-1": math.ceil(5000 / 360) * 360 + 100.0}
    assert run["rounds"] == 2 and run["lp_solves"] == 2


def test_without_preemption_a_running_job_keeps_its_device_until_it_ends():
    # One device at 1 step/s: under max-min fairness's rounds two jobs share it round by round, so
    # the long one that came first finishes last; not preempted, it holds the device to its end.
    trace = [job(0, 0.0, 1080.0), job(1, 0.0, 360.0)]
    table = {"t": {"a": 1.0}}
    shared = cluster.simulate(trace, {"a": 1}, table, "max_min_fairness")["completion_s"]
    assert shared["job-0"] == 1440.0 and shared["job-1"] < shared["job-0"]
    held = cluster.simulate(trace, {"a": 1}, table, "max_min_fairness", preemptive=False)["completion_s"]
    assert held == {"job-0": 1080.0, "job-1": 1440.0}
