"""The compile service under abusive requests, through a real server: every limit a request can
run into (name and version lengths, header fields, one artifact's bytes, the uploads kept and
their bytes, batch sizes) is refused with a short message naming the limit and how to raise it,
an endless upload stream is cut off, and uploads whose versions differ after a dot keep files of
their own across a restart."""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import logging

import grpc
import pytest
from _service_helpers import (  # noqa: F401 (fixtures)
    compile_config_fixture,
    exported_affine,
    service_fixture,
    serving,
    upload,
)

from accelmesh import errors
from accelmesh.compile.v1 import compile_service_pb2 as pb
from accelmesh.compile.v1 import program_pb2 as program_pb
from accelmesh.hardware.catalog import resolve_type
from accelmesh.runtime.devices import device_to_proto
from accelmesh.security.identity import Role
from compile_svc.config import CompileConfig, parse_args
from compile_svc.programs import ProgramRegistry
from compile_svc.uploads import UploadStore

from conftest import CREDENTIALS, rpc_error

V100 = device_to_proto(resolve_type("v100-32gb").device_spec("127.0.0.1", 0, emulated_on="cpu:0"))
CALL_TIMEOUT_S = 30.0  # a stream the server failed to cut off ends as DEADLINE_EXCEEDED, not a hang
HUGE = "x" * 100_000
CONCAT = (program_pb.COMBINE_RULE_CONCAT,)


def refs(stub) -> dict[str, str]:
    return {f"{p.name}@{p.version}": p.digest for p in stub.ListPrograms(pb.ListProgramsRequest()).programs}


def header(data: bytes, name="affine", version="1", **fields) -> pb.UploadProgramRequest:
    fields.setdefault("input_names", ["x", "w"])
    fields.setdefault("output_combine", list(CONCAT))
    return pb.UploadProgramRequest(header=pb.UploadHeader(name=name, version=version, total_bytes=len(data), **fields))


def limited(config: CompileConfig, **limits) -> CompileConfig:
    return dataclasses.replace(config, **limits)


def endless(first: pb.UploadProgramRequest, chunk: bytes = b"\0" * 1024):
    yield first
    for _ in itertools.count():
        yield pb.UploadProgramRequest(chunk=chunk)


# --- versions with dots ---------------------------------------------------------------------------

def test_versions_one_dot_zero_and_one_dot_one_both_survive_a_restart_with_their_own_bytes(compile_config):
    artifacts = {"1.0": exported_affine(1.0), "1.1": exported_affine(1.1)}
    with serving(compile_config) as (stub, _):
        for version, data in artifacts.items():
            upload(stub, data, version=version)
    with serving(compile_config) as (restarted, _):
        found = refs(restarted)
        for version, data in artifacts.items():
            assert found[f"affine@{version}"] == hashlib.sha256(data).hexdigest()
        assert found["affine@1.0"] != found["affine@1.1"]
        assert restarted.Compile(pb.CompileRequest(program="affine", version="1.0", targets=[V100])).version == "1.0"


def test_a_stored_artifact_that_is_not_its_sidecars_is_skipped(tmp_path, caplog):
    store = UploadStore(tmp_path, ProgramRegistry(), max_bytes=1 << 20)
    store.upload("affine", "1.0", exported_affine(1.0), ["concat"])
    store.upload("affine", "1.1", exported_affine(1.1), ["concat"])
    (tmp_path / "affine@1.1.jaxexport").write_bytes((tmp_path / "affine@1.0.jaxexport").read_bytes())
    again = UploadStore(tmp_path, ProgramRegistry(), max_bytes=1 << 20)
    with caplog.at_level(logging.WARNING):
        assert again.restore() == 1
    assert [p.ref for p in again.registry.list()] == ["affine@1.0"]
    assert "affine@1.1.json" in caplog.text and "not the artifact its sidecar was written for" in caplog.text


def test_a_sidecar_from_before_digests_still_restores(tmp_path):
    data = exported_affine(2.0)
    (tmp_path / "affine@2.jaxexport").write_bytes(data)
    (tmp_path / "affine@2.json").write_text(json.dumps(
        {"name": "affine", "version": "2.5", "combine": ["concat"], "input_names": [], "description": ""}))
    store = UploadStore(tmp_path, ProgramRegistry(), max_bytes=1 << 20)
    assert store.restore() == 1
    assert store.registry.get("affine", "2.5").digest == hashlib.sha256(data).hexdigest()
    assert (tmp_path / "affine@2.5.jaxexport").exists() and not (tmp_path / "affine@2.json").exists()


# --- names and versions ---------------------------------------------------------------------------

