"""The tests' host (fakes/host.py): every worker the suite starts describes the fixture CPU it
was given and no GPU, and the worker settings that make it so are read and checked."""

from __future__ import annotations

import os

import pytest

from accelmesh.common.v1 import common_pb2
from accelmesh.errors import InvalidArgument
from accelmesh.runtime.launcher import start_service
from accelmesh.security.identity import Role
from accelmesh.worker.v1 import worker_service_pb2 as pb
from accelmesh.worker.v1 import worker_service_pb2_grpc
from worker_svc.config import parse_args
from worker_svc.probes.cpu import probe_cpu

from conftest import CREDENTIALS, mesh_stub
from fakes import host

pytestmark = pytest.mark.fixture_cpu


def test_the_environment_names_the_chosen_fixture_cpu_and_no_gpu():
    cpu = host.chosen_cpu()
    assert os.environ["ACCELMESH_PROC_ROOT"] == str(host.proc_root(cpu))
    assert (os.environ["ACCELMESH_WORKER_NVML"], os.environ["JAX_PLATFORMS"]) == ("0", "cpu")
    assert "XLA_FLAGS" not in os.environ


@pytest.mark.slow
def test_a_worker_process_describes_the_fixture_cpu_not_the_host():
    process = start_service("worker", "worker_svc",
                            ["--listen", "127.0.0.1:0", "--devices", "2", "--emulate", "v100-32gb"],
                            env=CREDENTIALS.env(Role.WORKER))
    try:
        stub = mesh_stub(worker_service_pb2_grpc.WorkerServiceStub, process.address)
        node = stub.DescribeNode(pb.DescribeNodeRequest(), timeout=30)
    finally:
        process.terminate()
    fixture = probe_cpu(host.proc_root(), env={})
    cuda, cpu = common_pb2.PLATFORM_CUDA, common_pb2.PLATFORM_CPU
    assert [(d.platform, d.emulated) for d in node.devices] == [(cuda, True), (cpu, False)]  # no GPU of the host
    cpu = node.devices[1]
    assert cpu.kind == f"{fixture.model} (1/2 of host)"
    assert set(cpu.capabilities) == fixture.capabilities
    assert cpu.performance.memory_bytes == fixture.memory_total_bytes // 2


def test_worker_reads_its_proc_root_and_nvml_switch_from_flags_over_the_environment():
    bare = CREDENTIALS.env(Role.WORKER)  # nothing set but the worker's credentials
    env = {**bare, "ACCELMESH_PROC_ROOT": "/host/proc", "ACCELMESH_WORKER_NVML": "off"}
    assert (parse_args([], env=bare).proc_root, parse_args([], env=bare).nvml) == ("/proc", True)
    assert (parse_args([], env=env).proc_root, parse_args([], env=env).nvml) == ("/host/proc", False)
    flags = parse_args(["--proc-root", "/other", "--nvml"], env=env)
    assert (flags.proc_root, flags.nvml) == ("/other", True)
    assert parse_args(["--no-nvml"], env=bare).nvml is False


def test_a_switch_that_is_not_a_boolean_is_refused_naming_the_variable():
    with pytest.raises(InvalidArgument, match=r"ACCELMESH_WORKER_NVML='maybe' is not a boolean; set it to 1 or 0"):
        parse_args([], env={"ACCELMESH_WORKER_NVML": "maybe"})


@pytest.mark.parametrize("name", host.FIXTURE_CPUS)
def test_each_fixture_cpu_is_a_whole_proc_root(name):
    cpu = probe_cpu(host.proc_root(name), env={})
    assert cpu.logical_cores > 0 and cpu.memory_total_bytes > 0
    assert ("bf16" in cpu.capabilities) == (name == host.BF16_CPU)


def test_an_unknown_fixture_cpu_is_refused_with_the_choices():
    with pytest.raises(SystemExit, match="ACCELMESH_TEST_CPU='epyc'.*sapphire_rapids"):
        host.chosen_cpu({"ACCELMESH_TEST_CPU": "epyc"})
