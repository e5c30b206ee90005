"""bench/netns_bulk.py's pure parts, without root, namespaces or a mesh: the job's rows, the arms'
alternating order, and the summary on runs made up here (medians, the ratios of the job to the
bare arms, the target met or not). Nothing about how fast this host is."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

# bench/ is no package: its scripts import each other by path, as this test does.
sys.path.append(str(Path(__file__).resolve().parents[2] / "bench"))
import netns_bulk as bulk

MIB = 1024 * 1024


def test_the_job_is_whole_rows_of_identitys_width():
    assert bulk.job_rows(256 * MIB, 1024) == 65536  # 4 KiB rows
    for bad in (4 * 1024 - 4, 4 * 1024 + 4, 0):
        with pytest.raises(ValueError, match="whole number"):
            bulk.job_rows(bad, 1024)


def test_the_arms_run_in_order_then_reversed_every_other_round():
    assert [bulk.arm_order(rep) for rep in range(3)] == [bulk.ARMS, bulk.ARMS[::-1], bulk.ARMS]
    assert set(bulk.ARMS) == {"job", *bulk.BARE}


def run(mb_per_s: float, **extra) -> dict:
    return {"round_trip_mb_per_s": mb_per_s, "seconds": 256 * MIB / 1e6 / mb_per_s, "machine_busy_cpu_s": 1.0,
            "cpu_s": {"client": 0.5}, **extra}


def made_up(job: list[float], grpc: list[float], tcp: list[float]) -> dict:
    bare = {"put_mb_per_s": 1000.0, "get_mb_per_s": 1000.0}
    return {"job": [run(v) for v in job], "bare_grpc": [run(v, **bare) for v in grpc],
            "tcp": [run(v, **bare) for v in tcp]}


def test_the_summary_compares_the_medians_of_the_same_bytes_each_way():
    summary = bulk.summarize(256 * MIB, made_up(job=[300, 100, 200], grpc=[500, 400, 900], tcp=[1000, 800, 1200]))
    job = summary["arms"]["job"]
    assert job["round_trip_mb_per_s_p50"] == 200 and job["round_trip_mb_per_s_runs"] == [300, 100, 200]
    assert summary["arms"]["bare_grpc"]["put_mb_per_s_p50"] == 1000 and "put_mb_per_s_p50" not in job
    assert summary["ratio_job_over_bare_grpc_p50"] == pytest.approx(200 / 500, abs=1e-3)
    assert summary["ratio_job_over_tcp_p50"] == pytest.approx(200 / 1000, abs=1e-3)
    assert summary["ratio_bare_grpc_over_tcp_p50"] == pytest.approx(0.5, abs=1e-3)
    assert summary["ratio_job_machine_cpu_over_bare_grpc_p50"] == 1.0
    assert summary["target"] == {"rule": "ratio_job_over_bare_grpc >= 0.8", "ratio": 0.4, "met": False}
    assert "N / wall seconds" in summary["definition"]["round_trip_mb_per_s"]


def test_the_target_is_met_at_four_fifths_of_bare_grpc():
    at_the_bar = bulk.summarize(MIB, made_up(job=[400], grpc=[500], tcp=[900]))
    below = bulk.summarize(MIB, made_up(job=[399], grpc=[500], tcp=[900]))
    assert (at_the_bar["target"]["met"], below["target"]["met"]) == (True, False)
