"""Build and run the worker (node agent) server."""

from __future__ import annotations

import logging

from accelmesh.inventory.v1 import inventory_service_pb2, inventory_service_pb2_grpc
from accelmesh.runtime.admission import Admission
from accelmesh.runtime.channels import open_channel
from accelmesh.runtime.metrics import Metrics
from accelmesh.runtime.server import MeshServer, Service, create_server
from accelmesh.runtime.telemetry import configure_telemetry
from accelmesh.runtime.tensors import DEFAULT_CHUNK_BYTES
from accelmesh.security.access import BY_TICKET, Access, Authenticator, roles
from accelmesh.security.identity import Role
from accelmesh.security.tickets import TicketVerifier
from accelmesh.worker.v1 import worker_service_pb2_grpc
from worker_svc.agent import NodeAgent
from worker_svc.artifacts import ArtifactStore
from worker_svc.config import WorkerConfig
from worker_svc.executor import ArtifactSource, ShardExecutor
from worker_svc.held_tensors import HeldTensors
from worker_svc.metrics import WorkerMetrics
from worker_svc.object_methods import ObjectMethods
from worker_svc.objects import ObjectStore
from worker_svc.segments import sweep_stale
from worker_svc.servicer import WorkerServicer

log = logging.getLogger(__name__)

SERVICE_NAME = "accelmesh.worker.v1.WorkerService"
ACCESS: Access = {"DescribeNode": roles(Role.INVENTORY), "Execute": roles(Role.DISPATCH),
                  "ExecuteMany": roles(Role.DISPATCH), "ReleaseJob": roles(Role.DISPATCH),
                  # The ticket each call carries says whose objects it may touch (object_methods.py).
                  "PutObjects": BY_TICKET, "FetchObjects": BY_TICKET, "MapObjects": BY_TICKET,
                  "SealObjects": BY_TICKET, "ReleaseObjects": BY_TICKET}
REGISTER_TIMEOUT_S = 10.0
# Each Execute call (and each ExecuteMany call, for its shards in turn) holds a stream thread while
# its shard waits for, loads and runs on a device,
# and the inputs it received: a worker runs CALLS_PER_DEVICE of them a device, plus spares (a
# retry arriving while the failed call winds down); further calls wait for a thread, their
# inputs not yet read. DescribeNode polls and health run on threads of their own beside them.
SPARE_THREADS = 8
CALLS_PER_DEVICE = 4


def build_worker(config: WorkerConfig, *, agent: NodeAgent | None = None, artifacts: ArtifactSource | None = None,
                 tracer_provider=None) -> MeshServer:
    agent = agent or NodeAgent(config.node_ip, emulate=config.emulate, proc_root=config.proc_root,
                               use_nvml=config.nvml)
    if tracer_provider is None:
        tracer_provider = configure_telemetry("accelmesh-worker")
    store = None
    if artifacts is None:
        artifacts = store = ArtifactStore(config.artifact_dir, config.compile, config.security,
                                          max_message_bytes=config.max_message_bytes,
                                          tracer_provider=tracer_provider)
    devices = {d.id: d for d in agent.describe().devices}
    executor = ShardExecutor(devices, agent.jax_devices, artifacts)
    held = HeldTensors(config.held_bytes, config.held_idle_s, max_tensors=config.held_tensors)
    sweep_stale(config.store_root)  # segments a killed worker of this host left behind
    objects = ObjectStore(config.store_bytes, root=config.store_root, ttl_s=config.store_ttl_s,
                          wait_s=config.store_wait_s, max_objects=config.store_objects)
    object_methods = ObjectMethods(objects, TicketVerifier(config.security), config.node_ip,
                                   min(DEFAULT_CHUNK_BYTES, config.max_message_bytes // 2))
    servicer = WorkerServicer(agent, executor, held, Authenticator(config.security),
                              max_input_bytes=config.max_input_bytes, max_inputs=config.max_inputs,
                              max_message_bytes=config.max_message_bytes, objects=object_methods,
                              tracer=tracer_provider.get_tracer("accelmesh.worker") if tracer_provider else None)
    metrics = Metrics("worker", config.metrics_listen, config.security, config.http)
    WorkerMetrics(metrics, executor, held, objects)
    return create_server(
        [Service(SERVICE_NAME, worker_service_pb2_grpc.add_WorkerServiceServicer_to_server, servicer)],
        security=config.security,
        access=ACCESS,
        address=config.listen,
        health_listen=config.health_listen,
        max_workers=SPARE_THREADS,
        admission=Admission.from_env(stream_threads=SPARE_THREADS + CALLS_PER_DEVICE * len(devices)),
        max_message_bytes=config.max_message_bytes,
        tracer_provider=tracer_provider,
        on_stop=[objects.close, *([store.close] if store is not None else [])],
        metrics=metrics,
    )


def advertised_address(config: WorkerConfig, port: int) -> str:
    return f"{config.node_ip}:{port}"


def register_with_inventory(config: WorkerConfig, port: int, tracer_provider=None) -> None:
    """Tell the inventory where this node is; it polls the node from then on."""
    with open_channel(config.inventory, security=config.security, role=Role.INVENTORY,
                      tracer_provider=tracer_provider) as channel:
        stub = inventory_service_pb2_grpc.InventoryServiceStub(channel)
        response = stub.RegisterNode(
            inventory_service_pb2.RegisterNodeRequest(address=advertised_address(config, port)),
            timeout=REGISTER_TIMEOUT_S,
        )
    log.info("registered %s with %s: %d devices", response.node.address, config.inventory, len(response.devices))
