"""Metrics: OpenTelemetry instruments, served for Prometheus at /metrics.

Every service makes its instruments from `Metrics.meter`. With a metrics address
(ACCELMESH_METRICS_LISTEN or --metrics-listen, host:port), the service's MeterProvider has
OpenTelemetry's PrometheusMetricReader, and prometheus_client's handler serves its registry at
http(s)://address/metrics from the mesh's HTTP server (https.py: handshakes off the accepting
thread, timeouts, a bound on connections, browser security headers). Each service has a
registry of its own, so services sharing a process (the tests, the embedded mesh) never mix
their series. Without an address the meter is a no-op one: an unmeasured service pays nothing.

The endpoint is TLS like the rest of the mesh: the service's own certificate, and only a client
with a certificate of the mesh CA may scrape (Prometheus is given one: deploy/README.md); on an
insecure (development) mesh it is plain HTTP, on loopback as the services are.

Names follow the NVIDIA DCGM exporter's where a series means the same (DCGM_FI_DEV_GPU_UTIL,
DCGM_FI_DEV_FB_USED, DCGM_FI_DEV_FB_FREE, with its labels gpu, modelName, Hostname), so
dashboards made for GPU nodes read the mesh's devices too. Those few are written as Prometheus
metric families (`families`) on the same registry, because OpenTelemetry's SDK lowercases every
instrument name (its names are case-insensitive) and PromQL's are not. The mesh's own series are
OpenTelemetry instruments named accelmesh_*, units in the names, Prometheus-style.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from opentelemetry.metrics import CallbackOptions, Meter, NoOpMeterProvider, Observation
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.resources import Resource

from accelmesh import errors
from accelmesh.runtime.config import cannot_bind
from accelmesh.runtime.https import DEFAULT_LIMITS, HttpLimits, HttpsServer, SecureHandler, tls_context
from accelmesh.security.config import Security

log = logging.getLogger(__name__)

# Seconds a shard or job takes: from a few milliseconds (a small shard) to hours (a long job).
LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900, 3600, 14400)


class Metrics:
    def __init__(self, service: str, listen: str = "", security: Security | None = None,
                 limits: HttpLimits = DEFAULT_LIMITS):
        """`listen`: host:port to serve /metrics on (port 0: any free one, `port` says which); "" for none.
        `limits`: the endpoint's timeouts and connection bound (https.py)."""
        self.service, self.port = service, 0
        self._server = None
        self._provider: MeterProvider | None = None
        if not listen:
            self.meter: Meter = NoOpMeterProvider().get_meter(f"accelmesh.{service}")
            return
        from opentelemetry.exporter.prometheus import PrometheusMetricReader
        from prometheus_client import CollectorRegistry, MetricsHandler

        host, port = _host_port(listen)
        self.registry = CollectorRegistry(auto_describe=True)
        reader = PrometheusMetricReader(registry=self.registry)
        self._provider = MeterProvider(resource=Resource.create({"service.name": f"accelmesh-{service}"}),
                                       metric_readers=[reader])
        self.meter = self._provider.get_meter(f"accelmesh.{service}")
        handler = type("MetricsHandler", (SecureHandler, MetricsHandler), {"registry": self.registry})
        context = tls_context(security, client_certificate=True)
        try:
            self._server = HttpsServer(f"{service} metrics", host, port, handler, context, limits).start()
        except OSError:
            self._provider.shutdown()
            raise cannot_bind(listen, "--metrics-listen (ACCELMESH_METRICS_LISTEN)") from None
        self.port = self._server.port
        self.scheme = "https" if self._server.secure else "http"

    @property
    def enabled(self) -> bool:
        return self._provider is not None

    def gauge(self, name: str, description: str, read: Callable[[], Iterable[tuple[float, dict]]],
              unit: str = "") -> None:
        """An observable gauge whose values (value, labels) `read` gives at each scrape. A `read` that
        fails is logged and gives nothing for that scrape: a scrape never breaks the service."""
        def observe(options: CallbackOptions) -> Iterable[Observation]:
            try:
                return [Observation(value, labels) for value, labels in read()]
            except Exception as exc:  # noqa: BLE001 - a database away, say: the series is absent this once
                log.warning("metric %s could not be read: %s", name, exc)
                return []
        self.meter.create_observable_gauge(name, callbacks=[observe], description=description, unit=unit)

    def families(self, name: str, collect: Callable[[], Iterable]) -> None:
        """Series served as Prometheus metric families that `collect` makes at each scrape (for names
        that must keep their case); a `collect` that fails gives nothing for that scrape."""
        if not self.enabled:
            return

        class Families:
            def describe(self):  # nothing to check against other collectors' names at registration
                return []

            def collect(self):
                try:
                    return list(collect())
                except Exception as exc:  # noqa: BLE001 - the series is absent this once
                    log.warning("metrics %s could not be read: %s", name, exc)
                    return []
        self.registry.register(Families())

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        if self._provider is not None:
            self._provider.shutdown()
            self._provider = None


def _host_port(listen: str) -> tuple[str, int]:
    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) < 65536:
        raise errors.InvalidArgument(f"metrics address {listen!r} is not host:port; set ACCELMESH_METRICS_LISTEN "
                                     "(or --metrics-listen) to e.g. 0.0.0.0:9464, or leave it empty for no metrics")
    return host.strip("[]") or "0.0.0.0", int(port)

