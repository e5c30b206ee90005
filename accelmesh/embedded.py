"""The embedded default: every mesh process on this machine, on loopback, state under one folder.

Security is on: the mesh's CA, the services' certificates and the local operator's token are made
under ``<data dir>/credentials`` (or ``ACCELMESH_CREDENTIALS_DIR``) on first start and kept. The
services' certificates name the hosts they listen on (for a wildcard, this machine's names and
addresses) and any ``advertise`` names; each worker has a certificate of its own, for its host.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from accelmesh.inventory.v1 import inventory_service_pb2 as inv_pb
from accelmesh.inventory.v1 import inventory_service_pb2_grpc
from accelmesh.runtime.channels import open_channel
from accelmesh.runtime.launcher import ServiceProcess, start_service
from accelmesh.security.config import INSECURE, Security
from accelmesh.security.credentials import LOCAL_HOSTS, MeshCredentials
from accelmesh.security.files import private_dir
from accelmesh.security.identity import Role, address_host

DEFAULT_DATA_DIR = ".accelmesh"
# Two bf16-capable accelerators and two without bf16: the smallest pool where rules must differ.
DEFAULT_EMULATE = ("a100-80gb", "a100-80gb", "v100-32gb", "v100-32gb")


def mesh_credentials(data_dir: str | Path, env=os.environ, *, hosts: Sequence[str] = ()) -> MeshCredentials:
    """The credentials of the mesh kept under ``data_dir`` (made on first use); the services'
    certificates name ``hosts`` besides loopback."""
    return MeshCredentials(env.get("ACCELMESH_CREDENTIALS_DIR") or Path(data_dir) / "credentials", hosts=hosts)


def certificate_hosts(listen: Iterable[str], advertise: Sequence[str] = ()) -> list[str]:
    """The hosts the services' certificates must name to be reached at what they listen on: each
    address's host, or for a wildcard (0.0.0.0, ::) this machine's name and addresses; then
    ``advertise`` (the names clients use that this machine cannot know: a DNS alias, a NAT's address)."""
    hosts: list[str] = []
    for address in listen:
        host = address_host(address)
        hosts += this_machine() if _is_wildcard(host) else [host]
    return [h for h in dict.fromkeys([*hosts, *advertise]) if h and h not in LOCAL_HOSTS]


def this_machine() -> list[str]:
    """This machine's host name, its fully qualified name, and the addresses they resolve to."""
    names = list(dict.fromkeys([socket.gethostname(), socket.getfqdn()]))
    try:
        addresses = [info[4][0] for info in socket.getaddrinfo(names[0], None, proto=socket.IPPROTO_TCP)]
    except OSError:  # a name that does not resolve: its certificate names what is known
        addresses = []
    return list(dict.fromkeys([*(n.lower() for n in names), *(a.split("%")[0] for a in addresses)]))


def _is_wildcard(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return host == ""


def reachable(address: str) -> str:
    """``address`` as this machine dials it: a wildcard listener is reached on loopback."""
    host, _, port = address.rpartition(":")
    if not _is_wildcard(address_host(address)):
        return address
    return f"[::1]:{port}" if ":" in host.strip("[]") else f"127.0.0.1:{port}"


def service_env(credentials: MeshCredentials | None, role: Role) -> dict[str, str]:
    """The environment of a service process: its credentials, or plaintext when ``credentials`` is None."""
    return credentials.env(role) if credentials is not None else {"ACCELMESH_INSECURE": "1"}


@dataclass
class EmbeddedMesh:
    data_dir: Path
    inventory: ServiceProcess
    credentials: MeshCredentials | None  # None: running --insecure
    compile: ServiceProcess | None = None
    dispatch: ServiceProcess | None = None
    workers: list[ServiceProcess] = field(default_factory=list)

    @property
    def client(self) -> Security:
        """What a program calling this mesh connects with: the client certificate and operator token."""
        return self.credentials.client() if self.credentials is not None else INSECURE

    def stop(self) -> None:
        for process in [self.dispatch, *self.workers, self.compile, self.inventory]:
            if process is not None:
                process.terminate()

    def __enter__(self) -> EmbeddedMesh:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def start_worker(
    inventory_address: str, compile_address: str, credentials: MeshCredentials | None, *, devices: int,
    emulate: Sequence[str] = (), listen: str = "127.0.0.1:0", echo: bool = False, name: str = "worker",
    artifact_dir: Path | None = None, nvml: bool = True, env: dict[str, str] | None = None,
) -> ServiceProcess:
    """`nvml=False`: the worker offers no GPU of this machine, only its CPU and emulated devices.
    The worker runs with a certificate of its own for the host of ``listen`` (MeshCredentials.worker);
    `env` is added to the worker's."""
    args = ["--listen", listen, "--devices", str(devices), "--inventory", inventory_address,
            "--compile", compile_address]
    if not nvml:
        args.append("--no-nvml")
    if artifact_dir is not None:
        args += ["--artifact-dir", str(artifact_dir)]
    if emulate:
        args += ["--emulate", ",".join(emulate)]
    host = address_host(listen)  # a wildcard names no node: its caller gives the certificate in `env`
    own = {} if credentials is None or _is_wildcard(host) else credentials.env(Role.WORKER, credentials.worker(host))
    return start_service(name, "worker_svc", args, echo=echo,
                         env={**service_env(credentials, Role.WORKER), **own, **(env or {})})


def start_inventory(
    data_dir: Path, credentials: MeshCredentials | None, *, listen: str = "127.0.0.1:0", poll_interval_s: float = 5.0,
    lost_after_polls: int = 3,
    echo: bool = False, db: str = "", name: str = "inventory",
) -> ServiceProcess:
    """`db`: the inventory's database URL (replicas share one); default, the SQLite file in `data_dir`."""
    args = ["--listen", listen, "--db", db or str(data_dir / "inventory.db"),
            "--poll-interval", str(poll_interval_s), "--lost-after", str(lost_after_polls)]
    return start_service(name, "inventory_svc", args, echo=echo, env=service_env(credentials, Role.INVENTORY))


def start_compile(data_dir: Path, credentials: MeshCredentials | None, *, listen: str = "127.0.0.1:0",
                  echo: bool = False, name: str = "compile", rules: Path | None = None) -> ServiceProcess:
    """Replicas started on one `data_dir` share its artifact store and uploaded programs. `rules`:
    a compile rule file of the operator's (default: the shipped deploy/rules/compile_rules.toml)."""
    args = ["--listen", listen, "--cache-dir", str(data_dir / "artifacts"),
            "--programs-dir", str(data_dir / "programs")]
    if rules is not None:
        args += ["--rules", str(rules)]
    return start_service(name, "compile_svc", args, echo=echo, env=service_env(credentials, Role.COMPILE))


def start_dispatch(data_dir: Path, inventory: str, compile_address: str, credentials: MeshCredentials | None, *,
                   listen: str = "127.0.0.1:0", echo: bool = False, env: dict[str, str] | None = None,
                   name: str = "dispatch") -> ServiceProcess:
    """`inventory` and `compile_address` may name several replicas (`ipv4:host:port,host:port`);
    replicas of dispatch share `data_dir` and, through `env`, their job book's database."""
    args = ["--listen", listen, "--inventory", inventory, "--compile", compile_address,
            "--data-dir", str(data_dir / "dispatch")]
    return start_service(name, "dispatch_svc", args, echo=echo,
                         env={**service_env(credentials, Role.DISPATCH), **(env or {})})


def forget_earlier_workers(mesh: EmbeddedMesh) -> list[str]:
    """Remove the nodes an earlier run on this data dir registered: each start's worker listens on a
    new port, so it is a new node, and the last one's, gone with its run, would be polled as lost
    until the inventory forgets it (an hour). Called before this run's worker registers, so every
    node the inventory has then is an earlier run's."""
    with open_channel(mesh.inventory.address, security=mesh.client) as channel:
        stub = inventory_service_pb2_grpc.InventoryServiceStub(channel)
        nodes = [n.address for n in stub.ListNodes(inv_pb.ListNodesRequest()).nodes]
        for address in nodes:
            stub.RemoveNode(inv_pb.RemoveNodeRequest(address=address, force=True))
    return nodes


def start_embedded_mesh(
    data_dir: str | Path = DEFAULT_DATA_DIR,
    *,
    devices: int = 4,
    emulate: Sequence[str] = DEFAULT_EMULATE,
    inventory_listen: str = "127.0.0.1:0",
    compile_listen: str = "127.0.0.1:0",
    dispatch_listen: str = "127.0.0.1:0",
    poll_interval_s: float = 5.0,
    lost_after_polls: int = 3,
    echo: bool = False,
    nvml: bool = True,
    insecure: bool = False,
    advertise: Sequence[str] = (),
) -> EmbeddedMesh:
    """``insecure``: plaintext without authentication (every address here is loopback).
    ``advertise``: more DNS names or IPs the services' certificates name (certificate_hosts)."""
    data_dir = private_dir(data_dir)  # credentials, databases and tenants' data, the owner's alone
    hosts = certificate_hosts([inventory_listen, compile_listen, dispatch_listen], advertise)
    credentials = None if insecure else mesh_credentials(data_dir, hosts=hosts)
    inventory = _dialled(start_inventory(data_dir, credentials, listen=inventory_listen,
                                         poll_interval_s=poll_interval_s, lost_after_polls=lost_after_polls, echo=echo))
    mesh = EmbeddedMesh(data_dir, inventory, credentials)
    try:
        forget_earlier_workers(mesh)
        mesh.compile = _dialled(start_compile(data_dir, credentials, listen=compile_listen, echo=echo))
        mesh.workers.append(start_worker(inventory.address, mesh.compile.address, credentials, devices=devices,
                                         emulate=emulate, echo=echo, artifact_dir=data_dir / "worker-artifacts",
                                         nvml=nvml))
        mesh.dispatch = _dialled(start_dispatch(data_dir, inventory.address, mesh.compile.address, credentials,
                                                listen=dispatch_listen, echo=echo))
    except BaseException:
        mesh.stop()
        raise
    return mesh


def _dialled(process: ServiceProcess) -> ServiceProcess:
    """The process with the address it is dialled at (its ready line names a wildcard as such)."""
    process.address = reachable(process.address)
    return process
