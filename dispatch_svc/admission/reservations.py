"""A job's reservations kept leased while it runs (requirements B5): the inventory ends a lease
that is not renewed, so a dispatcher that dies frees its jobs' devices within one lease."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

from accelmesh import errors
from dispatch_svc.ports import Inventory, LiveJob

log = logging.getLogger(__name__)

RENEW_FRACTION = 1 / 3  # renewed every third of the lease: two renewals may fail before it lapses
# An inventory that did not answer is asked again at half the lease left, between these bounds;
# the lease lapses only once it ran out with no answer.
RENEW_RETRY_S, RENEW_RETRY_MIN_S = 1.0, 0.05


class LeaseKeeper:
    """Keeps a job's reservations leased while it runs: renewed every `ttl_s * RENEW_FRACTION` on a
    thread of its own, until the job is done or `stop` is called.

    A lease the inventory no longer holds (NOT_FOUND: it expired, or someone released it) is not
    taken back: its memory was free for other jobs meanwhile. The job stops instead: `lapse` says
    why, `lapsed` is set and the job's scope cancelled, so no more of its shards are sent, and the
    job ends FAILED with `lapse` as its error. An inventory that does not answer is asked again
    until the lease would have run out; an error no retry mends (an inventory without
    RenewReservations) stops the job at once."""

    def __init__(self, inventory: Inventory, job_id: str, device_ids: Sequence[str], ttl_s: int, live: LiveJob, *,
                 reserved_at: float, clock: Callable[[], float] = time.monotonic):
        self.lapse: errors.AccelmeshError | None = None
        self.lapsed = threading.Event()
        self.renewals = 0  # renewals the inventory granted
        self._inventory, self._job_id, self._device_ids, self._ttl_s = inventory, job_id, tuple(device_ids), ttl_s
        self._live, self._clock = live, clock
        # When the lease ends by this clock unless renewed: counted from before the request was
        # sent, so it is never later than the inventory's own end of the lease.
        self._deadline = reserved_at + ttl_s
        self._stopped = threading.Event()
        threading.Thread(target=self._keep, name=f"lease-{job_id}", daemon=True).start()

    def stop(self) -> None:
        """The job is ending: no renewal from now on (its reservations are about to be released)."""
        self._stopped.set()

    def _keep(self) -> None:
        interval = self._ttl_s * RENEW_FRACTION
        wait_s, last_error = interval, None
        while not self._live.done.wait(wait_s):
            if self._stopped.is_set():
                return
            left = self._deadline - self._clock()
            if last_error is not None and left <= 0:
                self._stop_job(errors.Unavailable(
                    f"the reservations of job {self._job_id} lapsed while it ran: the inventory did not answer for "
                    f"the whole {self._ttl_s} s lease ({last_error}), so they could not be renewed and other jobs may "
                    "use those devices now; the job stopped: run it again once the inventory answers"))
                return
            sent = self._clock()
            try:
                self._inventory.renew(self._job_id, self._device_ids, self._ttl_s, left if left > 0 else interval)
            except errors.Unavailable as exc:  # the inventory is down or slow: ask again while the lease lasts
                # At half the time left (at most RENEW_RETRY_S), so the last tries come just before its end.
                left = self._deadline - self._clock()
                last_error, wait_s = exc, max(RENEW_RETRY_MIN_S, min(RENEW_RETRY_S, left / 2))
                continue
            except errors.NotFound as exc:
                self._stop_job(errors.FailedPrecondition(
                    f"the reservations of job {self._job_id} lapsed while it ran: they expired or someone released "
                    f"them, and other jobs may use those devices now, so the job stopped; run it again "
                    f"(the inventory: {exc})"))
                return
            except errors.AccelmeshError as exc:
                self._stop_job(errors.FailedPrecondition(
                    f"the reservations of job {self._job_id} could not be renewed ({exc}); the job stopped rather "
                    "than run on devices it may no longer hold"))
                return
            except Exception as exc:  # a bug: the job must not run on unreserved
                log.exception("renewing the reservations of job %s failed", self._job_id)
                self._stop_job(errors.FailedPrecondition(
                    f"the reservations of job {self._job_id} could not be renewed (a dispatcher bug, "
                    f"{type(exc).__name__}; its log has the details); the job stopped rather than run on devices it "
                    "may no longer hold"))
                return
            self._deadline, wait_s, last_error = sent + self._ttl_s, interval, None
            self.renewals += 1

    def _stop_job(self, error: errors.AccelmeshError) -> None:
        if self._stopped.is_set() or self._live.done.is_set():
            return  # the job ended first: its reservations ended with it
        self.lapse = error  # before the cancel: whatever the cancel wakes finds why
        log.warning("%s", error)
        self._live.scope.cancel()
        self.lapsed.set()  # the job is told to stop
