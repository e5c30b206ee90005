"""Shared by the compile service tests: a served CompileService, and an uploadable jax.export
artifact with the UploadProgram stream that carries it."""

from __future__ import annotations

import contextlib
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from accelmesh.compile.v1 import compile_service_pb2 as pb
from accelmesh.compile.v1 import compile_service_pb2_grpc
from accelmesh.compile.v1 import program_pb2 as program_pb
from accelmesh.runtime.channels import open_channel
from compile_svc.config import CompileConfig
from compile_svc.server import build_compile_service


def compile_config_at(root: Path) -> CompileConfig:
    """A compile service on a free port keeping its artifacts and uploads under `root`."""
    return CompileConfig(listen="127.0.0.1:0", cache_dir=str(root / "artifacts"), programs_dir=str(root / "programs"))


@pytest.fixture(name="compile_config")
def compile_config_fixture(tmp_path):
    return compile_config_at(tmp_path)


@pytest.fixture(name="service")
def service_fixture(compile_config):
    with serving(compile_config) as running:
        yield running


@contextlib.contextmanager
def serving(config: CompileConfig):
    """(stub, compiler) of a compile service started from `config`, stopped on exit."""
    server, compiler = build_compile_service(config)
    server.start()
    try:
        with open_channel(f"127.0.0.1:{server.port}") as channel:
            yield compile_service_pb2_grpc.CompileServiceStub(channel), compiler
    finally:
        server.stop(0)


def exported_affine(offset: float = 1.0) -> bytes:
    """x @ w + offset over a symbolic batch, serialized for the CPU."""
    def affine(x, w):
        return (x @ w + offset,)

    b = jax.export.symbolic_shape("b")
    args = (jax.ShapeDtypeStruct((b[0], 3), jnp.float32), jax.ShapeDtypeStruct((3, 2), jnp.float32))
    return jax.export.export(jax.jit(affine), platforms=["cpu"])(*args).serialize()


def upload(stub, data, name="affine", total=None, chunk=1000, combine=(program_pb.COMBINE_RULE_CONCAT,), version="1"):
    header = pb.UploadHeader(name=name, version=version, input_names=["x", "w"], output_combine=list(combine),
                             total_bytes=len(data) if total is None else total)
    parts = [pb.UploadProgramRequest(header=header)]
    parts += [pb.UploadProgramRequest(chunk=bytes(data[i:i + chunk])) for i in range(0, len(data), chunk)]
    return stub.UploadProgram(iter(parts))
