"""The worker's artifact cache is its owner's alone, whatever the umask: a folder made 0700, one
made before tightened, each artifact 0600."""

from __future__ import annotations

import os
import stat

from accelmesh.security.config import INSECURE
from worker_svc.artifacts import ArtifactStore


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_the_artifact_folder_and_artifacts_are_owner_only(tmp_path):
    old = os.umask(0o022)
    try:
        made = ArtifactStore(tmp_path / "new" / "artifacts", "127.0.0.1:1", INSECURE)
        made._write("k" * 64, b"executable")
        assert mode(tmp_path / "new") == 0o700 and mode(made.root) == 0o700
        assert [oct(mode(p)) for p in made.root.iterdir()] == [oct(0o600)]
        (tmp_path / "old").mkdir(mode=0o755)
        ArtifactStore(tmp_path / "old", "127.0.0.1:1", INSECURE)
        assert mode(tmp_path / "old") == 0o700
    finally:
        os.umask(old)
