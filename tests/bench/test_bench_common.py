"""bench/common.py's fresh-memory probe, which bench/dispatch.py reports beside its streaming
figures: it times two fills of the size asked and reports them as rates and their ratio (the
rates themselves depend on the host, and are not asserted)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

# bench/ is no package: its scripts import each other by path, as this test does.
sys.path.append(str(Path(__file__).resolve().parents[2] / "bench"))
import common

MIB = 1024 * 1024


def test_the_fresh_memory_probe_times_both_fills_of_the_size_asked():
    probe = common.fresh_memory(4 * MIB, idle_s=0)
    assert probe["bytes"] == 4 * MIB and probe["idle_s"] == 0
    assert probe["recycled_mb_per_s"] > 0 and probe["after_idle_mb_per_s"] > 0
    assert probe["ratio_after_idle_over_recycled"] == pytest.approx(
        probe["after_idle_mb_per_s"] / probe["recycled_mb_per_s"], rel=0.05)
