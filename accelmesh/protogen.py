"""Regenerate the Python code of the contracts: `make protos` (or `python -m accelmesh.protogen`).

Proto paths mirror packages (protos/accelmesh/<area>/v1), so generating with `-I protos` into
the import root gives `from accelmesh.<area>.v1 import ..._pb2` without rewriting imports.
Needs grpcio-tools (a dev dependency).
"""

from __future__ import annotations

import argparse
import pathlib
import sys

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
PROTO_ROOT = REPO_ROOT / "protos"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def proto_files(proto_root: pathlib.Path = PROTO_ROOT) -> list[pathlib.Path]:
    return sorted(proto_root.glob("accelmesh/*/v1/*.proto"))


def generate(out_dir: pathlib.Path, proto_root: pathlib.Path = PROTO_ROOT) -> list[pathlib.Path]:
    """Run protoc (python, pyi and grpc plugins) into out_dir; returns the files written."""
    from importlib import resources

    from grpc_tools import protoc

    well_known = str(resources.files("grpc_tools") / "_proto")
    files = proto_files(proto_root)
    args = [
        "protoc",
        f"-I{proto_root}",
        f"-I{well_known}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *(str(f.relative_to(proto_root)) for f in files),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
    return sorted(
        out_dir / rel.with_name(rel.stem + suffix)
        for rel in (f.relative_to(proto_root) for f in files)
        for suffix in GENERATED_SUFFIXES
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=REPO_ROOT, help="import root to write into")
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(path.relative_to(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
