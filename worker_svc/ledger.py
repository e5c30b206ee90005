"""What the worker's running Execute calls hold: how many there are and the input bytes they
received. A cancelled or failed call must give its bytes back as it ends (tests wait on this
ledger for that, with the garbage collector off, to show no reference cycle keeps them)."""

from __future__ import annotations

import threading
from dataclasses import dataclass


@dataclass(frozen=True)
class InputStats:
    calls: int  # Execute calls whose handler is running now
    bytes: int  # input bytes those calls received (sent in full; references are not counted)


class InputLedger:
    """Thread-safe counts of what running Execute calls hold; `changed` is notified on each change,
    so a caller (a test, a drain) can wait for the calls to give their inputs back."""

    def __init__(self):
        self.changed = threading.Condition()
        self._calls = 0
        self._bytes = 0

    def open(self) -> CallInputs:
        with self.changed:
            self._calls += 1
            self.changed.notify_all()
        return CallInputs(self)

    def stats(self) -> InputStats:
        with self.changed:
            return InputStats(self._calls, self._bytes)

    def _change(self, calls: int, nbytes: int) -> None:
        with self.changed:
            self._calls += calls
            self._bytes += nbytes
            self.changed.notify_all()


class CallInputs:
    """One call's entry in the ledger; `close` (once, when the handler ends) takes it out."""

    def __init__(self, ledger: InputLedger):
        self._ledger = ledger
        self._bytes = 0
        self._open = True

    def received(self, nbytes: int) -> None:
        self._bytes += nbytes
        self._ledger._change(0, nbytes)

    def close(self) -> None:
        if self._open:
            self._open = False
            self._ledger._change(-1, -self._bytes)
