"""CompileService through a real in-process server: rules per device, one build per target type,
the on-disk cache across processes, uploads, and every bad input's status code."""

from __future__ import annotations

import dataclasses
import hashlib
import threading

import grpc
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _service_helpers import (  # noqa: F401 (fixtures)
    compile_config_at,
    compile_config_fixture,
    exported_affine,
    service_fixture,
    serving,
    upload,
)

from accelmesh import artifacts, errors
from accelmesh.compile.v1 import build_pb2 as build_pb
from accelmesh.compile.v1 import compile_service_pb2 as pb
from accelmesh.compile.v1 import compile_service_pb2_grpc
from accelmesh.compile.v1 import program_pb2 as program_pb
from accelmesh.hardware.catalog import resolve_type
from accelmesh.reference import reference_outputs
from accelmesh.runtime.channels import open_channel
from accelmesh.runtime.devices import device_to_proto
from accelmesh.runtime.launcher import start_service
from compile_svc.programs import default_registry
from compile_svc.server import build_compile_service

from conftest import rpc_error


def device(type_name, index=0, emulated_on="cpu:0", ip="127.0.0.1"):
    return device_to_proto(resolve_type(type_name).device_spec(ip, index, emulated_on=emulated_on))


def fetch(stub, key):
    parts = list(stub.FetchArtifact(pb.FetchArtifactRequest(key=key, chunk_bytes=4096)))
    data = b"".join(p.chunk for p in parts)
    assert len(data) == parts[0].total_bytes
    assert hashlib.sha256(data).hexdigest() == parts[0].digest
    return data


def test_programs_are_listed_and_the_transformer_layer_table_sums_to_its_total(service):
    stub, _ = service
    names = {(p.name, p.version) for p in stub.ListPrograms(pb.ListProgramsRequest()).programs}
    assert {("mlp_classifier", "1"), ("transformer_encoder", "1"), ("mlp_train_step", "1")} <= names
    program = stub.DescribeProgram(pb.DescribeProgramRequest(name="transformer_encoder")).program
    assert [layer.name for layer in program.layers] == ["embed", "block_0", "block_1", "block_2", "block_3", "head"]
    assert sum(layer.parameter_count for layer in program.layers) == program.parameter_count > 0
    assert all(layer.flops_per_sample > 0 for layer in program.layers)
    assert program.inputs[0].shape[0] == -1  # the symbolic batch


def test_same_program_built_differently_for_a_device_with_bf16_and_one_without(service):
    stub, _ = service
    response = stub.Compile(pb.CompileRequest(program="mlp_classifier",
                                              targets=[device("a100-80gb"), device("v100-32gb", 1, "cpu:1")]))
    builds = {b.rule.name: b for b in response.builds}
    assert set(builds) == {"cuda-bf16", "cuda-fp32"}
    bf16_text = artifacts.hlo_text(fetch(stub, builds["cuda-bf16"].portable.key))
    fp32_text = artifacts.hlo_text(fetch(stub, builds["cuda-fp32"].portable.key))
    assert "xbf16>" in bf16_text and "xbf16>" not in fp32_text

    program = default_registry().get("mlp_classifier")
    params = program.init_params(0)
    x = np.random.default_rng(0).standard_normal((6, 64)).astype(np.float32)
    (reference,) = program.fn(*params, x)
    for build in builds.values():
        exported = artifacts.load_portable(fetch(stub, build.portable.key))
        (out,) = artifacts.run_portable(exported, lowering_options(build), *params, x)
        error = float(jnp.max(jnp.abs(out - reference)) / jnp.max(jnp.abs(reference)))
        assert error <= build.rule.build.tolerance, (build.rule.name, error)
        assert out.dtype == jnp.float32  # interfaces keep their declared dtypes


def lowering_options(build):
    from accelmesh.programs import BuildOptions

    b = build.rule.build
    return BuildOptions(b.compute_dtype, b.matmul_precision, b.remat, dict(b.xla_options), b.tolerance)


@pytest.mark.parametrize("type_name, platform", [("a100-80gb", "cuda"), ("mi250x", "rocm"), ("tpu-v4", "tpu")])
def test_artifacts_for_platforms_this_machine_lacks_are_portable_stablehlo(service, type_name, platform):
    stub, _ = service
    response = stub.Compile(pb.CompileRequest(program="transformer_encoder", batch_sizes=[8],
                                              targets=[device(type_name, emulated_on="")]))
    (build,) = response.builds
    assert build.portable.platform == platform and build.portable.format == build_pb.ARTIFACT_FORMAT_STABLEHLO
    assert list(build.executables) == []  # nothing here can compile for that backend
    assert artifacts.load_portable(fetch(stub, build.portable.key)).platforms == (platform,)