@pytest.mark.parametrize("call, field, limit", [
    (lambda s: s.Compile(pb.CompileRequest(program=HUGE, targets=[V100])), "program", 128),
    (lambda s: s.Compile(pb.CompileRequest(program="affine", version=HUGE, targets=[V100])), "version", 128),
    (lambda s: s.DescribeProgram(pb.DescribeProgramRequest(name=HUGE)), "name", 128),
    (lambda s: s.DescribeProgram(pb.DescribeProgramRequest(name="identity", version=HUGE)), "version", 128),
    (lambda s: list(s.FetchParameters(pb.FetchParametersRequest(program=HUGE))), "program", 128),
    (lambda s: s.DeleteProgram(pb.DeleteProgramRequest(name=HUGE, version="1")), "name", 128),
    (lambda s: upload(s, b"abc", name=HUGE), "header.name", 128),
    (lambda s: upload(s, b"abc", version=HUGE), "header.version", 64),
])
def test_a_hundred_kilobyte_name_is_invalid_argument_with_a_short_message(service, call, field, limit):
    stub, _ = service
    error = rpc_error(call, stub)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT  # not RESOURCE_EXHAUSTED "metadata size exceeds"
    assert len(error.details()) < 300
    assert all(words in error.details() for words in (field, "(100000 chars)", str(limit)))


def test_the_longest_name_and_version_are_stored_and_restored(compile_config):
    name, version = "n" * 128, "v" * 64
    with serving(compile_config) as (stub, _):
        upload(stub, exported_affine(), name=name, version=version)
        error = rpc_error(upload, stub, exported_affine(), name=name, version="v" * 65)
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "1-64" in error.details()
    with serving(compile_config) as (restarted, _):
        assert f"{name}@{version}" in refs(restarted)


# --- the upload header ----------------------------------------------------------------------------

@pytest.mark.parametrize("fields, words", [
    ({"description": "d" * 4097}, ["header.description", "4097", "4096"]),
    ({"input_names": ["x", "w" * 129]}, ["header.input_names[1]", "(129 chars)", "128"]),
    ({"input_names": ["i"] * 1025}, ["header.input_names", "1025", "1024"]),
    ({"output_combine": list(CONCAT) * 1025}, ["header.output_combine", "1025", "1024"]),
])
def test_header_fields_past_their_limits_are_refused_before_the_artifact_streams(service, fields, words):
    stub, _ = service
    error = rpc_error(stub.UploadProgram, endless(header(exported_affine(), **fields)), timeout=CALL_TIMEOUT_S)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert all(word in error.details() for word in words), error.details()
    assert "affine@1" not in refs(stub)


def test_a_description_at_the_limit_is_kept(service):
    stub, _ = service
    data = exported_affine()
    parts = [header(data, description="d" * 4096), pb.UploadProgramRequest(chunk=bytes(data))]
    assert stub.UploadProgram(iter(parts)).program.description == "d" * 4096


# --- bytes ----------------------------------------------------------------------------------------

def test_an_endless_upload_stream_is_cut_off_once_it_passes_its_declared_size(service):
    stub, _ = service
    error = rpc_error(stub.UploadProgram, endless(header(b"\0" * 4096)), timeout=CALL_TIMEOUT_S)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "more than header.total_bytes" in error.details()


def test_an_artifact_over_the_upload_limit_is_refused_at_the_header(compile_config):
    with serving(limited(compile_config, max_upload_bytes=4096)) as (stub, _):
        first = pb.UploadProgramRequest(header=pb.UploadHeader(name="affine", version="1", total_bytes=4097,
                                                               output_combine=list(CONCAT)))
        error = rpc_error(stub.UploadProgram, endless(first), timeout=CALL_TIMEOUT_S)
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert all(word in error.details() for word in ("4097", "4096", "ACCELMESH_MAX_UPLOAD_BYTES"))


# --- what the store keeps -------------------------------------------------------------------------

def test_uploads_past_the_count_limit_are_refused_until_one_is_deleted(compile_config):
    with serving(limited(compile_config, max_uploads=2)) as (stub, _):
        upload(stub, exported_affine(1.0), version="1")
        upload(stub, exported_affine(2.0), version="2")
        error = rpc_error(stub.UploadProgram, endless(header(exported_affine(3.0), version="3")),
                          timeout=CALL_TIMEOUT_S)
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert all(word in error.details() for word in ("2 uploaded versions", "ACCELMESH_MAX_UPLOADS"))
        stub.DeleteProgram(pb.DeleteProgramRequest(name="affine", version="1"))
        upload(stub, exported_affine(3.0), version="3")
        assert {"affine@2", "affine@3"} <= set(refs(stub)) and "affine@1" not in refs(stub)


