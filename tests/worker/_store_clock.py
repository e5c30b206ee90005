"""A clock the object-store tests move by hand (the store's TTL, wait and pool idle times read it),
shared by test_objects.py and test_segment_pool.py. A module of its own, not a conftest.py: a second
conftest.py would shadow the top-level one that tests import as `conftest`."""

from __future__ import annotations

import pytest


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(name="clock")
def clock_fixture():
    return FakeClock()