def test_six_devices_of_two_types_are_compiled_exactly_twice(service):
    stub, compiler = service
    targets = ([device("a100-80gb", i, f"cpu:{i}") for i in range(3)]
               + [device("v100-32gb", i, f"cpu:{i + 3}") for i in range(3, 6)])
    response = stub.Compile(pb.CompileRequest(program="mlp_classifier", targets=targets))
    assert compiler.cache.builds == 2
    assert sorted(len(b.device_ids) for b in response.builds) == [3, 3]
    assert all(not b.portable.cache_hit for b in response.builds)


def test_local_targets_also_get_executables_for_the_planned_batch_sizes(service):
    stub, _ = service
    response = stub.Compile(pb.CompileRequest(program="mlp_classifier", targets=[device("a100-80gb")],
                                              batch_sizes=[16, 4]))
    (build,) = response.builds
    assert [e.batch_size for e in build.executables] == [4, 16]
    assert all(e.format == build_pb.ARTIFACT_FORMAT_EXECUTABLE for e in build.executables)
    program = default_registry().get("mlp_classifier")
    params = program.init_params(0)
    x = np.ones((4, 64), np.float32)
    (out,) = artifacts.load_executable(fetch(stub, build.executables[0].key))(*params, x)
    (reference,) = program.fn(*params, x)
    assert float(jnp.max(jnp.abs(out - reference))) <= build.rule.build.tolerance * float(jnp.max(jnp.abs(reference)))


