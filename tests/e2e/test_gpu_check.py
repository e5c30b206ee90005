"""bench/gpu_check.py in its CPU-only mode, so the GPU check cannot rot between the runs on a GPU
machine: the script runs as a child (the mesh's real processes under it) and its JSON is checked.
The NVML probe reads the repository's fake table, the job runs on a CPU device emulating an H100
(on the direct data path, a relayed run beside it), so nothing here depends on this host's CPU
flags, core count or speed. Without a driver the script must fail, with a non-zero exit and the
reason in its JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from accelmesh.object_client import SHARED
from compile_svc.programs.transformer import SEQ_LEN

pytestmark = [pytest.mark.slow, pytest.mark.fixture_cpu]

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu_check.py"
FAKE_NVML = ROOT / "tests" / "fakes" / "nvml.py"
GUARD_S = 300  # only against a hang; the run takes well under a minute
ROWS = 32
BF16_TOLERANCE = 0.05  # deploy/rules/compile_rules.toml, cuda-bf16
GIB = 2**30


def run_check(*args: str) -> tuple[int, dict]:
    done = subprocess.run([sys.executable, str(SCRIPT), *args], check=False, cwd=ROOT, capture_output=True,
                          text=True, timeout=GUARD_S)
    assert done.stdout.strip(), done.stderr[-5000:]
    return done.returncode, json.loads(done.stdout)


@pytest.fixture(scope="module")
def check():
    returncode, result = run_check("--cpu", "--rows", str(ROWS))
    assert returncode == 0, json.dumps({k: result.get(k) for k in ("failures", "traceback", "process_output_tails")},
                                       indent=1)
    return result


def test_the_json_says_it_ran_cpu_only_on_an_emulated_gpu(check):
    assert (check["mode"], check["emulated"], check["ok"], check["failures"]) == ("cpu", True, True, [])
    assert "no GPU used" in check["mode_description"]
    assert check["setup"]["worker_env"] == {"JAX_PLATFORMS": "cpu"}
    assert [(d["type"], d["platform"], d["emulated"], d["execution_device"]) for d in check["mesh_devices"]] == [
        ("h100-sxm-80gb", "cuda", True, "cpu:0")]


@pytest.mark.parametrize(
    ("index", "expected"),
    [
        pytest.param(0, {"id": "192.0.2.1/cuda:0", "kind": "NVIDIA H200", "type": "h200-sxm-141gb", "in_catalog": True,
                         "compute_capability": "9.0", "execution_device": "cuda:0", "memory_bytes": 143771 * 2**20,
                         "peak_bf16": 989.4, "dispatch_can_plan": True, "nvlink": True}, id="catalog-h200"),
        pytest.param(1, {"id": "192.0.2.1/cuda:1", "kind": "NVIDIA A100-SXM4-80GB", "type": "a100-80gb",
                         "in_catalog": True, "compute_capability": "8.0", "execution_device": "cuda:1",
                         "memory_bytes": 80 * GIB, "peak_bf16": 312.0, "dispatch_can_plan": True, "nvlink": True},
                     id="catalog-a100"),
        pytest.param(2, {"id": "192.0.2.1/cuda:2", "kind": "NVIDIA RTX 6000 Ada Generation",
                         "type": "rtx-6000-ada-generation", "in_catalog": False, "compute_capability": "8.9",
                         "execution_device": "cuda:2", "memory_bytes": 49140 * 2**20, "peak_bf16": None,
                         "dispatch_can_plan": False, "nvlink": False}, id="uncatalogued-ada"),
    ],
)
def test_the_nvml_probe_found_each_gpu_of_the_fake_table_with_its_fields(check, index, expected):
    assert check["nvml"]["ok"] and check["nvml"]["driver"].endswith(str(FAKE_NVML))
    assert len(check["nvml"]["gpus"]) == 3
    gpu = check["nvml"]["gpus"][index]
    spec = gpu["spec"]
    got = {"id": spec["id"], "kind": spec["kind"], "type": spec["type"], "in_catalog": spec["in_catalog"],
           "compute_capability": spec["compute_capability"], "execution_device": spec["execution_device"],
           "memory_bytes": spec["performance"]["memory_bytes"],
           "peak_bf16": spec["performance"]["peak_tflops"].get("bf16"),
           "dispatch_can_plan": gpu["dispatch_can_plan"], "nvlink": "nvlink" in spec["capabilities"]}
    assert got == expected
    assert (spec["platform"], spec["emulated"], gpu["nvml"]["index"]) == ("cuda", False, index)
    assert {"bf16", "tf32", "fp16", "tensor_cores"} <= set(spec["capabilities"])
    assert (gpu["rule"], gpu["compute_dtype"], gpu["registered_by_worker"]) == ("cuda-bf16", "bf16", None)


def test_an_uncatalogued_gpu_is_named_as_one_the_dispatcher_cannot_plan_on(check):
    (note,) = check["notes"]
    assert "NVIDIA RTX 6000 Ada Generation" in note and "catalog" in note


def test_the_compile_service_built_the_cuda_bf16_rule_for_the_job_and_for_each_probed_gpu(check):
    builds = {b["target_type"]: b for b in check["compile"]["builds"]}
    assert set(builds) == {"cuda@cpu:h100-sxm-80gb[bf16]", "cuda:h200-sxm-141gb[bf16]", "cuda:a100-80gb[bf16]",
                           "cuda:rtx-6000-ada-generation[bf16]"}
    assert check["compile"]["job_target_type"] == "cuda@cpu:h100-sxm-80gb[bf16]"
    for build in builds.values():
        assert (build["rule"], build["compute_dtype"], build["tolerance"]) == ("cuda-bf16", "bf16", BF16_TOLERANCE)
        assert build["portable"]["format"] == "stablehlo" and build["portable"]["size_bytes"] > 0
    emulated = builds["cuda@cpu:h100-sxm-80gb[bf16]"]
    executables = [(a["format"], a["batch_size"], a["platform"]) for a in emulated["executables"]]
    assert executables == [("executable", ROWS, "cpu")]
    # built on this CPU host, finished by a worker
    for real in ("cuda:h200-sxm-141gb[bf16]", "cuda:a100-80gb[bf16]", "cuda:rtx-6000-ada-generation[bf16]"):
        assert builds[real]["portable"]["platform"] == "cuda"
        assert (builds[real]["executables"], builds[real]["worker_finishes_compile"]) == ([], True)
    summary = check["summary"]
    assert (summary["rule"], summary["compute_dtype"]) == ("cuda-bf16", "bf16") and summary["compile_seconds"] > 0


def test_both_jobs_succeeded_on_the_emulated_device_with_that_rule(check):
    runs = check["job"]["runs"]
    assert [r["state"] for r in runs] == ["succeeded", "succeeded"]
    for run in runs:
        assert sum(s["rows"] for s in run["shards"]) == ROWS
        placed = {(s["device_id"], s["rule"], s["attempts"]) for s in run["shards"]}
        assert placed == {("127.0.0.1/cuda:0", "cuda-bf16", 1)}
    assert check["summary"]["jobs_succeeded"] == 2


def test_the_jobs_ran_on_the_direct_data_path_with_a_relayed_one_beside_them(check):
    runs = check["job"]["runs"]
    assert check["job"]["data_path"] == "direct"
    for run in runs:
        assert (run["asked_data_path"], run["data_path"]) == ("direct", "direct")
        # The worker is on this host: the tokens in and the logits out, every byte by shared memory.
        assert run["input_bytes"] == ROWS * SEQ_LEN * np.dtype(np.int32).itemsize and run["output_bytes"] > 0
        assert run["moved_bytes"] == {SHARED: run["input_bytes"] + run["output_bytes"]}
    relayed = check["job"]["relay_run"]
    assert (relayed["state"], relayed["asked_data_path"], relayed["data_path"], relayed["moved_bytes"]) == (
        "succeeded", "relay", "relay", {})
    assert sum(s["rows"] for s in relayed["shards"]) == ROWS
    summary = check["summary"]
    assert (summary["data_path"], summary["moved_bytes"]) == ("direct", runs[-1]["moved_bytes"])
    assert summary["relay_job_succeeded"] is True


def test_the_logits_match_the_cpu_fp32_reference_within_the_bf16_tolerance(check):
    accuracy = check["accuracy"]
    assert accuracy["ok"] and accuracy["tolerance"] == BF16_TOLERANCE
    assert len(accuracy["runs"]) == 2
    for compared in [*accuracy["runs"], accuracy["relay_run"], check["baseline"]["accuracy"]]:
        assert compared["ok"] and compared["all_finite"]
        # Above 0: the bf16 build really computed in bf16; within the rule's bound of fp32.
        assert 0 < compared["relative_error"] <= BF16_TOLERANCE


def test_throughput_is_reported_per_device_beside_the_baseline(check):
    flow = check["throughput"]
    (device,) = flow["per_device"].values()
    assert device["rows"] == ROWS and device["rows_per_s_execute"] > 0 and device["rows_per_s_shard"] > 0
    assert flow["job_rows_per_s"] > 0 and flow["baseline_rows_per_s"] > 0 and flow["ratio_job_over_baseline"] > 0
    assert check["baseline"]["rows"] == ROWS
    # The mesh's rows/s on each data path, each as a ratio to the bare device's; the figures above are the direct's.
    assert flow["data_path"] == "direct" and set(flow["by_data_path"]) == {"direct", "relay"}
    assert flow["by_data_path"]["direct"] == {"job_rows_per_s": flow["job_rows_per_s"],
                                              "ratio_job_over_baseline": flow["ratio_job_over_baseline"]}
    for figures in flow["by_data_path"].values():
        assert figures["job_rows_per_s"] > 0 and figures["ratio_job_over_baseline"] > 0


def test_no_driver_is_a_failure_with_a_non_zero_exit(tmp_path):
    # The repository's fake, its library missing: what pynvml answers on a machine without the driver.
    missing = tmp_path / "nvml_missing.py"
    missing.write_text(FAKE_NVML.read_text() + "\n\n_Present = FakeNvml\n\n\nclass FakeNvml(_Present):\n"
                       "    def __init__(self, gpus):\n        super().__init__(gpus, library_missing=True)\n")
    returncode, result = run_check("--cpu", "--fake-nvml", str(missing))
    assert (returncode, result["ok"], result["nvml"]["gpus"]) == (1, False, [])
    assert result["failures"] == ["NVML found no NVIDIA GPU (no driver, or no GPU visible to this process)"]
    assert "job" not in result
