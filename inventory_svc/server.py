"""Build, serve and shut down the inventory: store + node client + poller + follower + servicer."""

from __future__ import annotations

from accelmesh.inventory.v1 import inventory_service_pb2_grpc
from accelmesh.runtime import database
from accelmesh.runtime.metrics import Metrics
from accelmesh.runtime.periodic import Periodic
from accelmesh.runtime.server import MeshServer, Service, create_server
from accelmesh.runtime.telemetry import configure_telemetry, tracer
from accelmesh.security.access import PEOPLE, Access, Authenticator, roles
from accelmesh.security.identity import Role
from inventory_svc.config import InventoryConfig
from inventory_svc.inventory import Inventory
from inventory_svc.metrics import InventoryMetrics
from inventory_svc.node_client import NodeClient
from inventory_svc.poller import Poller
from inventory_svc.servicer import InventoryServicer
from inventory_svc.store import SqlStore

SERVICE_NAME = "accelmesh.inventory.v1.InventoryService"
_READERS = PEOPLE | roles(Role.DISPATCH, Role.COMPILE)
ACCESS: Access = {
    "RegisterNode": roles(Role.WORKER),  # and only for the node its certificate names (servicer)
    "ListNodes": roles(Role.DISPATCH, Role.OPERATOR),  # the dispatcher's refresh finds the nodes that answered
    "RemoveNode": roles(Role.OPERATOR),  # a person's decision: the node's jobs may lose their devices (force)
    "ListDevices": _READERS,
    "GetDevice": _READERS,
    "WatchDevices": _READERS,
    "ScoreDevices": _READERS,
    "RefreshDevices": roles(Role.DISPATCH, Role.OPERATOR),
    "ReserveDevices": roles(Role.DISPATCH),
    "RenewReservations": roles(Role.DISPATCH),  # the dispatcher, while the job holding them runs
    "ReleaseDevices": roles(Role.DISPATCH),
    "ListReservations": roles(Role.DISPATCH, Role.OPERATOR),
    "MarkNodeSuspect": roles(Role.DISPATCH, Role.OPERATOR),  # a dispatcher whose spot check found it wrong
    "TrustNode": roles(Role.OPERATOR),  # a person's decision, after looking into it
}


def build_inventory(
    config: InventoryConfig, *, tracer_provider=None, start_poller: bool = True,
) -> tuple[MeshServer, Inventory]:
    if tracer_provider is None:
        tracer_provider = configure_telemetry("accelmesh-inventory")
    # A database that cannot be opened raises FailedPrecondition naming it (password left out),
    # which run_service prints before exiting non-zero. SQLite's folder is created by open_engine.
    store = SqlStore(config.db, config.max_samples_per_device, config.sample_retention_s)
    client = NodeClient(config.security, timeout_s=config.poll_timeout_s, tracer_provider=tracer_provider)
    # Replicas on one database split the nodes by leases derived from each one's poll interval:
    # give them the same ACCELMESH_POLL_INTERVAL_S, or a dead replica's nodes wait on the longest.
    # The shutdown below (inventory.close) hands this replica's nodes back.
    inventory = Inventory(
        store, client.describe, lost_after_polls=config.lost_after_polls, tracer=tracer(tracer_provider, __name__),
        poll_interval_s=config.poll_interval_s, forget_lost_after_s=config.forget_lost_after_s,
    )
    metrics = Metrics("inventory", config.metrics_listen, config.security, config.http)
    poller = Poller(InventoryMetrics(metrics, inventory).timed(inventory.poll_all), inventory.take_over,
                    config.poll_interval_s)
    # Started with the server, poller or not: watchers hear of other replicas' changes through it.
    # (Inventory.follow: the index stays close behind them between rankings.)
    follower = Periodic("inventory-follower", inventory.follow, config.follow_interval_s,
                        "reading the other inventory replicas' changes")
    servicer = InventoryServicer(inventory, Authenticator(config.security))

    def shutdown():
        poller.stop()
        follower.stop()
        servicer.close()
        inventory.close()
        client.close()
        store.close()

    server = create_server(
        [Service(SERVICE_NAME, inventory_service_pb2_grpc.add_InventoryServiceServicer_to_server, servicer)],
        security=config.security,
        access=ACCESS,
        address=config.listen,
        health_listen=config.health_listen,
        max_message_bytes=config.max_message_bytes,
        tracer_provider=tracer_provider,
        on_stop=[shutdown],
        metrics=metrics,
    )
    # Readiness: NOT_SERVING while the database does not answer (liveness stays SERVING).
    server.watch_dependencies({"inventory database": lambda: database.ping(store.engine)})
    follower.start()
    if start_poller:
        poller.start()
    return server, inventory