def test_eight_concurrent_identical_compile_calls_compile_once(service):
    stub, compiler = service
    barrier = threading.Barrier(8)
    results, failures = [], []

    def call():
        barrier.wait()
        try:
            results.append(stub.Compile(pb.CompileRequest(program="transformer_encoder",
                                                          targets=[device("a100-80gb")])))
        except grpc.RpcError as exc:  # pragma: no cover - reported below
            failures.append(exc)

    threads = [threading.Thread(target=call) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures and len(results) == 8
    assert compiler.cache.builds == 1
    assert len({r.builds[0].portable.key for r in results}) == 1


def test_a_second_process_reuses_the_on_disk_cache(service, compile_config):
    stub, _ = service
    first = stub.Compile(pb.CompileRequest(program="mlp_classifier", targets=[device("v100-32gb")], batch_sizes=[8]))
    other = start_service("compile", "compile_svc", ["--listen", "127.0.0.1:0", "--cache-dir", compile_config.cache_dir,
                                                       "--programs-dir", compile_config.programs_dir])
    try:
        with open_channel(other.address) as channel:
            again = compile_service_pb2_grpc.CompileServiceStub(channel).Compile(
                pb.CompileRequest(program="mlp_classifier", targets=[device("v100-32gb")], batch_sizes=[8]))
    finally:
        other.terminate()
    (before,), (after,) = first.builds, again.builds
    assert after.portable.key == before.portable.key and after.portable.cache_hit and after.portable.build_seconds == 0
    assert [e.cache_hit for e in after.executables] == [True]


def test_an_uploaded_export_round_trips_compiles_and_executes(service, compile_config):
    stub, _ = service
    program = upload(stub, exported_affine()).program
    assert program.kind == program_pb.PROGRAM_KIND_UPLOADED
    assert [list(i.shape) for i in program.inputs] == [[-1, 3], [3, 2]]
    response = stub.Compile(pb.CompileRequest(program="affine", targets=[device("v100-32gb")]))
    exported = artifacts.load_portable(fetch(stub, response.builds[0].portable.key))
    x, w = np.arange(15, dtype=np.float32).reshape(5, 3), np.ones((3, 2), np.float32)
    (out,) = artifacts.run_portable(exported, lowering_options(response.builds[0]), x, w)
    np.testing.assert_allclose(out, x @ w + 1.0)
    # Uploads survive a restart of the service.
    server, restarted = build_compile_service(compile_config)
    assert ("affine", "1") in {(p.name, p.version) for p in restarted.registry.list()}
    server.stop(0)


@pytest.mark.parametrize(
    "data, total, code, words",
    [
        (b"not an export at all", None, grpc.StatusCode.INVALID_ARGUMENT, "not a serialized jax.export"),
        (b"x" * 10, 10**12, grpc.StatusCode.RESOURCE_EXHAUSTED, "upload limit"),
        (b"abcdef", 3, grpc.StatusCode.INVALID_ARGUMENT, "more than header.total_bytes"),
        (b"abc", 6, grpc.StatusCode.INVALID_ARGUMENT, "stream ended"),
    ],
)
def test_bad_uploads_are_refused(service, data, total, code, words):
    stub, _ = service
    error = rpc_error(upload, stub, data, total=total)
    assert error.code() == code and words in error.details()
    assert "affine" not in {p.name for p in stub.ListPrograms(pb.ListProgramsRequest()).programs}


def test_an_upload_without_header_or_with_bad_combine_is_refused(service):
    stub, _ = service
    error = rpc_error(stub.UploadProgram, iter([pb.UploadProgramRequest(chunk=b"x")]))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "header" in error.details()
    error = rpc_error(upload, stub, exported_affine(), combine=(program_pb.COMBINE_RULE_UNSPECIFIED,))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "output_combine[0]" in error.details()


def spec(name, dtype, shape):
    return program_pb.TensorSpec(name=name, dtype=dtype, shape=shape)


@pytest.mark.parametrize(
    "request_fields, code, words",
    [
        ({"program": "no_such_program", "targets": [device("t4")]}, grpc.StatusCode.NOT_FOUND, "no_such_program"),
        ({"program": "mlp_classifier", "version": "9", "targets": [device("t4")]}, grpc.StatusCode.NOT_FOUND, "9"),
        ({"program": "", "targets": [device("t4")]}, grpc.StatusCode.INVALID_ARGUMENT, "program"),
        ({"program": "mlp_classifier"}, grpc.StatusCode.INVALID_ARGUMENT, "targets"),
        ({"program": "mlp_classifier", "targets": [device("t4")], "batch_sizes": [0]},
         grpc.StatusCode.INVALID_ARGUMENT, "batch_sizes"),
        ({"program": "transformer_encoder", "targets": [device("t4")], "inputs": [spec("tokens", 1, [-1, 32])]},
         grpc.StatusCode.INVALID_ARGUMENT, "tokens"),
        ({"program": "transformer_encoder", "targets": [device("t4")], "inputs": [spec("tokens", 7, [-1, 16])]},
         grpc.StatusCode.INVALID_ARGUMENT, "tokens"),
        ({"program": "transformer_encoder", "targets": [device("t4")], "inputs": [spec("tokens", 7, [-1])]},
         grpc.StatusCode.INVALID_ARGUMENT, "tokens"),
    ],
)
def test_compile_rejects_bad_requests(service, request_fields, code, words):
    stub, _ = service
    error = rpc_error(stub.Compile, pb.CompileRequest(**request_fields))
    assert error.code() == code and words in error.details()


def test_a_compile_xla_refuses_is_failed_precondition_and_the_service_keeps_serving(tmp_path, compile_config):
    rules = tmp_path / "rules.toml"
    rules.write_text(
        '[[rule]]\nname = "broken"\ndescription = "an option XLA does not know"\n'
        '[rule.match]\nplatform = "cpu"\n[rule.build]\nxla_options = { xla_no_such_option_here = 1 }\n'
        '[[rule]]\nname = "default"\ndescription = "catch-all"\n'
    )
    server, _ = build_compile_service(dataclasses.replace(compile_config, rules=str(rules)))
    server.start()
    try:
        with open_channel(f"127.0.0.1:{server.port}") as channel:
            stub = compile_service_pb2_grpc.CompileServiceStub(channel)
            a100 = resolve_type("a100-80gb").device_spec("127.0.0.1", 0)
            cpu = device_to_proto(a100.replace(platform="cpu", id="127.0.0.1/cpu:0", type="cpu"))
            error = rpc_error(stub.Compile, pb.CompileRequest(program="mlp_classifier", targets=[cpu], batch_sizes=[2]))
            assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "xla_no_such_option_here" in error.details()
            assert stub.ListRules(pb.ListRulesRequest()).rules[0].name == "broken"
    finally:
        server.stop(0)


def test_list_and_explain_rules(service):
    stub, _ = service
    rules = stub.ListRules(pb.ListRulesRequest())
    assert rules.rules[-1].name == "default-fp32" and rules.origin.endswith("compile_rules.toml")
    explained = stub.ExplainRule(pb.ExplainRuleRequest(device=device("t4")))
    assert explained.rule.name == "cuda-fp32-small" and explained.rule.build.remat
    assert [v.matched for v in explained.verdicts][-1] and not any(v.matched for v in explained.verdicts[:-1])
    assert "requires bf16" in explained.verdicts[1].reason
    assert explained.target_type == "cuda@cpu:t4[]"
    error = rpc_error(stub.ExplainRule, pb.ExplainRuleRequest())
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_fetching_an_unknown_artifact_is_not_found(service):
    stub, _ = service
    error = rpc_error(lambda: list(stub.FetchArtifact(pb.FetchArtifactRequest(key="0" * 64))))
    assert error.code() == grpc.StatusCode.NOT_FOUND


def test_initial_parameters_stream_in_program_order_and_are_deterministic(service):
    from accelmesh.runtime.tensors import TensorAssembler

    stub, _ = service

    def fetch_params(seed):
        leaves, assembler = [], None
        for part in stub.FetchParameters(pb.FetchParametersRequest(program="mlp_classifier", seed=seed)):
            if part.WhichOneof("part") == "tensor":
                assembler = TensorAssembler(part.tensor)
                leaves.append(assembler)
            else:
                assembler.add(part.chunk)
        return [(a.name, a.result()) for a in leaves]

    program = default_registry().get("mlp_classifier")
    first, again, other = fetch_params(3), fetch_params(3), fetch_params(4)
    assert [name for name, _ in first] == [p.name for p in program.parameters]
    for (_, a), (_, b), expected in zip(first, again, program.init_params(3)):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(a, np.asarray(expected))
    assert any(not np.array_equal(a, b) for (_, a), (_, b) in zip(first, other))
    error = rpc_error(lambda: list(stub.FetchParameters(pb.FetchParametersRequest(program="identity"))))
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION


def test_an_export_failure_is_reported_though_the_executables_build_concurrently(service):
    """The export runs beside the executables' compiles; its error must still reach the caller."""
    from accelmesh.programs import OutputSpec, Program, TensorSpec

    def branchy(x):  # fine at a fixed batch; a symbolic batch cannot decide the branch
        return (x * 2.0 if x.shape[0] > 4 else x,)

    stub, compiler = service
    spec = TensorSpec("x", "float32", (None, 3))
    compiler.registry.register(Program(
        name="branchy", version="1", kind="function", description="branches on the batch size",
        parameters=(), inputs=(spec,), outputs=(OutputSpec("y", "float32", (None, 3)),), digest="branchy-1",
        fn=branchy))
    error = rpc_error(stub.Compile, pb.CompileRequest(program="branchy", targets=[device("v100-32gb")],
                                                      batch_sizes=[8]))
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION and "exporting branchy@1" in error.details()
    response = stub.Compile(pb.CompileRequest(program="mlp_classifier", targets=[device("v100-32gb")], batch_sizes=[8]))
    assert [e.batch_size for e in response.builds[0].executables] == [8]


@pytest.mark.parametrize("seed", [0, 3])
def test_a_reference_run_is_the_programs_fp32_answer_on_any_cpu(compile_config, seed):
    """accelmesh.reference asks this service for a flagless CPU's build: the fp32 catch-all rule."""
    server, _ = build_compile_service(compile_config)
    server.start()
    try:
        x = np.random.default_rng(seed).normal(size=(24, 64)).astype(np.float32)
        (got,) = reference_outputs(f"127.0.0.1:{server.port}", "mlp_classifier", [x], parameter_seed=seed)
        # In chunks of rows (the last one short), joined: the same rows, in order.
        (chunked,) = reference_outputs(f"127.0.0.1:{server.port}", "mlp_classifier", [x], parameter_seed=seed,
                                       chunk_rows=10)
    finally:
        server.stop(0)
    program = default_registry().get("mlp_classifier")
    (want,) = jax.jit(program.fn)(*program.init_params(seed), x)
    assert got.shape == chunked.shape == (24, 10) and got.dtype == chunked.dtype == np.float32
    np.testing.assert_allclose(got, np.asarray(want), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(chunked, np.asarray(want), rtol=1e-5, atol=1e-6)


def test_a_reference_is_refused_when_the_rules_give_a_plain_cpu_no_fp32_build(tmp_path, compile_config):
    rules = tmp_path / "rules.toml"
    rules.write_text('[[rule]]\nname = "all-bf16"\ndescription = "everything in bf16"\n[rule.build]\n'
                     'compute_dtype = "bf16"\nmatmul_precision = "default"\nremat = false\ntolerance = 5e-2\n')
    server, _ = build_compile_service(dataclasses.replace(compile_config, rules=str(rules)))
    server.start()
    try:
        with pytest.raises(errors.FailedPrecondition, match="all-bf16 rule"):
            reference_outputs(f"127.0.0.1:{server.port}", "mlp_classifier", [np.zeros((2, 64), np.float32)])
    finally:
        server.stop(0)
