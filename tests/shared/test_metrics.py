"""The /metrics endpoint (accelmesh/runtime/metrics.py) and the worker's and compile service's
series, scraped over HTTP as Prometheus would: OpenTelemetry instruments and Prometheus families
(DCGM's upper-case names kept) on one service's registry, two services in one process apart, a
read that fails leaves its series out without failing the scrape, a bad or busy address is a clear
error, and no address means no server and a no-op meter. (TLS and the mesh's series:
tests/e2e/test_metrics_e2e.py.)"""

from __future__ import annotations

import hashlib
import socket
import urllib.request

import numpy as np
import pytest
from prometheus_client.core import GaugeMetricFamily

from accelmesh import errors
from accelmesh.runtime.metrics import Metrics
from compile_svc.cache import ArtifactCache
from compile_svc.metrics import register as register_compile
from worker_svc.executor import Shard, ShardExecutor, ShardTimings
from worker_svc.held_tensors import HeldTensors
from worker_svc.metrics import WorkerMetrics
from worker_svc.objects import ObjectStore


def scrape(metrics: Metrics) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics.port}/metrics", timeout=30) as response:
        return response.read().decode()


@pytest.fixture
def served():
    opened = []

    def serve(service: str) -> Metrics:
        metrics = Metrics(service, "127.0.0.1:0")
        opened.append(metrics)
        return metrics
    yield serve
    for metrics in opened:
        metrics.close()


def test_instruments_and_families_are_served_on_the_services_own_registry(served):
    first, second = served("first"), served("second")
    first.meter.create_counter("accelmesh_things", description="things").add(3, {"kind": "a"})
    first.gauge("accelmesh_level", "a level", lambda: [(7.5, {"device": "d0"})])
    first.families("upper-case", lambda: [_family("DCGM_FI_DEV_GPU_UTIL", 42.0)])
    second.gauge("accelmesh_other", "another service's", lambda: [(1, {})])
    text = scrape(first)
    assert 'accelmesh_things_total{kind="a"' in text and ' 3.0' in text
    assert 'accelmesh_level{device="d0"' in text
    assert 'DCGM_FI_DEV_GPU_UTIL{gpu="0"} 42.0' in text
    assert 'service_name="accelmesh-first"' in text
    assert "accelmesh_other" not in text  # the other service's registry
    assert "accelmesh_other" in scrape(second)


def test_a_read_that_fails_leaves_its_series_out_and_the_scrape_whole(served):
    metrics = served("flaky")

    def broken():
        raise errors.Unavailable("the database is away")
    metrics.gauge("accelmesh_broken", "fails", broken)
    metrics.families("broken families", broken)
    metrics.gauge("accelmesh_fine", "works", lambda: [(1, {})])
    text = scrape(metrics)
    assert "accelmesh_fine" in text and "accelmesh_broken{" not in text


def test_no_address_serves_nothing_and_measures_nothing():
    metrics = Metrics("quiet")
    assert not metrics.enabled and metrics.port == 0
    metrics.meter.create_counter("accelmesh_things").add(1)  # a no-op
    metrics.gauge("accelmesh_level", "a level", lambda: [(1, {})])
    metrics.families("none", lambda: [])
    metrics.close()


def test_a_bad_or_busy_address_is_a_clear_error(served):
    with pytest.raises(errors.InvalidArgument, match="metrics address 'nine' is not host:port"):
        Metrics("bad", "nine")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(errors.FailedPrecondition,
                           match=f"could not listen on 127.0.0.1:{port}: the port is in use"):
            Metrics("busy", f"127.0.0.1:{port}")


def test_the_worker_counts_its_shards_held_bytes_and_stored_objects(served, tmp_path):
    metrics = served("worker")
    executor = ShardExecutor({}, {}, artifacts=None)
    held = HeldTensors(1 << 20, 60.0)
    store = ObjectStore(1 << 20, root=str(tmp_path))
    WorkerMetrics(metrics, executor, held, store)
    store.put_array("user:a|job-1", "out/0.1/0", np.zeros(64, np.float32))
    assert held.keep("job-1", "params:w", np.zeros(256, np.float32))
    shard = Shard("job-1", 0, 1, "10.0.0.1/cuda:0", "a100-80gb", "key", "digest", "executable", None, 1, 8)
    for _ in range(2):
        executor.on_done(shard, ShardTimings(0.001, 0.0, 0.002, 0.25, True, "executable"))
    text = scrape(metrics)
    assert 'accelmesh_worker_shards_total{device="10.0.0.1/cuda:0",load_kind="executable"' in text
    assert _sample(text, "accelmesh_worker_execute_seconds_count", 'device="10.0.0.1/cuda:0"') == 2
    assert _sample(text, "accelmesh_worker_execute_seconds_sum", 'device="10.0.0.1/cuda:0"') == pytest.approx(0.5)
    assert _sample(text, "accelmesh_worker_held_bytes", "") == 1024
    assert _sample(text, "accelmesh_worker_store_bytes", "") == 256
    assert _sample(text, "accelmesh_worker_store_objects", "") == 1
    assert _sample(text, "accelmesh_worker_store_limit_bytes", "") == 1 << 20


def test_the_compile_service_counts_builds_and_cache_hits(served, tmp_path):
    metrics = served("compile")
    cache = ArtifactCache(tmp_path, 1 << 20)
    register_compile(metrics, cache)
    build = lambda: (b"artifact", {})  # noqa: E731
    first, second = (hashlib.sha256(name).hexdigest() for name in (b"one", b"two"))
    cache.get_or_build(first, build)
    cache.get_or_build(first, build)
    cache.get_or_build(second, build)
    text = scrape(metrics)
    assert _sample(text, "accelmesh_compile_artifacts_built_total", "") == cache.builds == 2
    assert _sample(text, "accelmesh_compile_cache_hits_total", "") == cache.hits == 1


def _family(name: str, value: float) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, "a device series", labels=["gpu"])
    family.add_metric(["0"], value)
    return family


def _sample(text: str, name: str, labels: str) -> float:
    for line in text.splitlines():
        series, _, rest = line.partition("{")
        if series == name and labels in rest:
            return float(line.rpartition(" ")[2])
    raise AssertionError(f"no {name} with {labels!r} in the scrape")
