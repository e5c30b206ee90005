"""A call made every interval on a thread of its own, until stopped: what a replica does in the
background (an inventory following the others' changes, a dispatcher renewing its job leases).

A database or peer that does not answer (Unavailable) is logged once per outage and the call
tried again at the next tick; any other exception is a bug, logged with its traceback; neither
ends the loop.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from accelmesh import errors

log = logging.getLogger(__name__)


class Periodic:
    def __init__(self, name: str, call: Callable[[], object], interval_s: float, what: str, *,
                 woken: threading.Event | None = None):
        """`what` names the call in log lines, e.g. "renewing job leases". `woken`: an event others
        set to make the next call now (`wake` sets it too); one of its own by default."""
        self._call, self._interval_s, self._what = call, interval_s, what
        self._stop = threading.Event()
        self._woken = woken or threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> Periodic:
        self._thread.start()
        return self

    def wake(self) -> None:
        """Make the next call now rather than at the next tick (one call for any number of wakes)."""
        self._woken.set()

    def stop(self, timeout_s: float | None = None) -> None:
        self._stop.set()
        self._woken.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def _run(self) -> None:
        failing = False
        while True:
            self._woken.wait(self._interval_s)
            self._woken.clear()
            if self._stop.is_set():
                return
            try:
                self._call()
            except errors.Unavailable as exc:
                if not failing:
                    log.warning("%s failed: %s; trying again every %g s", self._what, exc, self._interval_s)
                failing = True
                continue
            except Exception:  # the loop must outlive a bug in one pass
                log.exception("%s failed", self._what)
            failing = False
