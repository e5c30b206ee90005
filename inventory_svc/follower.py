"""The follower: every follow interval, on its own thread, the inventory reads the changes other
replicas wrote (``Inventory.follow``), so its device index stays close behind them and its
WatchDevices streams hear of them without waiting for a ranking to ask."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from accelmesh import errors

log = logging.getLogger(__name__)


class Follower:
    """Calls ``follow`` every ``interval_s`` until stopped. A database that does not answer is
    logged once per outage and tried again at the next tick; after a long outage the index
    reloads (``DeviceIndex.follow``)."""

    def __init__(self, follow: Callable[[], object], interval_s: float):
        self._follow = follow
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="inventory-follower", daemon=True)

    def start(self) -> Follower:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        failing = False
        while not self._stop.wait(self._interval_s):
            try:
                self._follow()
            except errors.Unavailable as exc:
                if not failing:
                    log.warning("cannot read the other inventory replicas' changes: %s", exc)
                failing = True
                continue
            except Exception:  # noqa: BLE001 - the loop must outlive a bug in one pass
                log.exception("following the other inventory replicas' changes failed")
            failing = False