def test_uploads_past_the_byte_limit_are_refused_at_the_header(compile_config):
    data = exported_affine()
    with serving(limited(compile_config, max_uploaded_bytes=len(data) + 100)) as (stub, _):
        upload(stub, data, version="1")
        error = rpc_error(stub.UploadProgram, endless(header(data, version="2")), timeout=CALL_TIMEOUT_S)
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert all(word in error.details() for word in (str(len(data)), "ACCELMESH_MAX_UPLOADED_BYTES"))


def test_stored_uploads_over_a_lowered_limit_are_all_restored_and_new_ones_refused(compile_config, caplog):
    with serving(compile_config) as (stub, _):
        for version in ("1", "2"):
            upload(stub, exported_affine(), version=version)
    with caplog.at_level(logging.WARNING), serving(limited(compile_config, max_uploads=1)) as (stub, _):
        assert {"affine@1", "affine@2"} <= set(refs(stub))
        assert rpc_error(upload, stub, exported_affine(), version="3").code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "over the limits" in caplog.text


def test_zero_uploads_allowed_refuses_every_upload(compile_config):
    with serving(limited(compile_config, max_uploads=0)) as (stub, _):
        assert rpc_error(upload, stub, exported_affine()).code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_the_upload_limits_are_read_from_the_environment():
    assert (CompileConfig().max_uploads, CompileConfig().max_uploaded_bytes) == (256, 4 * 1024**3)
    env = CREDENTIALS.env(Role.COMPILE)
    config = parse_args([], env={**env, "ACCELMESH_MAX_UPLOADS": "3", "ACCELMESH_MAX_UPLOADED_BYTES": "4096"})
    assert (config.max_uploads, config.max_uploaded_bytes) == (3, 4096)
    for variable in ("ACCELMESH_MAX_UPLOADS", "ACCELMESH_MAX_UPLOADED_BYTES"):
        with pytest.raises(errors.InvalidArgument, match=variable):
            parse_args([], env={**env, variable: "-1"})


# --- compile requests -----------------------------------------------------------------------------

def test_too_many_batch_sizes_name_the_limit_and_its_variable(service):
    stub, _ = service
    error = rpc_error(stub.Compile, pb.CompileRequest(program="mlp_classifier", targets=[V100],
                                                      batch_sizes=list(range(1, 100_001))))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert all(word in error.details() for word in ("100000 executables", "16", "ACCELMESH_MAX_BATCH_SIZES"))


def test_bad_batch_sizes_are_quoted_short(service):
    stub, _ = service
    error = rpc_error(stub.Compile, pb.CompileRequest(program="mlp_classifier", targets=[V100],
                                                      batch_sizes=[0] + [2**40] * 15))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "batch_sizes [0, 1099511627776" in error.details() and "(16 items)" in error.details()
    assert len(error.details()) < 300


def _jax_cached_executables() -> int:
    """Executables jax itself keeps compiled (its in-memory compilation cache, 2048 entries long)."""
    from jax._src.interpreters import pxla

    return pxla._cached_compilation.cache_info().currsize


def test_building_leaves_nothing_in_jax_caches(service):
    """jax keeps what it traced and compiled, about 0.7 MiB an executable: a client asking for
    ever new batch sizes grew the service without bound. The compiler clears them once no build
    is in progress; its own artifact cache is what serves a key again."""
    from test_rules import cpu_device

    _, compiler = service
    for first in (1, 17):
        result = compiler.compile("mlp_classifier", "", [cpu_device()], batch_sizes=list(range(first, first + 16)))
        assert len(result.builds[0].executables) == 16
        assert _jax_cached_executables() == 0
    again = compiler.compile("mlp_classifier", "", [cpu_device()], batch_sizes=[1])  # from the artifact cache
    assert again.builds[0].executables[0].cache_hit


def test_jax_caches_are_cleared_when_the_last_build_ends_and_only_then():
    import jax
    import jax.numpy as jnp

    from accelmesh.artifacts import JaxCaches

    caches = JaxCaches()
    with caches.building():
        with caches.building():
            jax.jit(lambda x: x * 3).lower(jnp.ones(5)).compile()
            caches.built()
        assert _jax_cached_executables() > 0  # another build is still in progress: kept
    assert _jax_cached_executables() == 0
    jax.jit(lambda x: x + 3).lower(jnp.ones(5)).compile()
    with caches.building():
        pass  # nothing built inside: not this build's to clear
    assert _jax_cached_executables() > 0
    jax.clear_caches()
