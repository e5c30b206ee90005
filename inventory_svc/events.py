"""Fan-out of device changes to WatchDevices streams: each watcher gets its own bounded queue."""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass

EXISTING, ADDED, UPDATED, LOST, RECOVERED = "existing", "added", "updated", "lost", "recovered"

# A watcher that falls this far behind is cut off rather than letting memory grow without bound.
WATCH_QUEUE_EVENTS = 10_000


@dataclass(frozen=True)
class DeviceEvent:
    kind: str  # one of EXISTING, ADDED, UPDATED, LOST, RECOVERED
    device_id: str
    timestamp: float


class Overflowed(Exception):
    """The watcher fell too far behind and its stream ends."""


class Subscription:
    _CLOSED = object()

    def __init__(self, hub: EventHub):
        self._hub = hub
        self._queue: queue.Queue = queue.Queue(maxsize=WATCH_QUEUE_EVENTS)
        self.overflowed = False

    def _offer(self, event: DeviceEvent) -> None:
        try:
            self._queue.put_nowait(event)
        except queue.Full:
            self.overflowed = True
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
                raise Overflowed(f"watcher fell more than {WATCH_QUEUE_EVENTS} events behind; watch again")
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

    def publish(self, events: list[DeviceEvent]) -> None:
        with self._lock:
            subscribers = list(self._subscribers)
        for event in events:
            for sub in subscribers:
                sub._offer(event)
