"""Calls a worker's DescribeNode and turns the answer into a NodeDescription.

A node that does not answer, or answers with something inconsistent, is an
accelmesh.errors.Unavailable carrying the reason: to the inventory both are a missed poll.
"""

from __future__ import annotations

from collections.abc import Sequence

import grpc

from accelmesh import errors
from accelmesh.hardware.model import NodeDescription
from accelmesh.runtime.channels import ChannelPool, explain_refusal
from accelmesh.runtime.devices import device_from_proto
from accelmesh.security.config import Security
from accelmesh.security.identity import Role
from accelmesh.worker.v1 import worker_service_pb2, worker_service_pb2_grpc

DESCRIBE_TIMEOUT_S = 2.0


class NodeClient:
    def __init__(self, security: Security, *, timeout_s: float = DESCRIBE_TIMEOUT_S, tracer_provider=None):
        self._timeout_s, self._security = timeout_s, security
        # Only a server holding a worker certificate issued for the address's host is answered as a node.
        self._channels = ChannelPool(security, Role.WORKER, tracer_provider=tracer_provider)

    def _stub(self, address: str) -> worker_service_pb2_grpc.WorkerServiceStub:
        return worker_service_pb2_grpc.WorkerServiceStub(self._channels.get(address))

    def describe(self, address: str, device_ids: Sequence[str] = ()) -> NodeDescription:
        try:
            response = self._stub(address).DescribeNode(
                worker_service_pb2.DescribeNodeRequest(device_ids=list(device_ids)), timeout=self._timeout_s
            )
        except grpc.RpcError as exc:
            # A channel that failed sits in reconnect backoff (up to minutes); a fresh one lets the
            # next poll see a restarted node at once.
            self.forget(address)
            details = explain_refusal(address, exc.details(), security=self._security, role=Role.WORKER)
            raise errors.Unavailable(
                f"node {address} did not answer DescribeNode: {exc.code().name}: {details}") from None
        try:
            return parse_description(response)
        except errors.InvalidArgument as exc:
            raise errors.Unavailable(f"node {address} answered with an invalid description: {exc}") from None

    def forget(self, address: str) -> None:
        self._channels.forget(address)  # a refresh racing a poll may still be on the old channel

    def close(self) -> None:
        self._channels.close()


def parse_description(response: worker_service_pb2.DescribeNodeResponse) -> NodeDescription:
    if not response.node_ip:
        raise errors.InvalidArgument("node_ip is empty")
    specs, samples = [], []
    for i, msg in enumerate(response.devices):
        spec, sample = device_from_proto(msg, f"devices[{i}]")
        if spec.node_ip != response.node_ip:
            raise errors.InvalidArgument(f"devices[{i}].id {spec.id!r} does not carry the node's IP {response.node_ip}")
        specs.append(spec)
        if sample is not None:
            samples.append(sample)
    if len({s.id for s in specs}) != len(specs):
        raise errors.InvalidArgument("device ids repeat")
    return NodeDescription(ip=response.node_ip, hostname=response.hostname, devices=tuple(specs),
                           samples=tuple(samples))
