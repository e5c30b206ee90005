"""The registry's rules against program hijacking: built-in (and plugin) names are reserved,
uploaded versions are immutable and matched exactly, an unpinned reference resolves to the
name's own highest version, and an operator can delete an upload for good (restarts included)."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import grpc
import pytest
from _service_helpers import (  # noqa: F401 (fixtures)
    compile_config_at,
    compile_config_fixture,
    exported_affine,
    service_fixture,
    serving,
    upload,
)

from accelmesh import errors
from accelmesh.compile.v1 import compile_service_pb2 as pb
from accelmesh.hardware.catalog import resolve_type
from accelmesh.runtime.devices import device_to_proto
from compile_svc.programs import ProgramRegistry, default_registry
from compile_svc.programs.builtin import identity
from compile_svc.uploads import UploadStore

from conftest import rpc_error

V100 = device_to_proto(resolve_type("v100-32gb").device_spec("127.0.0.1", 0, emulated_on="cpu:0"))


def uploaded(name: str, version: str, digest: str = "d" * 64):
    return dataclasses.replace(identity().program, name=name, version=version, kind="uploaded", digest=digest)


class FakeEntryPoint:
    def __init__(self, name, target):
        self.name, self.load = name, lambda: target


# --- the registry -----------------------------------------------------------------------------------

def test_an_upload_may_not_use_a_builtin_or_plugin_name():
    reg = ProgramRegistry()
    reg.register(identity().program)
    reg.load_entry_points(entry_points=lambda group: [FakeEntryPoint("p", lambda: uploaded("plugged", "1"))])
    for name in ("identity", "plugged"):
        with pytest.raises(errors.PermissionDenied, match=f"'{name}'.*reserved; upload under another name"):
            reg.add_upload(uploaded(name, "999"))
    assert reg.get("identity").version == "1" and reg.get("plugged").version == "1"


def test_a_plugin_cannot_shadow_a_builtin(caplog):
    reg = ProgramRegistry()
    reg.register(identity().program)
    shadow = dataclasses.replace(identity().program, version="999", digest="e" * 64)
    with caplog.at_level(logging.WARNING):
        added = reg.load_entry_points(entry_points=lambda group: [FakeEntryPoint("evil", lambda: shadow)])
    assert added == [] and "identity@999" in caplog.text and "built-in programs" in caplog.text
    assert [p.ref for p in reg.list()] == ["identity@1"]


def test_uploaded_versions_are_immutable_and_matched_exactly():
    reg = ProgramRegistry()
    reg.add_upload(uploaded("affine", "1.9", "a" * 64))
    with pytest.raises(errors.AlreadyExists, match="'1.9' of 'affine' is already uploaded"):
        reg.add_upload(uploaded("affine", "1.9", "a" * 64))  # identical content too
    reg.add_upload(uploaded("affine", "1.10", "b" * 64))
    assert reg.get("affine").version == "1.10"
    assert reg.get("affine", "1.9").digest == "a" * 64
    for near in ("1", "1.1", "1.9.0", "v1.9", " 1.9"):
        with pytest.raises(errors.NotFound, match="available versions: 1.9, 1.10"):
            reg.get("affine", near)


def test_versions_that_order_the_same_resolve_the_same_whatever_the_order():
    for order in (("1.0", "1.00"), ("1.00", "1.0")):
        reg = ProgramRegistry()
        for version in order:
            reg.add_upload(uploaded("tied", version))
        assert reg.get("tied").version == "1.00"


# --- the store: files on disk -----------------------------------------------------------------------

def store(root, registry=None) -> UploadStore:
    return UploadStore(root, registry or ProgramRegistry(), max_bytes=1 << 20)


def test_versions_with_dots_get_files_of_their_own_and_old_names_are_moved(tmp_path):
    first = store(tmp_path)
    first.upload("affine", "1.0", exported_affine(1.0), ["concat"])
    first.upload("affine", "1.5", exported_affine(5.0), ["concat"])
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "affine@1.0.jaxexport", "affine@1.0.json", "affine@1.5.jaxexport", "affine@1.5.json"]
    # Before the fix, "affine@1.5" was stored as affine@1.{json,jaxexport} (Path.with_suffix).
    (tmp_path / "affine@1.5.json").rename(tmp_path / "affine@1.json")
    (tmp_path / "affine@1.5.jaxexport").rename(tmp_path / "affine@1.jaxexport")
    again = store(tmp_path)
    assert again.restore() == 2
    assert {p.ref for p in again.registry.list()} == {"affine@1.0", "affine@1.5"}
    assert not (tmp_path / "affine@1.json").exists() and (tmp_path / "affine@1.5.json").exists()


def test_a_stored_upload_with_a_builtin_name_is_skipped_at_start(tmp_path, caplog):
    (tmp_path / "mlp_classifier@999.jaxexport").write_bytes(exported_affine(42.0))
    (tmp_path / "mlp_classifier@999.json").write_text(json.dumps(
        {"name": "mlp_classifier", "version": "999", "combine": ["concat"], "input_names": [], "description": ""}))
    (tmp_path / "escape@1.json").write_text(json.dumps(
        {"name": "../escape", "version": "1", "combine": ["concat"], "input_names": []}))
    registry = default_registry()
    with caplog.at_level(logging.WARNING):
        assert store(tmp_path, registry).restore() == 0
    assert "reserved" in caplog.text and "'../escape'" in caplog.text
    assert registry.get("mlp_classifier").version == "1"


# --- through the service ----------------------------------------------------------------------------


def test_an_upload_cannot_change_what_an_unpinned_builtin_runs(service):
    stub, _ = service
    before = stub.DescribeProgram(pb.DescribeProgramRequest(name="mlp_classifier")).program
    error = rpc_error(upload, stub, exported_affine(42.0), name="mlp_classifier", version="999")
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "reserved" in error.details() and "another name" in error.details()
    after = stub.DescribeProgram(pb.DescribeProgramRequest(name="mlp_classifier")).program
    assert (after.version, after.digest) == (before.version, before.digest) == ("1", default_registry().get(
        "mlp_classifier").digest)
    assert stub.Compile(pb.CompileRequest(program="mlp_classifier", targets=[V100])).version == "1"


def test_reuploading_a_version_is_already_exists_and_keeps_the_first(service):
    stub, _ = service
    first = upload(stub, exported_affine(1.0)).program
    for data in (exported_affine(1.0), exported_affine(42.0)):
        error = rpc_error(upload, stub, data)
        assert error.code() == grpc.StatusCode.ALREADY_EXISTS and "immutable" in error.details()
    assert stub.DescribeProgram(pb.DescribeProgramRequest(name="affine", version="1")).program.digest == first.digest


def test_an_unpinned_reference_to_an_upload_gets_its_highest_version(service):
    stub, _ = service
    upload(stub, exported_affine(9.0), version="1.9")
    newest = upload(stub, exported_affine(10.0), version="1.10").program
    assert stub.DescribeProgram(pb.DescribeProgramRequest(name="affine")).program.digest == newest.digest
    assert stub.Compile(pb.CompileRequest(program="affine", targets=[V100])).version == "1.10"
    error = rpc_error(stub.DescribeProgram, pb.DescribeProgramRequest(name="affine", version="1"))
    assert error.code() == grpc.StatusCode.NOT_FOUND  # no prefix matching


def test_a_deleted_upload_stays_deleted_after_a_restart(service, compile_config):
    stub, _ = service
    upload(stub, exported_affine(1.0), version="1")
    upload(stub, exported_affine(2.0), version="2")
    assert stub.DeleteProgram(pb.DeleteProgramRequest(name="affine", version="2")).ref == "affine@2"
    assert stub.DescribeProgram(pb.DescribeProgramRequest(name="affine")).program.version == "1"
    error = rpc_error(stub.DescribeProgram, pb.DescribeProgramRequest(name="affine", version="2"))
    assert error.code() == grpc.StatusCode.NOT_FOUND
    assert sorted(p.name for p in Path(compile_config.programs_dir).iterdir()) == [
        "affine@1.jaxexport", "affine@1.json"]
    with serving(compile_config) as (restarted, _):
        refs = {f"{p.name}@{p.version}" for p in restarted.ListPrograms(pb.ListProgramsRequest()).programs}
    assert "affine@1" in refs and "affine@2" not in refs


@pytest.mark.parametrize("name, version, code, words", [
    ("mlp_classifier", "1", grpc.StatusCode.PERMISSION_DENIED, "only uploaded programs can be deleted"),
    ("affine", "1", grpc.StatusCode.NOT_FOUND, "no uploaded program 'affine@1'"),
    ("mlp_classifier", "999", grpc.StatusCode.PERMISSION_DENIED, "built-in"),
    ("affine", "", grpc.StatusCode.INVALID_ARGUMENT, "name and version are both required"),
    ("", "1", grpc.StatusCode.INVALID_ARGUMENT, "name and version are both required"),
])
def test_deleting_a_builtin_or_an_unknown_program_is_refused(service, name, version, code, words):
    stub, _ = service
    error = rpc_error(stub.DeleteProgram, pb.DeleteProgramRequest(name=name, version=version))
    assert error.code() == code and words in error.details()
    assert stub.DescribeProgram(pb.DescribeProgramRequest(name="mlp_classifier")).program.version == "1"
