"""What an ended job leaves behind, and what it must not: what it held on the mesh released before
its end is recorded, its error detached from the frames that raised it, and the references it held
(the pool's closures, the feed, the exception's frames) dropped, so that nothing of a job's
parameters or inputs outlives it (execution/runner.py)."""

from __future__ import annotations

import logging
import traceback

from accelmesh import errors
from accelmesh.runtime.beside import beside
from accelmesh.runtime.errors import bounded
from dispatch_svc.execution.direct import end_direct
from dispatch_svc.ports import InputFeed, LiveJob

log = logging.getLogger(__name__)

# What a job that failed on the mesh says: UNAVAILABLE is gRPC's status for a fault that may pass (a
# worker, a replica or the database restarting; a shard that every device it could go to failed), so
# the same job may well run if it is sent again, and its caller should know that from the message as
# from the status.
TRANSIENT_ADVICE = ("submit the job again: what stopped it was the mesh (a process, link or device away or "
                    "failing), not the job, and it may well run then")


def release_all(inventory, workers, job_id: str, live: LiveJob, exc: BaseException | None) -> None:
    """What the job holds, let go of before its end is recorded: its reservations, and beside that
    call what its client put in or did not fetch, its streams and the tensors workers hold for it
    (each call's round trip not added to the others')."""
    freed = [beside(end_direct, live, workers, exc), beside(workers.release, job_id)]
    try:
        inventory.release(job_id)
    except errors.AccelmeshError as release_error:  # the lease runs out on its own
        log.warning("releasing %s failed: %s", job_id, release_error)
    finally:
        for future in freed:
            future.result()


def failure_message(exc: BaseException, limit: int) -> str:
    """A FAILED job's recorded error, at most `limit` bytes: its exception's text, then
    TRANSIENT_ADVICE (kept whole however long the text) when the cause was UNAVAILABLE and the text
    does not say already to submit it again."""
    message = str(exc) or type(exc).__name__
    if not isinstance(exc, errors.Unavailable) or "submit it again" in message or "submit the job again" in message:
        return bounded(message, limit)
    return f"{bounded(message, limit - len(TRANSIENT_ADVICE) - 2)}; {TRANSIENT_ADVICE}"


def detached(exc: BaseException) -> BaseException:
    """A job's error as RunJob re-raises it after the job ended: the same status and message, and
    no traceback, so no frame (and none of the parameters or inputs its locals held) outlives
    the job through it. A bug stays a bug (INTERNAL), its traceback logged when it happened."""
    kind = next((k for k in type(exc).__mro__ if k.__module__ == errors.__name__), None)
    if kind is None or not issubclass(kind, errors.AccelmeshError):
        return RuntimeError(f"job failed: {type(exc).__name__}")
    return kind(str(exc), reason=getattr(exc, "reason", ""), field=getattr(exc, "field", ""))


def let_go(live: LiveJob, feed: InputFeed | None, exc: BaseException | None) -> None:
    """Drop what an ended job held. A live job may outlive its run (RunJob still streams its
    results): its pool's closures hold the parameters. The exception's frames hold the strategy's
    locals (parameters, input blocks) and refer back to the job, a cycle that only the garbage
    collector would free, maybe much later: cleared here, so they go as soon as the call ends."""
    live.pool = None
    live.failure = None
    close = getattr(feed, "close", None)  # the request stream (StreamFeed): its held block, its iterator
    if close is not None:
        close()
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        traceback.clear_frames(exc.__traceback__)  # frames still running (the caller's) are skipped
        exc = exc.__cause__ or exc.__context__
