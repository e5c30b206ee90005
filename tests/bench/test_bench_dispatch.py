"""bench/dispatch.py's store sampler, which its large direct job reports beside the worker store's
bound: it counts the allocated bytes of one worker's segment files alone, and keeps the largest total seen."""

from __future__ import annotations

import os
import sys
from pathlib import Path

# bench/ is no package: its scripts import each other by path, as this test does.
sys.path.append(str(Path(__file__).resolve().parents[2] / "bench"))
import dispatch

from worker_svc.segments import SEGMENT_PREFIX

KIB = 1024


def _segment(root: Path, name: str, nbytes: int) -> Path:
    path = root / name
    with open(path, "wb") as handle:
        os.posix_fallocate(handle.fileno(), 0, nbytes)
    return path


def test_the_store_sampler_counts_one_workers_segments_and_keeps_the_peak(tmp_path):
    ours = [_segment(tmp_path, f"{SEGMENT_PREFIX}4242-{i:032x}", 64 * KIB) for i in range(3)]
    _segment(tmp_path, f"{SEGMENT_PREFIX}42420-{0:032x}", 512 * KIB)  # another worker's pid, sharing a prefix
    _segment(tmp_path, "unrelated", 512 * KIB)
    sampler = dispatch.StoreSampler(4242, root=str(tmp_path))
    sampler._sample()
    allocated = sum(p.stat().st_blocks * 512 for p in ours)
    assert allocated >= 3 * 64 * KIB and sampler.peak_bytes == allocated
    ours[0].unlink()
    sampler._sample()
    assert sampler.peak_bytes == allocated  # the largest seen, not the last
