"""The periodic poll: every interval, describe every registered node, in parallel."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)


class Poller:
    """Calls `poll_all` every `interval_s` on its own thread until stopped.

    `poll_all` must not raise for a node's failure (that is recorded as a missed poll); an
    exception here is a bug, which is logged and does not end the loop.
    """

    def __init__(self, poll_all: Callable[[], object], interval_s: float):
        self._poll_all = poll_all
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
        while not self._stop.wait(self._interval_s):
            try:
                self._poll_all()
            except Exception:  # noqa: BLE001 - the loop must outlive a bug in one cycle
                log.exception("poll cycle failed")
