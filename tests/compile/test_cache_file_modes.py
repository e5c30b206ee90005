"""The artifact cache's folders and files are its owner's alone, whatever the umask: compiled
programs of every tenant."""

from __future__ import annotations

import os
import stat

from compile_svc.cache import ArtifactCache


def test_cached_artifacts_their_folders_and_lock_files_are_owner_only(tmp_path):
    old = os.umask(0o022)
    try:
        root = tmp_path / "artifacts"
        cache = ArtifactCache(root, max_bytes=1 << 20)
        key = ArtifactCache.key_for(program="p")
        cache.put(key, b"compiled", {"program": "p"})
        cache.get_or_build(ArtifactCache.key_for(program="q"), lambda: (b"built", {}))
        paths = [root, *root.rglob("*")]
        assert len(paths) > 3
        modes = {str(p.relative_to(tmp_path)): oct(stat.S_IMODE(os.stat(p).st_mode)) for p in paths}
        assert {p: m for p, m in modes.items() if int(m, 8) & 0o077} == {}
    finally:
        os.umask(old)
