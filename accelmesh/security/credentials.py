"""The credentials folder of an embedded mesh: a throwaway CA and everything issued from it.

``accelmesh up`` (and every embedded mesh) makes it under its data dir as ``credentials/``:

    ca.crt, ca.key                 the mesh CA (the key never leaves this folder)
    <role>.crt, <role>.key         inventory, compile, dispatch, worker: each service's identity
                                   (worker: the worker on this machine's loopback)
    worker-node-<host>.crt, .key   the worker serving on <host>, issued on demand (`worker`)
    client.crt, client.key         a client certificate that only lets a program connect
    token                          the local operator's bearer token (clients send it)
    tokens.json                    digests of the tokens the services accept (tokens.py)

What exists is kept, so restarting a mesh keeps its CA, certificates and tokens; a certificate
that lacks a host it must now name is issued again, naming its hosts and the new ones.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from accelmesh.security.ca import CertificateAuthority
from accelmesh.security.config import Security
from accelmesh.security.files import private_dir, tighten_private, write_private
from accelmesh.security.identity import MESH_DOMAIN, SERVICE_ROLES, Role, certificate_identity, node_host
from accelmesh.security.tls import TlsFiles
from accelmesh.security.tokens import StaticTokens

LOCAL_HOSTS = ("localhost", "127.0.0.1", "::1")
LOCAL_OPERATOR = "local-operator"


class MeshCredentials:
    def __init__(self, folder: str | Path, *, hosts: Sequence[str] = ()):
        """Open ``folder``, creating what is missing; service certificates are valid for loopback
        and ``hosts`` (the addresses other machines reach the services at)."""
        # Keys and tokens: the folder is the owner's alone (one made before is tightened too).
        self.folder = private_dir(folder)
        self.ca = CertificateAuthority(self.folder)
        for role in sorted(SERVICE_ROLES, key=lambda r: r.value):
            # The worker's is the loopback node's (`worker` issues any other host's its own).
            self._ensure(role, role.value, [*LOCAL_HOSTS, *([] if role is Role.WORKER else hosts)], stem=role.value)
        if not (self.folder / "client.crt").exists():
            self.ca.issue(Role.CLIENT, "client")
        self.tokens = StaticTokens(self.folder / "tokens.json")
        if not self.token_file.exists():
            token = self.tokens.add(LOCAL_OPERATOR, Role.OPERATOR)
            write_private(self.token_file, token + "\n")
        for path in self.folder.glob("token*"):  # tokens written before files were owner-only
            tighten_private(path)

    @property
    def token_file(self) -> Path:
        return self.folder / "token"

    def files(self, stem: str) -> TlsFiles:
        return TlsFiles(self.ca.cert_file, self.folder / f"{stem}.crt", self.folder / f"{stem}.key")

    def service(self, role: Role) -> Security:
        """What a service of ``role`` runs with: its certificate, and the tokens it accepts."""
        return Security(self.files(role.value), tokens_file=self.tokens.path)

    def client(self, token_file: Path | None = None) -> Security:
        """A program calling the mesh: the client certificate and a token (the local operator's by default)."""
        return Security(self.files("client"), token_file=token_file or self.token_file)

    def env(self, role: Role, security: Security | None = None) -> dict[str, str]:
        """The environment a process of ``role`` (a service, or CLIENT) is started with; ``security``
        instead of the role's own (a worker's of its host, `worker`)."""
        security = security or (self.client() if role is Role.CLIENT else self.service(role))
        env = {"ACCELMESH_CA_FILE": str(security.tls.ca_file), "ACCELMESH_CERT_FILE": str(security.tls.cert_file),
               "ACCELMESH_KEY_FILE": str(security.tls.key_file), "ACCELMESH_INSECURE": "0"}
        if security.token_file:
            env["ACCELMESH_TOKEN_FILE"] = str(security.token_file)
        if security.tokens_file:
            env["ACCELMESH_TOKENS_FILE"] = str(security.tokens_file)
        return env

    def add_user(self, name: str, role: Role = Role.USER) -> Path:
        """A new token for ``name`` (accepted by the running services at once); returns its file."""
        token = self.tokens.add(name, role)
        path = self.folder / f"token-{name}"
        write_private(path, token + "\n")
        return path

    def issue(self, role: Role, name: str, hosts: Sequence[str] = ()) -> Security:
        """A certificate of its own for ``name`` in ``role`` (a user's, or a second worker's)."""
        issued = self.ca.issue(role, name, hosts, stem=f"{role.value}-{name}")
        return Security(TlsFiles(self.ca.cert_file, issued.cert_file, issued.key_file))


    def worker(self, host: str) -> Security:
        """What the worker serving on ``host`` (its node IP or DNS name) runs with: a certificate of
        its own, issued on first use, for the worker role, the node ``node-<host>`` and that host
        alone, so its key answers for no other node. The loopback names share the mesh's worker."""
        host = host.strip("[]").lower()
        if host in LOCAL_HOSTS:
            return self.service(Role.WORKER)
        name = f"node-{host}"
        stem = f"{Role.WORKER.value}-{name}".replace(":", "-")
        self._ensure(Role.WORKER, name, [host], stem=stem)
        return Security(self.files(stem), tokens_file=self.tokens.path)

    def _ensure(self, role: Role, name: str, hosts: Sequence[str], *, stem: str) -> None:
        """``<stem>.crt`` for ``role``/``name`` naming every one of ``hosts``: kept when it does,
        issued again (with the hosts it named as well) when it does not, or made when missing."""
        cert = self.folder / f"{stem}.crt"
        named: list[str] = []
        if cert.exists() and (self.folder / f"{stem}.key").exists():
            identity = certificate_identity(cert.read_bytes())
            if identity is not None and (identity.role, identity.name) == (role, name):
                if all(identity.names_host(h) and identity.names_host(node_host(role, h)) for h in hosts):
                    return
                named = sorted(h for h in identity.hosts if not h.endswith(MESH_DOMAIN))
        self.ca.issue(role, name, list(dict.fromkeys([*hosts, *named])), stem=stem)


def main(argv: list[str] | None = None) -> int:
    """`python -m accelmesh.security.credentials DIR [--host H ...] [--worker H ...]`: make (or keep)
    a credentials folder, e.g. for docker compose; --host adds an address the certificates of
    inventory, compile and dispatch name; --worker issues the certificate of the worker serving on
    that host (worker-node-<host>.crt/.key)."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m accelmesh.security.credentials", description=main.__doc__)
    parser.add_argument("folder")
    parser.add_argument("--host", action="append", default=[], help="a DNS name or IP the services are reached at")
    parser.add_argument("--worker", action="append", default=[], help="the node IP or DNS name a worker serves on")
    args = parser.parse_args(argv)
    credentials = MeshCredentials(args.folder, hosts=args.host)
    workers = [credentials.worker(host).tls.cert_file.name for host in args.worker]
    print(f"credentials in {credentials.folder}: ca.crt, <role>.crt/.key, client.crt/.key, token, tokens.json"
          + "".join(f", {name}" for name in workers))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
