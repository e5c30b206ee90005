"""The inventory's metrics (accelmesh/runtime/metrics.py): every device's utilisation and memory
under the NVIDIA DCGM exporter's names and labels, what is reserved on it, whether it answers,
the live reservations, and how long a poll cycle takes.

Device series are read from the store when Prometheus scrapes, in one read per scrape (written
as Prometheus metric families: see accelmesh/runtime/metrics.py on DCGM's names), lost devices
included with accelmesh_device_up 0, so a dashboard shows a node going away instead of its
series stopping.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from accelmesh.runtime.metrics import LATENCY_BUCKETS_S, Metrics
from inventory_svc.filtering import DeviceFilter
from inventory_svc.inventory import Inventory
from inventory_svc.records import DeviceRecord

MIB = 1024 * 1024


LABELS = ("gpu", "device", "modelName", "Hostname", "type", "emulated")


def _labels(device: DeviceRecord) -> dict[str, str]:
    spec = device.spec
    return {"gpu": str(spec.local_index), "device": spec.id, "modelName": spec.kind, "Hostname": spec.node_ip,
            "type": spec.type, "emulated": "true" if spec.emulated else "false"}


class InventoryMetrics:
    def __init__(self, metrics: Metrics, inventory: Inventory):
        self._inventory = inventory
        metrics.families("device series", self._devices)
        metrics.gauge("accelmesh_reservations", "Live device reservations, over every job",
                      lambda: [(len(inventory.reservations()), {})])
        metrics.gauge("accelmesh_nodes_suspect", "Nodes a spot check found returning wrong outputs, not trusted "
                      "again since (their devices get no jobs)",
                      lambda: [(sum(n.suspect for n in inventory.store.list_nodes()), {})])
        self._poll = metrics.meter.create_histogram(
            "accelmesh_inventory_poll_cycle_seconds",
            description="Seconds one poll cycle over this replica's nodes took",
            explicit_bucket_boundaries_advisory=LATENCY_BUCKETS_S)

    def _devices(self):
        """Every device's series: the healthy ones' utilisation and memory under the DCGM exporter's
        names and labels, and what is reserved on each and whether it answers."""
        from prometheus_client.core import GaugeMetricFamily

        every = [
            (GaugeMetricFamily("accelmesh_device_memory_reserved_bytes", "Device memory that jobs' live "
                               "reservations hold", labels=LABELS), lambda d: d.reserved_memory_bytes),
            (GaugeMetricFamily("accelmesh_device_up", "1 while the device's node answers its polls, 0 once it is "
                               "lost", labels=LABELS), lambda d: 1 if d.health == "healthy" else 0),
        ]
        healthy = [
            (GaugeMetricFamily("DCGM_FI_DEV_GPU_UTIL", "Compute utilisation of the device, percent (as DCGM's "
                               "exporter)", labels=LABELS), lambda d: 100.0 * d.utilization),
            (GaugeMetricFamily("DCGM_FI_DEV_FB_USED", "Device memory used, MiB (as DCGM's exporter)", labels=LABELS),
             lambda d: d.memory_used_bytes / MIB),
            (GaugeMetricFamily("DCGM_FI_DEV_FB_FREE", "Device memory not used, MiB (as DCGM's exporter; reservations "
                               "are not subtracted: see accelmesh_device_memory_reserved_bytes)", labels=LABELS),
             lambda d: (d.memory_total_bytes - d.memory_used_bytes) / MIB),
        ]
        for device in self._inventory.all_devices(DeviceFilter(include_lost=True)):
            labels = _labels(device)
            for family, read in every + (healthy if device.health == "healthy" else []):
                family.add_metric([labels[name] for name in LABELS], read(device))
        return [family for family, _ in every + healthy]

    def timed(self, poll_all: Callable[[], object]) -> Callable[[], object]:
        """`poll_all`, its duration recorded."""
        def run():
            started = time.perf_counter()
            try:
                return poll_all()
            finally:
                self._poll.record(time.perf_counter() - started)
        return run
