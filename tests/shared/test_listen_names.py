"""The names a service's certificate must carry to be reached where it listens: the hosts of the
embedded mesh's listen addresses (a wildcard's being this machine's), `--advertise` names, and
the CLI's message when the certificate of the server it dialled does not name the host (here
127.0.0.2, another loopback address, against a certificate naming 127.0.0.1 alone)."""

from __future__ import annotations

import socket

import pytest
from _server_helpers import ScriptedWorker, start_server

from accelmesh.cli import main
from accelmesh.embedded import certificate_hosts, reachable


def test_the_certificate_hosts_are_the_listen_hosts_a_wildcards_machine_names_and_the_advertised():
    assert certificate_hosts(["127.0.0.2:0", "127.0.0.1:50051", "[::1]:0"], ["mesh.example"]) == [
        "127.0.0.2", "mesh.example"]  # loopback is always named
    everywhere = certificate_hosts(["0.0.0.0:50051"])
    assert socket.gethostname().lower() in everywhere and "0.0.0.0" not in everywhere
    assert "::" not in certificate_hosts(["[::]:50051"])


@pytest.mark.parametrize(("address", "dialled"), [
    ("0.0.0.0:50051", "127.0.0.1:50051"), ("[::]:50051", "[::1]:50051"), ("127.0.0.2:7", "127.0.0.2:7")])
def test_a_wildcard_listener_is_dialled_on_loopback(address, dialled):
    assert reachable(address) == dialled


def test_the_cli_says_the_certificate_does_not_name_the_address_and_how_to_fix_it_not_to_start_the_mesh(capsys):
    """A server that answers with a certificate not naming the dialled host is not 'nothing answers'."""
    server = start_server(ScriptedWorker(), address="127.0.0.2:0")
    try:
        code = main(["nodes", "list", "--inventory", f"127.0.0.2:{server.port}"])
    finally:
        server.stop(0)
    err = capsys.readouterr().err
    assert code == 1
    assert "does not name 127.0.0.2" in err, err
    assert "--advertise 127.0.0.2" in err and "accelmesh.security.credentials DIR --host 127.0.0.2" in err, err
    assert "start the mesh" not in err, err
