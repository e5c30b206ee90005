"""Reproducer: which of the files and folders a running mesh wrote other local accounts may read.

    .venv/bin/python bench/attacks/file_mode.py

Starts the embedded mesh as real processes on loopback with mutual TLS and tokens (inventory,
compile, one worker emulating a V100, dispatch) under umask 022, as CI runs it, adds a user with
MeshCredentials.add_user, submits one small job as that user and fetches its result (so the job
book's database, its -wal, the job's results and the compiled artifacts exist), then, with the
mesh still up, walks the data dir and the credentials folder. Prints one JSON document on stdout
(progress on stderr) listing every file and folder whose mode has group or other bits; exits 1
when there is any.
"""

from __future__ import annotations

import json
import os
import stat
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

# Run as a script from one folder down: the checkout this file is in, whose packages the services
# it starts (`python -m`, from the working directory) run as well.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from accelmesh.client import MeshClient
from accelmesh.dispatch.v1 import job_pb2 as job_pb
from accelmesh.embedded import start_embedded_mesh

CALL_TIMEOUT_S = 120.0


def progress(message: str) -> None:
    print(f"[file_mode] {message}", file=sys.stderr, flush=True)


def exposed(root: Path) -> tuple[list[dict], int]:
    """Every path under `root` (itself included) with group/other bits, and how many were looked at."""
    found, seen = [], 0
    for folder, _dirs, files in os.walk(root):
        for path in [Path(folder), *(Path(folder) / name for name in files)]:
            try:
                mode = stat.S_IMODE(os.lstat(path).st_mode)
            except FileNotFoundError:  # a temporary file renamed away meanwhile
                continue
            seen += 1
            if mode & 0o077 and not path.is_symlink():
                found.append({"path": str(path.relative_to(root.parent)), "mode": oct(mode),
                              "kind": "folder" if path.is_dir() else "file"})
    return found, seen


def main() -> int:
    started = time.perf_counter()
    os.umask(0o022)  # the services inherit it
    with tempfile.TemporaryDirectory(prefix="accelmesh-bench-") as tmp:
        data_dir = Path(tmp) / "mesh"
        progress("starting the mesh: inventory, compile, dispatch, one worker (mutual TLS)")
        with start_embedded_mesh(data_dir, devices=1, emulate=("v100-32gb",)) as mesh:
            token = mesh.credentials.add_user("file-mode-user")
            with MeshClient(mesh.dispatch.address, security=mesh.credentials.client(token)) as client:
                progress("one small job as the user, then its result fetched")
                x = np.arange(16 * 1024, dtype=np.float32).reshape(16, 1024)
                job_id = client.submit("identity", {"x": x}, timeout=CALL_TIMEOUT_S)
                for _ in client.watch(job_id):
                    pass
                state = job_pb.JobState.Name(client.get(job_id).state)
                fetched = client.fetch_result(job_id)
            roots = [data_dir, mesh.credentials.folder]
            if mesh.credentials.folder.is_relative_to(data_dir):
                roots = [data_dir]
            found, seen = [], 0
            for root in roots:
                more, count = exposed(root)
                found, seen = found + more, seen + count
            wal = sorted(str(p.relative_to(data_dir.parent)) for p in data_dir.rglob("*-wal"))
    result = {
        "benchmark": "file_mode", "umask": "0o22", "job_state": state, "results_fetched": sorted(fetched),
        "walked": [str(r.relative_to(Path(tmp))) for r in roots], "paths_checked": seen, "wal_files": wal,
        "exposed": found, "owner_only": not found, "wall_s": round(time.perf_counter() - started, 1),
    }
    json.dump(result, sys.stdout, indent=2)
    print()
    return 0 if result["owner_only"] else 1


if __name__ == "__main__":
    sys.exit(main())
