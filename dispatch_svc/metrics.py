"""The dispatcher's metrics (accelmesh/runtime/metrics.py): the queue (jobs waiting, by priority,
and how long they waited), jobs running on this replica and how jobs ended, shard latency per
target type, retries, and spot checks of shards' outputs on another node.

Queue and running gauges are read when Prometheus scrapes; latencies and counts are recorded as
jobs and shards end. `NO_METRICS` stands in where a runner is built without any (tests).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from accelmesh.runtime.metrics import LATENCY_BUCKETS_S, Metrics
from dispatch_svc.jobs.book import JobBook

QUEUE_READ_JOBS = 10_000  # queued jobs a scrape counts at most


class DispatchMetrics:
    def __init__(self, metrics: Metrics, book: JobBook | None = None, running: Callable[[], int] | None = None):
        meter = metrics.meter
        if book is not None:
            metrics.gauge("accelmesh_queue_jobs", "Jobs waiting in the queue (every replica's), by priority",
                          lambda: _by_priority(book))
        if running is not None:
            metrics.gauge("accelmesh_jobs_running", "Jobs this dispatch replica runs now", lambda: [(running(), {})])
        self._wait = meter.create_histogram(
            "accelmesh_queue_wait_seconds", description="Seconds a job waited in the queue before it got its devices",
            explicit_bucket_boundaries_advisory=LATENCY_BUCKETS_S)
        self._job = meter.create_histogram(
            "accelmesh_job_seconds", description="Seconds from a job's submission to its end, by final state",
            explicit_bucket_boundaries_advisory=LATENCY_BUCKETS_S)
        self._jobs = meter.create_counter("accelmesh_jobs_ended", description="Jobs ended, by final state")
        self._shard = meter.create_histogram(
            "accelmesh_shard_seconds", description="Seconds from a shard's dispatch to its last result byte, by "
            "target type", explicit_bucket_boundaries_advisory=LATENCY_BUCKETS_S)
        self._retries = meter.create_counter("accelmesh_shard_retries", description="Shard attempts that failed and "
                                             "were retried on another device, by that device's target type")
        self._verified = meter.create_counter(
            "accelmesh_shard_verifications", description="Sampled shards run again on another node, by outcome "
            "(matched, not_verifiable), and nodes found returning wrong outputs (mismatched)")
        # Counted from 0, so a rate over them is 0 rather than absent before the first one.
        self._retries.add(0)
        self._jobs.add(0)
        self._verified.add(0)

    def queue_wait(self, seconds: float) -> None:
        self._wait.record(max(0.0, seconds))

    def job_ended(self, state: str, seconds: float) -> None:
        self._job.record(max(0.0, seconds), {"state": state})
        self._jobs.add(1, {"state": state})

    def shard(self, target_type: str, seconds: float) -> None:
        self._shard.record(seconds, {"target_type": target_type})

    def retried(self, target_type: str) -> None:
        self._retries.add(1, {"target_type": target_type})

    def verified(self, outcome: str) -> None:
        self._verified.add(1, {"outcome": outcome})


def _by_priority(book: JobBook):
    counts = Counter(priority for _, _, priority, _, _ in book.queue_rows.queued(QUEUE_READ_JOBS))
    return [(count, {"priority": str(priority)}) for priority, count in sorted(counts.items())] or [(0, {})]


NO_METRICS = DispatchMetrics(Metrics("dispatch"))
