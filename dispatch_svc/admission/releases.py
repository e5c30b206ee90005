"""A job's reservations released once it ends, even when the inventory is restarting just then.

The runner releases a job's reservations when the job ends (execution/runner.py). An inventory
that does not answer at that moment (UNAVAILABLE: restarting, unreachable) would otherwise leave
them held until their lease runs out (ACCELMESH_RESERVATION_TTL_S), their devices idle that long.
`RetriedReleases` is the Inventory port with that mended: a release the inventory did not answer
is kept on a pending list and sent again in the background, with backoff, until the inventory
answers, or until the reservation's lease has run out by itself (nothing is left to release).
The job's end does not wait for it. A reservation made anew for the same job (a replica taking
the job over) supersedes a pending release of it, so a late retry never frees the new one.

The list is in memory: if the dispatcher itself stops, what it held is freed by the lease, as a
job it was running is (admission/reservations.py).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from accelmesh import errors
from dispatch_svc.ports import Inventory

log = logging.getLogger(__name__)

# A release the inventory did not answer is sent again this long after, doubled each time it is
# not answered again, up to the most (an inventory back from a restart waits this long at most).
RELEASE_RETRY_S, RELEASE_RETRY_MAX_S = 0.5, 8.0


@dataclass
class _Pending:
    until: float  # the lease has run out by then: the inventory ended the reservations itself
    at: float  # when it is sent again
    backoff_s: float


class RetriedReleases:
    """`inventory` (every other method is its own), its releases retried while it is unavailable.
    `ttl_s`: the lease the dispatcher reserves and renews for (its reservations end at most that
    long after the last renewal, which came before the release)."""

    def __init__(self, inventory: Inventory, *, ttl_s: float, clock: Callable[[], float] = time.monotonic):
        self._inventory, self._ttl_s, self._clock = inventory, ttl_s, clock
        # `_sending` is held while a retry is sent, so a reserve for the same job waits until it is
        # answered; `_lock` guards the list only, so a job's end never waits on a retry.
        self._sending, self._lock = threading.Lock(), threading.Lock()
        self._pending: dict[str, _Pending] = {}
        self._wake, self._stopped = threading.Event(), threading.Event()
        self._thread: threading.Thread | None = None

    def __getattr__(self, name):
        return getattr(self._inventory, name)

    def reserve(self, job_id: str, claims: Sequence[tuple[str, int]], ttl_s: int) -> None:
        with self._sending, self._lock:
            self._pending.pop(job_id, None)
        self._inventory.reserve(job_id, claims, ttl_s)

    def release(self, job_id: str) -> None:
        """The job's reservations end now, or, if the inventory does not answer, as soon as it does."""
        try:
            self._inventory.release(job_id)
            return
        except errors.Unavailable as exc:
            log.warning("releasing the reservations of %s failed (%s); asking again in the background until the "
                        "inventory answers or their lease (%d s) runs out", job_id, exc, self._ttl_s)
        now = self._clock()
        with self._lock:
            self._pending[job_id] = _Pending(now + self._ttl_s, now + RELEASE_RETRY_S, RELEASE_RETRY_S)
            if self._thread is None:
                self._thread = threading.Thread(target=self._retry_loop, name="release-retries", daemon=True)
                self._thread.start()
        self._wake.set()

    def pending(self) -> frozenset[str]:
        """The jobs whose release is still to be sent again."""
        with self._lock:
            return frozenset(self._pending)

    def close(self) -> None:
        """Stop retrying (what is pending lapses with its lease), then close the inventory's client."""
        self._stopped.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        close = getattr(self._inventory, "close", None)  # a client's channels (the port itself has none)
        if close is not None:
            close()

    def _retry_loop(self) -> None:
        while not self._stopped.is_set():
            with self._lock:
                due = [job_id for job_id, p in self._pending.items() if p.at <= self._clock()]
            for job_id in due:
                if self._stopped.is_set():
                    return
                self._retry(job_id)
            with self._lock:
                wait_s = min((p.at for p in self._pending.values()), default=self._clock() + 3600) - self._clock()
            self._wake.wait(max(0.0, wait_s))
            self._wake.clear()

    def _retry(self, job_id: str) -> None:
        with self._sending:
            with self._lock:
                pending = self._pending.get(job_id)
                now = self._clock()
                if pending is None or pending.at > now:  # superseded by a reserve meanwhile
                    return
                if now >= pending.until:
                    del self._pending[job_id]
                    log.info("the reservations of %s lapsed before the inventory answered their release", job_id)
                    return
            try:
                self._inventory.release(job_id)
            except errors.Unavailable:
                with self._lock:
                    pending.backoff_s = min(2 * pending.backoff_s, RELEASE_RETRY_MAX_S)
                    pending.at = self._clock() + pending.backoff_s
                return
            except errors.AccelmeshError as exc:  # an answer no retry changes: the lease ends them
                log.warning("releasing the reservations of %s failed: %s", job_id, exc)
            except Exception:  # a bug: logged, and the loop goes on for the other jobs
                log.exception("releasing the reservations of %s failed", job_id)
            else:
                log.info("released the reservations of %s once the inventory answered", job_id)
            with self._lock:
                self._pending.pop(job_id, None)
