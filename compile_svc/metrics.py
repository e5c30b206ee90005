"""The compile service's metrics (accelmesh/runtime/metrics.py): artifacts built and requests its
cache answered without building (their ratio is the cache's hit rate)."""

from __future__ import annotations

from opentelemetry.metrics import CallbackOptions, Observation

from accelmesh.runtime.metrics import Metrics
from compile_svc.cache import ArtifactCache


def register(metrics: Metrics, cache: ArtifactCache) -> None:
    def built(options: CallbackOptions):
        return [Observation(cache.builds)]

    def hits(options: CallbackOptions):
        return [Observation(cache.hits)]

    metrics.meter.create_observable_counter("accelmesh_compile_artifacts_built", callbacks=[built],
                                            description="Artifacts built (lowered, compiled) since the start")
    metrics.meter.create_observable_counter("accelmesh_compile_cache_hits", callbacks=[hits],
                                            description="Artifact requests the cache answered without building")
