"""SqlStore on PostgreSQL only: what a shared server adds. Two replicas (two stores, two engines)
racing for the last free memory of a device, an unreachable server at start, a server that goes
away mid-use and comes back; and the configuration that names such a database."""

from __future__ import annotations

import threading

import pytest
from store_records import GB, NODE, report, sample, spec

from accelmesh.errors import FailedPrecondition, InvalidArgument, ResourceExhausted, Unavailable
from inventory_svc.config import parse_args
from inventory_svc.store import SqlStore

from conftest import _postgres_server

ROUNDS = 10


@pytest.fixture
def replicas(postgres_url):
    """Two stores on one database, as two inventory replicas would be, and the device they share."""
    first, second = SqlStore(postgres_url), SqlStore(postgres_url)
    first.upsert_node(NODE, "10.0.0.1", "host", now=0.0)
    gpu = spec()
    first.record_poll_success(NODE, report([gpu], [sample(gpu, 0.0)]), now=0.0)
    yield first, second, gpu
    first.close()
    second.close()


def test_two_replicas_reserving_the_last_free_memory_at_once_exactly_one_wins(replicas):
    first, second, gpu = replicas
    first.reserve("resident", gpu.id, 60 * GB, 0.5, ttl_s=600, now=1.0)  # 20 GB left
    for round_ in range(ROUNDS):
        barrier = threading.Barrier(2)
        outcomes: dict[str, str] = {}

        def claim(store: SqlStore, job: str, barrier=barrier, outcomes=outcomes) -> None:
            barrier.wait()
            try:
                store.reserve(job, gpu.id, 20 * GB, 0.1, ttl_s=600, now=2.0)
                outcomes[job] = "won"
            except ResourceExhausted as exc:
                outcomes[job] = str(exc)

        jobs = (f"a-{round_}", f"b-{round_}")
        threads = [threading.Thread(target=claim, args=(store, job)) for store, job in zip((first, second), jobs)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        winners = [job for job in jobs if outcomes[job] == "won"]
        assert len(winners) == 1, outcomes
        (loser,) = set(jobs) - set(winners)
        assert "requested 20000000000 bytes" in outcomes[loser] and "only 0 bytes are free" in outcomes[loser]
        assert [r.job_id for r in second.reservations(device_id=gpu.id)] == sorted(["resident", winners[0]])
        assert first.release(winners[0]) == 1


def test_an_unreachable_server_is_refused_naming_the_url_without_its_password(tmp_path):
    url = f"postgresql://accelmesh:s3cret-pw@/accelmesh?host={tmp_path / 'no-such-socket-dir'}"
    with pytest.raises(FailedPrecondition, match="cannot be opened") as info:
        SqlStore(url)
    message = str(info.value)
    assert "postgresql://accelmesh:***@/accelmesh" in message and "s3cret-pw" not in message


def _allow_connections(url: str, allowed: bool) -> None:
    _postgres_server().allow_connections(url, allowed)


def test_a_database_that_goes_away_answers_unavailable_and_serves_again_once_back(replicas, postgres_url):
    store, _, gpu = replicas
    assert store.get_device(gpu.id, now=1.0).health == "healthy"  # the pool holds a live connection
    _allow_connections(postgres_url, False)
    try:
        with pytest.raises(Unavailable, match="not answering.*try again"):
            store.get_device(gpu.id, now=1.0)
        with pytest.raises(Unavailable, match="accelmesh@/"):
            store.reserve("job-1", gpu.id, GB, 0.1, ttl_s=60, now=1.0)
    finally:
        _allow_connections(postgres_url, True)
    assert store.reserve("job-1", gpu.id, GB, 0.1, ttl_s=60, now=1.0).memory_bytes == GB
    assert store.get_device(gpu.id, now=2.0).reserved_memory_bytes == GB


def test_the_database_setting_takes_a_postgresql_url_and_refuses_other_engines():
    url = "postgresql://inventory:pw@db.internal:5432/accelmesh"
    assert parse_args(["--insecure", "--db", url]).db == url
    assert parse_args(["--insecure"], env={"ACCELMESH_INVENTORY_DB": url}).db == url
    with pytest.raises(InvalidArgument, match=r"mysql://inventory:\*\*\*@db/x.*not supported"):
        parse_args(["--insecure", "--db", "mysql://inventory:pw@db/x"])


def test_the_inventory_is_not_ready_while_its_database_is_away(postgres_url):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from accelmesh.runtime.channels import open_channel
    from inventory_svc.config import InventoryConfig
    from inventory_svc.server import SERVICE_NAME, build_inventory

    server, _ = build_inventory(InventoryConfig(listen="127.0.0.1:0", db=postgres_url), start_poller=False)
    server.watch_dependencies(server.dependencies, interval_s=0.05)  # what build_inventory watches, often
    server.start()
    try:
        with open_channel(f"127.0.0.1:{server.port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            readiness = health.Watch(health_pb2.HealthCheckRequest(service=""), timeout=30)

            def until(status):
                return next(r.status for r in readiness if r.status == status)

            until(health_pb2.HealthCheckResponse.SERVING)
            _allow_connections(postgres_url, False)
            try:
                until(health_pb2.HealthCheckResponse.NOT_SERVING)
                alive = health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=30)
                assert alive.status == health_pb2.HealthCheckResponse.SERVING  # liveness: the process is fine
            finally:
                _allow_connections(postgres_url, True)
            until(health_pb2.HealthCheckResponse.SERVING)
            readiness.cancel()
    finally:
        server.stop(0)
