"""`accelmesh nodes list` and `accelmesh nodes remove`, called in-process as `accelmesh.cli.main`
against a real in-process inventory and worker (TLS, the local operator's token as the CLI finds
it), read from stdout and stderr: the node table, a removal, and the one-line refusals."""

from __future__ import annotations

import pytest
from _inventory_helpers import claim, register

from accelmesh.cli import main
from accelmesh.inventory.v1 import inventory_service_pb2 as pb

from conftest import CREDENTIALS

pytestmark = pytest.mark.fixture_cpu


@pytest.fixture
def cli(inventory, capsys):
    server, _ = inventory

    def run(*argv: str) -> tuple[int, str, str]:
        """`accelmesh ARGV --inventory <the inventory>`: exit code, stdout, stderr."""
        capsys.readouterr()
        code = main([*argv, "--inventory", f"127.0.0.1:{server.port}"])
        out, err = capsys.readouterr()
        return code, out, err

    return run


def test_nodes_list_shows_each_node_and_says_when_there_is_none(cli, inventory_stub, worker):
    assert cli("nodes", "list") == (0, "no nodes registered; a worker registers its node when it starts\n", "")
    address = register(inventory_stub, worker).node.address
    code, out, _ = cli("nodes", "list")
    header, *rows = out.splitlines()
    assert code == 0 and header.split() == ["ADDRESS", "HOSTNAME", "IP", "STATE", "DEVICES", "SUSPECT", "LAST", "SEEN",
                                            "MISSED", "POLLS", "LAST", "ERROR"]
    assert [row.split()[:6] for row in rows] == [[address, "node-a", "127.0.0.1", "active", "3", "no"]]


def test_nodes_remove_refuses_a_held_node_in_one_line_then_removes_it_with_force(cli, inventory_stub, worker):
    address = register(inventory_stub, worker).node.address
    inventory_stub.ReserveDevices(pb.ReserveDevicesRequest(job_id="job-7", claims=[claim()], ttl_seconds=600))
    code, out, err = cli("nodes", "remove", address)
    assert code == 1 and out == ""
    assert err.startswith("accelmesh: FAILED_PRECONDITION: ") and err.count("\n") == 1
    assert "job-7" in err and "accelmesh nodes remove --force" in err
    code, out, err = cli("nodes", "remove", address, "--force")
    assert (code, err) == (0, "")
    assert out == (f"removed node {address} and its 3 device(s) (127.0.0.1/cpu:2, 127.0.0.1/cuda:0, 127.0.0.1/cuda:1); "
                   "ended the reservations of job(s) job-7\n")
    assert cli("nodes", "list")[1].startswith("no nodes registered")


def test_nodes_remove_of_an_unknown_address_says_how_to_list_the_nodes(cli):
    code, out, err = cli("nodes", "remove", "10.9.9.9:50070")
    assert code == 1 and out == "" and err.count("\n") == 1
    assert err.startswith("accelmesh: NOT_FOUND: address: node '10.9.9.9:50070' is not registered")
    assert "`accelmesh nodes list`" in err


def test_nodes_remove_is_refused_to_a_user(cli, inventory_stub, worker, monkeypatch):
    address = register(inventory_stub, worker).node.address
    monkeypatch.setenv("ACCELMESH_TOKEN_FILE", str(CREDENTIALS.add_user("nodes-cli-carol")))
    code, _, err = cli("nodes", "remove", address, "--force")
    assert code == 1 and err.startswith("accelmesh: PERMISSION_DENIED: ") and "needs the role operator" in err
    monkeypatch.delenv("ACCELMESH_TOKEN_FILE")
    assert cli("nodes", "list")[1].split("\n")[1].startswith(address)


def test_nodes_list_shows_a_suspect_node_with_why_and_nodes_trust_clears_it(cli, inventory_stub, worker):
    address = register(inventory_stub, worker).node.address
    inventory_stub.MarkNodeSuspect(pb.MarkNodeSuspectRequest(address=address, reason="job j: shard 2 disagreed"))
    code, out, _ = cli("nodes", "list")
    header, row, why = out.splitlines()
    assert code == 0 and row.split()[5] == "SUSPECT"
    assert why.startswith(f"{address} is suspect since ") and why.endswith(": job j: shard 2 disagreed")
    assert cli("nodes", "trust", address) == (
        0, f"node {address} is trusted again: its 3 device(s) are candidates for jobs\n", "")
    assert cli("nodes", "list")[1].splitlines()[1].split()[5] == "no"
