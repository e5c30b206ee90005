"""The periodic poll: every interval, describe the nodes this replica holds, in parallel; and,
in between, take over the nodes of replicas that stopped (``Inventory.take_over``)."""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

# Claims per poll interval: one poll cycle (renewing this replica's leases) and, between cycles,
# checks for lapsed leases to take over. How soon a dead replica's nodes are polled again depends
# on it: see LEASE_PER_INTERVAL below.
CLAIMS_PER_INTERVAL = 4

# A replica's leases on its nodes, and its liveness, last this many poll intervals. The bound to
# keep: a replica that dies must have its nodes polled by another within two intervals of its
# last poll. A replica renews only in its poll cycles (every interval, on the poller's grid), and
# its last cycle's claim comes before its last polls; so its leases lapse LEASE_PER_INTERVAL after
# its last poll at the latest. Every other replica checks for lapsed leases CLAIMS_PER_INTERVAL
# times an interval and polls what it takes at once: the nodes are polled again within
# LEASE_PER_INTERVAL + 1 / CLAIMS_PER_INTERVAL = 1.75 intervals, leaving a quarter interval for
# that poll and for clock skew between replicas. A live replica loses nothing unless a poll cycle
# starts half an interval late. A lease of one interval or less would lapse between renewals.
LEASE_PER_INTERVAL = 1.5
TAKEOVER_INTERVALS = LEASE_PER_INTERVAL + 1 / CLAIMS_PER_INTERVAL  # the bound above, in intervals


class Poller:
    """Calls `poll_all` every `interval_s` and `take_over` at the ticks between, on its own thread,
    until stopped.

    Ticks are kept on a fixed grid of `interval_s / CLAIMS_PER_INTERVAL` from the start, so a slow
    cycle does not push every later renewal back: a call that overruns skips the ticks it missed,
    and a poll cycle whose tick was skipped runs at the next one. `poll_all` and `take_over` must
    not raise for a node's failure (that is recorded as a missed poll); an exception here is a
    bug, which is logged and does not end the loop.
    """

    def __init__(self, poll_all: Callable[[], object], take_over: Callable[[], object], interval_s: float):
        self._poll_all = poll_all
        self._take_over = take_over
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="inventory-poller", daemon=True)

    def start(self) -> Poller:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        step = self._interval_s / CLAIMS_PER_INTERVAL
        start = time.monotonic()
        tick = polled_at = 0
        while True:
            tick = max(tick + 1, math.ceil((time.monotonic() - start) / step))
            if self._stop.wait(max(0.0, start + tick * step - time.monotonic())):
                return
            if tick - polled_at >= CLAIMS_PER_INTERVAL:
                polled_at = tick
                self._call(self._poll_all, "poll cycle")
            else:
                self._call(self._take_over, "take-over check")

    @staticmethod
    def _call(fn: Callable[[], object], what: str) -> None:
        try:
            fn()
        except Exception:
            log.exception("%s failed", what)
