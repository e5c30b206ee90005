"""The worker's metrics (accelmesh/runtime/metrics.py): shards run and their execution time per
device, loading time, the bytes of tensors it keeps for jobs between calls, and its object store."""

from __future__ import annotations

from accelmesh.runtime.metrics import LATENCY_BUCKETS_S, Metrics
from worker_svc.executor import Shard, ShardExecutor, ShardTimings
from worker_svc.held_tensors import HeldTensors
from worker_svc.objects import ObjectStore


class WorkerMetrics:
    def __init__(self, metrics: Metrics, executor: ShardExecutor, held: HeldTensors, store: ObjectStore):
        meter = metrics.meter
        self._shards = meter.create_counter("accelmesh_worker_shards", description="Shards run, by device and by how "
                                            "their executable was had (load_kind)")
        self._execute = meter.create_histogram(
            "accelmesh_worker_execute_seconds", description="Seconds a shard ran on its device (inputs on, the run, "
            "outputs off), by device", explicit_bucket_boundaries_advisory=LATENCY_BUCKETS_S)
        self._load = meter.create_histogram(
            "accelmesh_worker_load_seconds", description="Seconds a shard waited for its executable (fetched, "
            "compiled or found loaded), by device", explicit_bucket_boundaries_advisory=LATENCY_BUCKETS_S)
        metrics.gauge("accelmesh_worker_held_bytes", "Bytes of tensors the worker keeps for jobs between calls",
                      lambda: [(held.stats().bytes, {})])
        metrics.gauge("accelmesh_worker_store_bytes", "Bytes of objects in the worker's store (jobs' inputs put by "
                      "clients, shards' outputs not yet fetched)", lambda: [(store.stats().used_bytes, {})])
        metrics.gauge("accelmesh_worker_store_limit_bytes", "The store's bound (ACCELMESH_WORKER_STORE_BYTES)",
                      lambda: [(store.stats().limit_bytes, {})])
        metrics.gauge("accelmesh_worker_store_objects", "Objects in the worker's store",
                      lambda: [(store.stats().objects, {})])
        executor.on_done = self.shard_done

    def shard_done(self, shard: Shard, timings: ShardTimings) -> None:
        device = {"device": shard.device_id}
        self._shards.add(1, {**device, "load_kind": timings.load_kind})
        self._execute.record(timings.execute_seconds, device)
        self._load.record(timings.load_seconds, device)
