"""bench/transfer_spike.py without root, namespaces or subprocesses: its Flight, grpcio and TCP
servers started in this process on 127.0.0.1 and its arms run against them for 4 MiB (the bytes
come back identical, the figures have the keys the JSON promises), the bearer ticket refused when
wrong, a changed byte caught by the check, and `choose` on figures made up here. Nothing about how
fast this host is."""

from __future__ import annotations

import sys
from pathlib import Path

import grpc
import numpy as np
import pyarrow.flight as flight
import pytest

# bench/ is no package: its scripts import each other by path, as this test does.
sys.path.append(str(Path(__file__).resolve().parents[2] / "bench"))
import transfer_spike as spike

MIB = 1024 * 1024
SIZE = 4 * MIB


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    credentials = spike.make_credentials(tmp_path_factory.mktemp("credentials"), ["127.0.0.1"])
    started = {kind: spike.start_server(kind, "127.0.0.1", 0, credentials, SIZE) for kind in spike.KINDS}
    yield credentials, {kind: server.port for kind, server in started.items()}
    for server in started.values():
        server.stop()


def test_every_arm_brings_back_the_bytes_it_put_and_reports_its_figures_beside_tcp(servers):
    credentials, ports = servers
    arms = spike.measure("127.0.0.1", ports, credentials, SIZE, reps=1)
    assert set(arms) == set(spike.ARMS)
    for figures in arms.values():
        assert set(figures) >= {*spike.FIGURES, "client_cpu_s", "client_minor_faults", "verified", "runs", "vs_tcp"}
        assert len(figures["runs"]) == 1 and figures["verified"]["crc32_of_all_bytes_runs"] == 1
        assert all(figures[f] > 0 for f in spike.FIGURES)
    assert arms["tcp"]["vs_tcp"] == {f: 1.0 for f in spike.FIGURES}


@pytest.mark.parametrize("arm", ("flight_1mib", "grpc_4mib", "tcp"))
def test_an_arm_returns_exactly_what_it_stored(servers, arm):
    credentials, ports = servers
    sent = np.random.default_rng(1).integers(0, 256, SIZE, dtype=np.uint8)
    received = np.zeros(SIZE, np.uint8)
    client = spike.open_arm(arm, "127.0.0.1", ports, spike.read_credentials(credentials))
    try:
        assert client.put(sent) == SIZE
        assert client.get(received) == SIZE
    finally:
        client.close()
    assert np.array_equal(sent, received)


def test_a_call_with_the_wrong_ticket_is_refused(servers):
    credentials, ports = servers
    creds = {**spike.read_credentials(credentials), "ticket": b"not-the-ticket"}
    data = np.ones(MIB, np.uint8)
    for arm, refused in (("grpc_1mib", grpc.RpcError), ("flight_1mib", flight.FlightUnauthenticatedError)):
        client = spike.open_arm(arm, "127.0.0.1", ports, creds)
        try:
            with pytest.raises(refused):
                client.put(data)
        finally:
            client.close()


def test_the_check_catches_one_changed_byte_that_the_sampled_slices_miss():
    sent = np.random.default_rng(2).integers(0, 256, MIB, dtype=np.uint8)
    got = sent.copy()
    got[MIB // 2] ^= 1
    spike.check_same(sent, got, stamps=[100], full=False)  # the slices alone do not see it
    with pytest.raises(AssertionError, match="crc32"):
        spike.check_same(sent, got, stamps=[100], full=True)
    with pytest.raises(AssertionError, match="offset"):
        spike.check_same(sent, got, stamps=[MIB // 2 - 10], full=False)


def test_the_choice_is_the_faster_of_the_best_flight_and_best_grpc_arm_in_netns():
    def arms(**roundtrip):
        return {"arms": {arm: {"roundtrip_mb_per_s": mb} for arm, mb in roundtrip.items()}}

    topologies = {"loopback": arms(flight_1mib=900, flight_4mib=100, grpc_1mib=500, grpc_4mib=100, tcp=2000),
                  "netns": arms(flight_1mib=400, flight_4mib=450, grpc_1mib=300, grpc_4mib=500, tcp=900)}
    choice = spike.choose(topologies)
    assert (choice["path"], choice["topology"]) == ("grpc", "netns")
    assert choice["best_arms"] == {"flight": "flight_4mib", "grpc": "grpc_4mib"}
    assert choice["ratio_grpc_over_flight"] == pytest.approx(500 / 450, abs=1e-3)
    assert spike.choose({"loopback": topologies["loopback"]})["path"] == "flight"
