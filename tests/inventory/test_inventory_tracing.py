"""One poll is one trace: inventory's poll spans, the DescribeNode client span and the worker's server span."""

from __future__ import annotations

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from accelmesh.inventory.v1 import inventory_service_pb2 as pb
from accelmesh.inventory.v1 import inventory_service_pb2_grpc
from accelmesh.runtime import attributes as attr
from accelmesh.runtime.channels import open_channel

from conftest import make_worker

pytestmark = pytest.mark.fixture_cpu

DESCRIBE = "/accelmesh.worker.v1.WorkerService/DescribeNode"


def traced():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider, exporter


def test_a_poll_cycle_is_one_trace_across_inventory_and_worker(inventory_factory):
    provider, exporter = traced()
    worker = make_worker(tracer_provider=provider)
    try:
        server, domain = inventory_factory(tracer_provider=provider)
        domain.register_node(f"127.0.0.1:{worker.port}")
        exporter.clear()
        assert domain.poll_all() == {f"127.0.0.1:{worker.port}": True}
        spans = exporter.get_finished_spans()
        by_name = {}
        for span in spans:
            by_name.setdefault(span.name, []).append(span)
        cycle = by_name["inventory.poll_cycle"][0]
        node = by_name["inventory.poll_node"][0]
        rpc_spans = by_name[DESCRIBE]
        assert len(rpc_spans) == 2  # the inventory's client span and the worker's server span
        assert {s.context.trace_id for s in [cycle, node, *rpc_spans]} == {cycle.context.trace_id}
        assert node.parent.span_id == cycle.context.span_id
        assert node.attributes[attr.NODE_ADDRESS] == f"127.0.0.1:{worker.port}"
        assert node.attributes[attr.POLL_OUTCOME] == "ok"
    finally:
        worker.stop(0)


def test_a_refresh_request_carries_the_clients_trace_to_the_worker(inventory_factory):
    provider, exporter = traced()
    worker = make_worker(tracer_provider=provider)
    try:
        server, domain = inventory_factory(tracer_provider=provider)
        domain.register_node(f"127.0.0.1:{worker.port}")
        exporter.clear()
        with open_channel(f"127.0.0.1:{server.port}", tracer_provider=provider) as channel:
            stub = inventory_service_pb2_grpc.InventoryServiceStub(channel)
            stub.RefreshDevices(pb.RefreshDevicesRequest(device_ids=["127.0.0.1/cuda:0"]))
        spans = exporter.get_finished_spans()
        names = sorted(s.name for s in spans)
        assert names.count("/accelmesh.inventory.v1.InventoryService/RefreshDevices") == 2
        assert names.count(DESCRIBE) == 2
        assert len({s.context.trace_id for s in spans}) == 1
    finally:
        worker.stop(0)
