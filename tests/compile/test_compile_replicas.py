"""Compile replicas on one shared programs folder (compile_svc/uploads.py, `refresh`): a program
uploaded or deleted through one replica is what the next call on any other sees, its newest
version included; a damaged file another replica left is skipped once, not on every call."""

from __future__ import annotations

import logging

import grpc
from _service_helpers import compile_config_fixture, exported_affine, serving, upload  # noqa: F401 (fixtures)

from accelmesh.compile.v1 import compile_service_pb2 as pb
from compile_svc.programs import ProgramRegistry
from compile_svc.uploads import UploadStore

from conftest import rpc_error


def test_an_upload_through_one_replica_is_known_to_the_other_at_its_next_call(compile_config):
    with serving(compile_config) as (first, _), serving(compile_config) as (second, _):
        upload(first, exported_affine(1.0), version="1")
        uploaded = first.DescribeProgram(pb.DescribeProgramRequest(name="affine", version="1")).program
        described = second.DescribeProgram(pb.DescribeProgramRequest(name="affine")).program
        assert (described.version, described.digest) == ("1", uploaded.digest)
        upload(first, exported_affine(2.0), version="2")  # the newest version moves on the other too
        assert second.DescribeProgram(pb.DescribeProgramRequest(name="affine")).program.version == "2"
        assert "affine@2" in {f"{p.name}@{p.version}" for p in second.ListPrograms(pb.ListProgramsRequest()).programs}

        first.DeleteProgram(pb.DeleteProgramRequest(name="affine", version="2"))
        assert second.DescribeProgram(pb.DescribeProgramRequest(name="affine")).program.version == "1"
        error = rpc_error(second.DescribeProgram, pb.DescribeProgramRequest(name="affine", version="2"))
        assert error.code() == grpc.StatusCode.NOT_FOUND


def test_a_damaged_upload_in_the_shared_folder_is_skipped_once(tmp_path, caplog):
    writer = UploadStore(tmp_path, ProgramRegistry(), max_bytes=1 << 20)
    reader = UploadStore(tmp_path, ProgramRegistry(), max_bytes=1 << 20)
    writer.upload("affine", "1", exported_affine(1.0), ["concat"])
    (tmp_path / "broken@1.json").write_text("{not json")
    with caplog.at_level(logging.WARNING):
        reader.refresh()
        reader.refresh()
    assert [p.ref for p in reader.registry.list() if p.name in ("affine", "broken")] == ["affine@1"]
    assert caplog.text.count("broken@1.json") == 1
