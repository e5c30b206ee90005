"""WorkerService adapter: proto in, NodeAgent call, proto out."""

from __future__ import annotations

from importlib import metadata

from accelmesh.runtime.devices import device_to_proto
from accelmesh.worker.v1 import worker_service_pb2, worker_service_pb2_grpc
from dispatch_svc.worker.agent import NodeAgent

try:
    VERSION = metadata.version("accelmesh")
except metadata.PackageNotFoundError:
    VERSION = "unknown"


class WorkerServicer(worker_service_pb2_grpc.WorkerServiceServicer):
    def __init__(self, agent: NodeAgent):
        self.agent = agent

    def DescribeNode(self, request, context):
        node = self.agent.describe(list(request.device_ids))
        samples = {s.device_id: s for s in node.samples}
        return worker_service_pb2.DescribeNodeResponse(
            node_ip=node.ip,
            hostname=node.hostname,
            devices=[device_to_proto(d, samples.get(d.id)) for d in node.devices],
            software_version=VERSION,
        )
