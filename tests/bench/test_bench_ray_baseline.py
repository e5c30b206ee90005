"""bench/dispatch.py's Ray arm without Ray: the pure helpers of bench/ray_baseline.py (pieces, store
size, per-task cost, result checks, the environment Ray starts in) and how the bench reports Ray
beside the mesh (ratios mesh / Ray, the note when Ray is absent). CI does not install the `bench`
extra, so nothing here starts Ray; `bench/dispatch.py` runs the arm itself."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

# bench/ is no package: its scripts import each other by path, as this test does.
sys.path.append(str(Path(__file__).resolve().parents[2] / "bench"))
import dispatch
import ray_baseline

MIB = 1024 * 1024


@pytest.mark.parametrize("rows, per_piece, expected", [
    (10, 3, [(0, 3), (3, 6), (6, 9), (9, 10)]),
    (6, 3, [(0, 3), (3, 6)]),
    (2, 8, [(0, 2)]),
    (0, 4, []),
])
def test_row_bounds_cover_every_row_once_in_order(rows, per_piece, expected):
    assert ray_baseline.row_bounds(rows, per_piece) == expected


def test_the_streaming_job_is_cut_into_8_mib_pieces_and_the_per_shard_job_into_its_shards():
    row_bytes = 1024 * 4
    assert len(ray_baseline.row_bounds(256 * MIB // row_bytes, ray_baseline.STREAM_PIECE_BYTES // row_bytes)) == 32
    assert len(ray_baseline.row_bounds(200 * 8, 8)) == 200


def test_row_bounds_refuse_an_empty_piece():
    with pytest.raises(ValueError, match="rows_per_piece"):
        ray_baseline.row_bounds(10, 0)


def test_the_object_store_holds_a_whole_stream_there_and_back_and_at_least_rays_minimum():
    assert ray_baseline.object_store_bytes(256 * MIB) >= 2 * 256 * MIB
    assert ray_baseline.object_store_bytes(0) >= 75 * MIB  # ray_constants.OBJECT_STORE_MINIMUM_MEMORY_BYTES


def test_ms_per_task_is_the_mean_run_wall_over_its_tasks():
    assert ray_baseline.ms_per_task([0.2, 0.4], 200) == 1.5


@pytest.mark.parametrize("got, exact, equal", [
    (np.float32([1.0, 2.0]), True, True),
    (np.nextafter(np.float32([1.0, 2.0]), np.float32(3)), True, False),  # identity must be bit-exact
    (np.nextafter(np.float32([1.0, 2.0]), np.float32(3)), False, True),  # a model: within 1e-5
    (np.float32([1.0, 2.1]), False, False),
    (np.float32([1.0]), False, False),  # a missing row is never equal
])
def test_results_are_compared_bit_for_bit_or_within_the_fp32_tolerance(got, exact, equal):
    assert ray_baseline.equal_results(got, np.float32([1.0, 2.0]), exact) is equal


def test_ray_starts_without_usage_stats_and_with_a_token_of_its_own_not_one_written_home():
    environ: dict[str, str] = {}
    ray_baseline.quiet_ray_environment(environ)
    assert environ["RAY_USAGE_STATS_ENABLED"] == "0"
    assert len(environ["RAY_AUTH_TOKEN"]) == 64
    assert "RAY_AUTH_MODE" not in environ  # Ray's own default decides


@pytest.mark.parametrize("given", [
    {"RAY_AUTH_TOKEN": "mine"},
    {"RAY_AUTH_TOKEN_PATH": "/somewhere/token"},
    {"RAY_AUTH_MODE": "disabled"},
    {"RAY_USAGE_STATS_ENABLED": "1"},
])
def test_what_the_caller_set_for_ray_is_kept(given):
    environ = dict(given)
    ray_baseline.quiet_ray_environment(environ)
    assert {k: environ[k] for k in given} == given
    if "RAY_AUTH_TOKEN" not in given:
        assert ("RAY_AUTH_TOKEN" in environ) is (given.get("RAY_AUTH_MODE", "token") == "token"
                                                 and "RAY_AUTH_TOKEN_PATH" not in given)


def test_the_json_says_how_to_install_ray_when_it_is_absent_and_nothing_when_it_is_measured():
    absent = dispatch.why_no_ray(True, None)
    assert "pip install -e '.[bench]'" in absent["absent"]
    assert dispatch.why_no_ray(False, "2.60.0") == {"skipped": "--no-ray was given"}
    assert dispatch.why_no_ray(True, "2.60.0") is None
    assert dispatch.ray_summary(absent) == absent


def overhead(job_wall_ms: float, floor_ms: float) -> dict:
    return {"job_wall_per_shard_ms": job_wall_ms, "bare_stream_call": {"p50_ms": floor_ms},
            "pipelined_relay_floor": {"as_execute_messages_ms_per_shard": {"p50_ms": 2 * floor_ms},
                                      "as_one_message_ms_per_shard": {"p50_ms": floor_ms / 2}}}


def test_ratios_are_mesh_over_ray_with_the_bare_floors_beside_them():
    ray = SimpleNamespace(version="2.60.0", auth_mode="token", actors=[object(), object()], store_bytes=640 * MIB)
    figures = {"async_one_device_ms_per_shard": 1.0, "one_at_a_time_ms_per_shard": 2.0, "results_match_local": True}
    per_shard = {"tls": {"identity": overhead(0.8, 0.3)}, "tls-direct": {"identity": overhead(1.5, 0.3)},
                 "plaintext": {"identity": overhead(0.6, 0.2)}, "ray": {"identity": figures}}
    stream = {"input_bytes": 350_000_000, "mesh": {"mb_per_s_p50": 400.0}, "mesh_direct": {"mb_per_s_p50": 700.0},
              "mesh_plaintext": {"mb_per_s_p50": 280.0}, "bare": {"mb_per_s_p50": 900.0}}
    runs = [{"seconds": 1.0, "equal": True, "pieces": 42}]

    summary = dispatch.ray_summary(dispatch.ray_section(ray, per_shard, stream, runs))

    identity = summary["per_shard_ms"]["identity"]
    assert (identity["ratio_mesh_over_ray_async"], identity["ratio_mesh_plaintext_over_ray_async"]) == (0.8, 0.6)
    assert identity["bare_grpc_call_floor"] == 0.3
    assert identity["bare_pipelined_relay_floor"] == {"execute_messages": 0.6, "one_message": 0.15}
    assert summary["mesh_per_shard_at_most_ray_async"] == {"identity": True}
    assert identity["ratio_mesh_direct_over_ray_async"] == 1.5
    assert summary["mesh_direct_per_shard_at_most_ray_async"] == {"identity": False}
    assert summary["stream_mb_per_s"] == {"mesh": 400.0, "mesh_plaintext": 280.0, "mesh_direct": 700.0, "ray": 350.0,
                                          "ratio_mesh_over_ray": 1.143, "ratio_mesh_direct_over_ray": 2.0,
                                          "ratio_mesh_plaintext_over_ray": 0.8, "bare_grpc_floor": 900.0}
    assert summary["mesh_stream_at_least_ray"] is True and summary["mesh_direct_stream_at_least_ray"] is True
    assert summary["ray_results_equal_local"] is True
