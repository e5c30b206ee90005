"""Fan-out of device changes to WatchDevices streams: each watcher gets its own bounded queue.

The hub hears this replica's own changes as they commit and the other replicas' as the replica
follows the change feed (``Inventory.follow``), so a watcher on any replica sees every change.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass

from inventory_svc.records import DeviceRecord

EXISTING, ADDED, UPDATED, LOST, RECOVERED, REMOVED = "existing", "added", "updated", "lost", "recovered", "removed"

# A watcher that falls this far behind is cut off rather than letting memory grow without bound.
WATCH_QUEUE_EVENTS = 10_000


@dataclass(frozen=True)
class DeviceEvent:
    kind: str  # one of EXISTING, ADDED, UPDATED, LOST, RECOVERED, REMOVED
    device_id: str
    timestamp: float
    # REMOVED: the device as last stored, since the database no longer has it to read (None when
    # this replica never knew it); other kinds are read when sent, and leave it None.
    record: DeviceRecord | None = None


class Overflowed(Exception):
    """The watcher fell too far behind (or its replica did) and its stream ends."""


class Subscription:
    _CLOSED = object()

    def __init__(self, hub: EventHub):
        self._hub = hub
        self._queue: queue.Queue = queue.Queue(maxsize=WATCH_QUEUE_EVENTS)
        self.overflowed = False
        self._reason = f"watcher fell more than {WATCH_QUEUE_EVENTS} events behind; watch again"

    def _offer(self, event: DeviceEvent) -> None:
        try:
            self._queue.put_nowait(event)
        except queue.Full:
            self._drop(self._reason)

    def _drop(self, reason: str) -> None:
        self._reason, self.overflowed = reason, True
        self.close()

    def close(self) -> None:
        self._hub._unsubscribe(self)
        # Wake a reader blocked in next(); a full queue already has something to read.
        try:
            self._queue.put_nowait(self._CLOSED)
        except queue.Full:
            pass

    def __iter__(self):
        return self

    def __next__(self) -> DeviceEvent:
        item = self._queue.get()
        if item is self._CLOSED or self.overflowed:
            if self.overflowed:
                raise Overflowed(self._reason)
            raise StopIteration
        return item


class EventHub:
    def __init__(self):
        self._lock = threading.Lock()
        self._subscribers: list[Subscription] = []

    def subscribe(self) -> Subscription:
        sub = Subscription(self)
        with self._lock:
            self._subscribers.append(sub)
        return sub

    def _unsubscribe(self, sub: Subscription) -> None:
        with self._lock:
            if sub in self._subscribers:
                self._subscribers.remove(sub)

    def drop_all(self, reason: str) -> None:
        """End every stream with ``reason``: events were missed that no one can replay."""
        with self._lock:
            subscribers = list(self._subscribers)
        for sub in subscribers:
            sub._drop(f"{reason}; watch again (with include_existing to resynchronise)")

    def publish(self, events: list[DeviceEvent]) -> None:
        with self._lock:
            subscribers = list(self._subscribers)
        for event in events:
            for sub in subscribers:
                sub._offer(event)
