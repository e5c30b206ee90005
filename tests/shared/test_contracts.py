"""The proto contracts: buf lint clean, committed code equal to a fresh regeneration, importable."""

from __future__ import annotations

import importlib
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from accelmesh import protogen

REPO_ROOT = protogen.REPO_ROOT
PACKAGE_ROOT = REPO_ROOT / "accelmesh"
GENERATED_GLOBS = ("*_pb2.py", "*_pb2.pyi", "*_pb2_grpc.py")
BUF_TIMEOUT_S = 60


def _buf_executable() -> str:
    # The venv's own buf (buf-bin) first, so the test does not depend on PATH being activated.
    beside_python = Path(sys.executable).parent / "buf"
    if beside_python.exists():
        return str(beside_python)
    found = shutil.which("buf")
    assert found, "buf is not installed; `pip install -e '.[dev]'` installs buf-bin"
    return found


def _committed_generated_files() -> list[Path]:
    return sorted(path for pattern in GENERATED_GLOBS for path in PACKAGE_ROOT.rglob(pattern))


@pytest.fixture(scope="module")
def regenerated(tmp_path_factory) -> dict[Path, Path]:
    """Fresh protoc output, keyed by path relative to the import root."""
    out_dir = tmp_path_factory.mktemp("protogen")
    written = protogen.generate(out_dir)
    return {path.relative_to(out_dir): path for path in written}


def test_buf_lint_passes():
    result = subprocess.run(
        [_buf_executable(), "lint"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=BUF_TIMEOUT_S,
    )
    assert result.returncode == 0, f"buf lint failed:\n{result.stdout}{result.stderr}"


def test_every_proto_is_generated(regenerated):
    protos = protogen.proto_files()
    assert protos, f"no protos found under {protogen.PROTO_ROOT}"
    assert len(regenerated) == len(protos) * len(protogen.GENERATED_SUFFIXES)
    for rel, path in regenerated.items():
        assert path.is_file(), f"protogen.generate claims {rel} but did not write it"


def test_committed_code_matches_regeneration(regenerated):
    stale = []
    for rel, fresh in sorted(regenerated.items()):
        committed = REPO_ROOT / rel
        if not committed.is_file():
            stale.append(f"{rel}: missing (run `make protos`)")
        elif committed.read_bytes() != fresh.read_bytes():
            stale.append(f"{rel}: differs from a fresh regeneration (run `make protos`)")
    assert not stale, "generated code is out of date:\n" + "\n".join(stale)


def test_no_committed_generated_file_lacks_a_proto(regenerated):
    orphans = [
        str(path.relative_to(REPO_ROOT))
        for path in _committed_generated_files()
        if path.relative_to(REPO_ROOT) not in regenerated
    ]
    assert not orphans, f"generated files whose .proto is gone (delete them): {orphans}"


def _generated_module_names() -> list[str]:
    rels = (
        path.relative_to(REPO_ROOT).with_suffix("")
        for path in _committed_generated_files()
        if path.suffix == ".py"
    )
    return [".".join(rel.parts) for rel in rels]


def test_generated_modules_are_found():
    # Guards the parametrised import test below against silently collecting nothing.
    assert len(_generated_module_names()) == 2 * len(protogen.proto_files())


@pytest.mark.parametrize("module_name", _generated_module_names())
def test_generated_module_imports(module_name):
    module = importlib.import_module(module_name)
    if module_name.endswith("_pb2"):
        # The descriptor's file name mirrors the import path, so imports need no rewriting.
        assert module.DESCRIPTOR.name == module_name.removesuffix("_pb2").replace(".", "/") + ".proto"
