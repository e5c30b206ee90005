"""The model zoo in the registry and the compile service: the zoo is listed at start-up without
being built and each deferred entry is built once on first use; over gRPC the big models are
listed and described but never materialised (the parameter limit, and where it is configured).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import grpc
import pytest

from accelmesh import errors
from accelmesh.compile.v1 import compile_service_pb2 as pb
from accelmesh.compile.v1 import compile_service_pb2_grpc
from accelmesh.runtime.channels import open_channel
from accelmesh.security.identity import Role
from compile_svc.config import CompileConfig, parse_args
from compile_svc.programs import ProgramRegistry, default_registry
from compile_svc.programs.layers import DeferredEntry
from compile_svc.programs.zoo import gpt2
from compile_svc.server import build_compile_service

from conftest import CREDENTIALS, peak_rss_bytes, rpc_error

ZOO_NAMES = ("gpt2_xl", "bert_large", "llama_7b", "vit_l16")


# --- registry: listed at start-up, built on first use --------------------------------------------

def test_start_up_lists_the_zoo_without_building_it():
    script = (
        "from compile_svc.programs import default_registry\n"
        "from compile_svc.programs.zoo import bert, gpt2, llama, vit\n"
        "default_registry()\n"
        "built = [f.cache_info().currsize for f in (gpt2.gpt2_program, gpt2.gpt2_entry, bert.bert_entry,\n"
        "         llama.llama_program, llama.llama_entry, vit.vit_entry)]\n"
        "print(sum(built))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True,
                         env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert out.stdout.split() == ["0"]


def test_deferred_entries_build_once_under_concurrent_first_use():
    calls = {"summary": 0, "entry": 0}
    base = gpt2.gpt2_entry(gpt2.GPT2_TINY)

    def summary():
        calls["summary"] += 1
        return gpt2.gpt2_program(gpt2.GPT2_TINY)

    def entry():
        calls["entry"] += 1
        return base

    registry = ProgramRegistry()
    registry.register_deferred(DeferredEntry("gpt2_tiny", "1", summary, entry))
    assert [p.name for p in registry.list()] == ["gpt2_tiny"] and calls == {"summary": 1, "entry": 0}
    threads = [threading.Thread(target=registry.get, args=("gpt2_tiny",)) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert calls == {"summary": 1, "entry": 1}
    assert registry.get("gpt2_tiny").layers == base.program.layers
    assert registry.layer_functions("gpt2_tiny") == base.layer_fns
    assert registry.list()[0].layers  # once built, the listing is the full program


def test_default_registry_lists_the_zoo():
    names = {p.name for p in default_registry().list()}
    assert set(ZOO_NAMES) <= names


def test_the_parameter_limit_is_read_from_the_environment():
    assert CompileConfig().max_parameter_bytes == 2 * 1024**3
    env = CREDENTIALS.env(Role.COMPILE)  # a compile service starts only with its credentials
    assert parse_args([], env={**env, "ACCELMESH_MAX_PARAMETER_BYTES": "4096"}).max_parameter_bytes == 4096
    with pytest.raises(errors.InvalidArgument, match="ACCELMESH_MAX_PARAMETER_BYTES"):
        parse_args([], env={**env, "ACCELMESH_MAX_PARAMETER_BYTES": "lots"})


# --- over gRPC ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def stub_for(tmp_path_factory):
    """Start compile services (one per limit) on port 0; each is stopped at the end."""
    servers, channels, stubs = [], [], {}

    def make(max_parameter_bytes: int = CompileConfig.max_parameter_bytes):
        if max_parameter_bytes not in stubs:
            root = tmp_path_factory.mktemp("compile")
            config = CompileConfig(listen="127.0.0.1:0", cache_dir=str(root / "artifacts"),
                                   programs_dir=str(root / "programs"), max_parameter_bytes=max_parameter_bytes)
            server, _ = build_compile_service(config)
            servers.append(server.start())
            channel = open_channel(f"127.0.0.1:{server.port}")
            channels.append(channel)
            stubs[max_parameter_bytes] = compile_service_pb2_grpc.CompileServiceStub(channel)
        return stubs[max_parameter_bytes]

    yield make
    for channel in channels:
        channel.close()
    for server in servers:
        server.stop(0)


def test_fetching_parameters_of_a_published_size_model_is_resource_exhausted(stub_for):
    stub = stub_for()
    peak = peak_rss_bytes(os.getpid())
    error = rpc_error(lambda: list(stub.FetchParameters(pb.FetchParametersRequest(program="gpt2_xl"))))
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    size = 4 * 1_557_611_200
    assert all(word in error.details() for word in ("gpt2_xl@1", str(size), str(2 * 1024**3), "planning"))
    assert peak_rss_bytes(os.getpid()) - peak < 1024**3  # the 6 GB of weights were never made


def test_the_parameter_limit_is_configurable(stub_for):
    """A small model under the default limit streams (test_compile_service); under 1 KiB it cannot."""
    error = rpc_error(lambda: list(stub_for(1024).FetchParameters(
        pb.FetchParametersRequest(program="mlp_classifier"))))
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    mlp_bytes = 4 * (64 * 128 + 128 + 128 * 128 + 128 + 128 * 10 + 10)
    assert all(word in error.details() for word in ("mlp_classifier@1", str(mlp_bytes), "1024"))


def test_zoo_is_listed_and_llama_7b_is_described_over_grpc(stub_for):
    stub = stub_for()
    listed = {p.name: p for p in stub.ListPrograms(pb.ListProgramsRequest()).programs}
    assert listed["gpt2_xl"].parameter_count == 1_557_611_200
    program = stub.DescribeProgram(pb.DescribeProgramRequest(name="llama_7b")).program
    assert len(program.layers) == 35
    total = sum(layer.parameter_count for layer in program.layers)
    assert total == program.parameter_count
    assert abs(total - 6_738_415_616) / 6_738_415_616 < 0.01
    assert list(program.inputs[0].shape) == [-1, 2048]


def test_gpt2_xl_is_described_over_grpc_with_its_tied_head(stub_for):
    program = stub_for().DescribeProgram(pb.DescribeProgramRequest(name="gpt2_xl")).program
    assert len(program.layers) == 50
    head = program.layers[-1]
    assert (head.name, head.shared_from, head.shared_parameter_bytes) == ("head", "embed", 50257 * 1600 * 4)
