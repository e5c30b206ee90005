"""Transfer spike: which bulk path between a client and a worker's object store on another host.

    .venv/bin/python bench/transfer_spike.py [--where loopback|netns|both] [--mib 256] [--quick] [--reps 3]

Prints one JSON document on stdout (progress on stderr). `--where netns` (and the default `both`)
needs root. A client puts N bytes (256 MiB; `--quick` 32 MiB) into an in-memory store of a
server process, then gets the same N bytes back, by each arm in one run:

(a) flight_1mib, flight_4mib: Arrow Flight (pyarrow.flight) over mutual TLS (a throwaway EC P-256
    CA, server and client certificates made with `cryptography`; the server has verify_client=True
    and the CA as root_certificates). DoPut streams record batches of one binary column, one value
    of 1 or 4 MiB per batch (zero-copy views of the client's buffer); the server copies each into
    a preallocated numpy store and answers the byte count as metadata. DoGet streams the store back
    as zero-copy batches; the client copies them into a preallocated buffer. Every call carries
    `authorization: Bearer <ticket>`, checked by a server middleware.
(b) grpc_1mib, grpc_4mib: plain grpcio, mutual TLS (require_client_auth=True), the same bearer
    header checked in the handlers, 16 MiB message limits both sides. A generic handler with no
    (de)serializers: Put is a client stream of raw 1 or 4 MiB frames (bytes of memoryview slices)
    copied into a preallocated store, Get a server stream of bytes of the store's slices, copied
    into a preallocated buffer by the client.
(c) tcp: the floor. A plain socket, no TLS, no authentication: sendall of one memoryview, recv_into
    a preallocated buffer, both directions.

Each run times put, get and the round trip (put + get); MB/s = N / seconds (MB = 10^6 bytes). The
arms alternate (reversed every other repetition) after one untimed warm-up each; medians over the
repetitions, every run listed, and each arm's medians as a ratio to tcp's from the same run and
topology. Before every put a few random stamps are written into the client's data and the
receive buffer's copies of them spoiled, so a put that stored nothing fails the check after the
get; every run compares those slices and both ends, and the first run of each arm compares the
crc32 of all N bytes. The client's CPU seconds and minor page faults per round trip are listed
beside (its own process only).

Topologies: `loopback` (servers in subprocesses on 127.0.0.1, the client this process) and
`netns` (two network namespaces, am-<pid>-h1 with the servers and am-<pid>-h2 with the client,
joined by a veth pair with 10.232.<n>.1/24 and .2/24; both ends run this file under
`ip netns exec`, the client as `--role client`, and this process collects its JSON). The
namespaces are made and removed as deploy/netns/multihost.py does (named so its --cleanup-stale
removes what a SIGKILLed run leaves), also on Ctrl-C. A veth pair is memory to memory through
the kernel's network stack: it shows what each protocol's stack costs per byte on this machine,
not what a wire between hosts allows. Server processes (`--role server --kind flight|grpc|tcp`)
start once per kind and topology and serve every repetition. `choice` is the faster of the best
Flight and best grpcio arm on round trip MB/s in netns (loopback when netns was not run).
machine.cpu_during_measurement says how much CPU other processes used while the arms ran (near 0
on a quiet machine; the TLS arms are CPU-bound on 2 cores, so anything else running slows them).
Compare ratios across machines, not MB/s.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.util
import ipaddress
import json
import os
import platform
import resource
import secrets
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np
import pyarrow as pa
import pyarrow.flight as flight
from common import MIB, fresh_memory, progress, ratio

HERE = Path(__file__).resolve()
MULTIHOST = HERE.parents[1] / "deploy" / "netns" / "multihost.py"
ARMS = {"flight_1mib": ("flight", MIB), "flight_4mib": ("flight", 4 * MIB), "grpc_1mib": ("grpc", MIB),
        "grpc_4mib": ("grpc", 4 * MIB), "tcp": ("tcp", 0)}
KINDS = ("flight", "grpc", "tcp")
GRPC_OPTIONS = [("grpc.max_send_message_length", 16 * MIB), ("grpc.max_receive_message_length", 16 * MIB)]
SCHEMA = pa.schema([("frame", pa.binary())])
WARMUP_BYTES = 16 * MIB
SUBNET_PREFIX = "10.232"

# -- credentials ---------------------------------------------------------------------------------


def make_credentials(folder: Path, server_ips: list[str]) -> Path:
    """A CA, a server certificate naming `server_ips`, a client certificate (all EC P-256) and a
    bearer ticket, as PEM files in `folder`."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.UTC)

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def issue(subject: str, key, issuer: str, issuer_key, ca: bool, extensions=()):
        builder = (x509.CertificateBuilder().subject_name(name(subject)).issuer_name(name(issuer))
                   .public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(minutes=5))
                   .not_valid_after(now + datetime.timedelta(days=1))
                   .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        for extension in extensions:
            builder = builder.add_extension(extension, critical=False)
        return builder.sign(issuer_key, hashes.SHA256())

    def write(stem: str, cert, key) -> None:
        (folder / f"{stem}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        (folder / f"{stem}.key").write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                                               serialization.PrivateFormat.PKCS8,
                                                               serialization.NoEncryption()))

    folder.mkdir(parents=True, exist_ok=True)
    ca_key, server_key, client_key = (ec.generate_private_key(ec.SECP256R1()) for _ in range(3))
    write("ca", issue("spike-ca", ca_key, "spike-ca", ca_key, ca=True), ca_key)
    names = [x509.DNSName("localhost"), *(x509.IPAddress(ipaddress.ip_address(a)) for a in server_ips)]
    write("server", issue("spike-server", server_key, "spike-ca", ca_key, ca=False, extensions=(
        x509.SubjectAlternativeName(names), x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]))), server_key)
    write("client", issue("spike-client", client_key, "spike-ca", ca_key, ca=False, extensions=(
        x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]),)), client_key)
    (folder / "ticket").write_text(secrets.token_hex(16))
    return folder


def read_credentials(folder: Path) -> dict[str, bytes]:
    return {stem: (folder / stem).read_bytes()
            for stem in ("ca.pem", "server.pem", "server.key", "client.pem", "client.key", "ticket")}


# -- servers -------------------------------------------------------------------------------------


class Store:
    """The object store's memory: preallocated and touched once, so no arm pays first-touch faults."""

    def __init__(self, nbytes: int):
        self.array = np.ones(nbytes, np.uint8)
        self.view = memoryview(self.array)
        self.length = 0


class TicketCheck(flight.ServerMiddlewareFactory):
    def __init__(self, ticket: str):
        self.expected = [f"Bearer {ticket}"]

    def start_call(self, info, headers):
        if headers.get("authorization") != self.expected:
            raise flight.FlightUnauthenticatedError("no valid bearer ticket")
        return None


class FlightStore(flight.FlightServerBase):
    def __init__(self, location: str, store: Store, **kwargs):
        super().__init__(location, **kwargs)
        self.store = store

    def do_put(self, context, descriptor, reader, writer):
        offset = 0
        for chunk in reader:
            value = chunk.data.column(0)[0].as_buffer()
            self.store.array[offset:offset + value.size] = np.frombuffer(value, np.uint8)
            offset += value.size
        self.store.length = offset
        writer.write(pa.py_buffer(struct.pack("<Q", offset)))

    def do_get(self, context, ticket):
        frame, whole = int(ticket.ticket), pa.py_buffer(self.store.array)
        batches = []
        for offset in range(0, self.store.length, frame):
            size = min(frame, self.store.length - offset)
            offsets = pa.py_buffer(np.array([0, size], np.int32))
            column = pa.Array.from_buffers(pa.binary(), 1, [None, offsets, whole.slice(offset, size)])
            batches.append(pa.RecordBatch.from_arrays([column], schema=SCHEMA))
        return flight.RecordBatchStream(pa.Table.from_batches(batches, SCHEMA))


def grpc_handler(store: Store, ticket: str) -> grpc.GenericRpcHandler:
    expected = f"Bearer {ticket}"

    def check(context) -> None:
        if dict(context.invocation_metadata()).get("authorization") != expected:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "no valid bearer ticket")

    def put(frames, context):
        check(context)
        offset = 0
        for frame in frames:
            store.view[offset:offset + len(frame)] = frame
            offset += len(frame)
        store.length = offset
        return struct.pack("<Q", offset)

    def get(request, context):
        check(context)
        frame = int(request)
        for offset in range(0, store.length, frame):
            yield bytes(store.view[offset:min(offset + frame, store.length)])

    return grpc.method_handlers_generic_handler("spike.Transfer", {
        "Put": grpc.stream_unary_rpc_method_handler(put),
        "Get": grpc.unary_stream_rpc_method_handler(get)})


def recv_exactly(conn: socket.socket, view: memoryview) -> None:
    while view.nbytes:
        got = conn.recv_into(view)
        if got == 0:
            raise ConnectionError("the peer closed mid-transfer")
        view = view[got:]


def serve_tcp_connection(conn: socket.socket, store: Store) -> None:
    """Requests on one connection: b"P" + length, then the bytes (answered with the count), or
    b"G" + length (answered with the bytes)."""
    header = bytearray(9)
    with conn:
        while True:
            try:
                recv_exactly(conn, memoryview(header))
            except ConnectionError:
                return
            op, length = header[:1], struct.unpack("<Q", header[1:])[0]
            if op == b"P":
                recv_exactly(conn, store.view[:length])
                store.length = length
                conn.sendall(struct.pack("<Q", length))
            else:
                conn.sendall(store.view[:min(length, store.length)])


@dataclass
class Server:
    kind: str
    port: int
    stop: callable = field(repr=False)


def start_server(kind: str, host: str, port: int, credentials: Path, nbytes: int) -> Server:
    """One server of `kind` in this process (threads), serving until `stop()`."""
    store, creds = Store(nbytes), read_credentials(credentials)
    ticket = creds["ticket"].decode()
    if kind == "flight":
        server = FlightStore(f"grpc+tls://{host}:{port}", store, tls_certificates=[(creds["server.pem"],
                             creds["server.key"])], verify_client=True, root_certificates=creds["ca.pem"],
                             middleware={"ticket": TicketCheck(ticket)})
        return Server(kind, server.port, server.shutdown)
    if kind == "grpc":
        server = grpc.server(ThreadPoolExecutor(max_workers=2), options=GRPC_OPTIONS)
        server.add_generic_rpc_handlers([grpc_handler(store, ticket)])
        tls = grpc.ssl_server_credentials([(creds["server.key"], creds["server.pem"])],
                                          root_certificates=creds["ca.pem"], require_client_auth=True)
        bound = server.add_secure_port(f"{host}:{port}", tls)
        server.start()
        return Server(kind, bound, lambda: server.stop(None).wait())
    listener = socket.create_server((host, port))

    def accept() -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, _ = listener.accept()
                threading.Thread(target=serve_tcp_connection, args=(conn, store), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    return Server(kind, listener.getsockname()[1], listener.close)


def serve_role(kind: str, host: str, port: int, credentials: Path, nbytes: int) -> None:
    """`--role server`: print `ready <port>`, serve until stdin closes."""
    server = start_server(kind, host, port, credentials, nbytes)
    print(f"ready {server.port}", flush=True)
    sys.stdin.buffer.read()
    server.stop()


# -- clients: one arm's put and get ----------------------------------------------------------------


class FlightArm:
    def __init__(self, host: str, port: int, creds: dict[str, bytes], frame: int):
        self.client = flight.FlightClient(f"grpc+tls://{host}:{port}", tls_root_certs=creds["ca.pem"],
                                          cert_chain=creds["client.pem"], private_key=creds["client.key"])
        self.options = flight.FlightCallOptions(headers=[(b"authorization", b"Bearer " + creds["ticket"])])
        self.frame = frame

    def put(self, data: np.ndarray) -> int:
        writer, answer = self.client.do_put(flight.FlightDescriptor.for_command(b"store"), SCHEMA, self.options)
        whole, offsets = pa.py_buffer(data), pa.py_buffer(np.array([0, self.frame], np.int32))
        for offset in range(0, data.nbytes, self.frame):
            size = min(self.frame, data.nbytes - offset)
            sizes = offsets if size == self.frame else pa.py_buffer(np.array([0, size], np.int32))
            column = pa.Array.from_buffers(pa.binary(), 1, [None, sizes, whole.slice(offset, size)])
            writer.write_batch(pa.RecordBatch.from_arrays([column], schema=SCHEMA))
        writer.done_writing()
        stored = answer.read()
        writer.close()  # raises the server's error, if it refused the call
        if stored is None:
            raise ConnectionError("the Flight server answered the put with no byte count")
        return struct.unpack("<Q", stored.to_pybytes())[0]

    def get(self, out: np.ndarray) -> int:
        offset = 0
        for chunk in self.client.do_get(flight.Ticket(str(self.frame).encode()), self.options):
            value = chunk.data.column(0)[0].as_buffer()
            out[offset:offset + value.size] = np.frombuffer(value, np.uint8)
            offset += value.size
        return offset

    def close(self) -> None:
        self.client.close()


class GrpcArm:
    def __init__(self, host: str, port: int, creds: dict[str, bytes], frame: int):
        tls = grpc.ssl_channel_credentials(root_certificates=creds["ca.pem"], private_key=creds["client.key"],
                                           certificate_chain=creds["client.pem"])
        self.channel = grpc.secure_channel(f"{host}:{port}", tls, options=GRPC_OPTIONS)
        self.put_call = self.channel.stream_unary("/spike.Transfer/Put")
        self.get_call = self.channel.unary_stream("/spike.Transfer/Get")
        self.metadata = [("authorization", "Bearer " + creds["ticket"].decode())]
        self.frame = frame

    def put(self, data: np.ndarray) -> int:
        view = memoryview(data)
        frames = (bytes(view[o:o + self.frame]) for o in range(0, data.nbytes, self.frame))
        return struct.unpack("<Q", self.put_call(frames, metadata=self.metadata))[0]

    def get(self, out: np.ndarray) -> int:
        view, offset = memoryview(out), 0
        for frame in self.get_call(str(self.frame).encode(), metadata=self.metadata):
            view[offset:offset + len(frame)] = frame
            offset += len(frame)
        return offset

    def close(self) -> None:
        self.channel.close()


class TcpArm:
    def __init__(self, host: str, port: int, creds: dict[str, bytes], frame: int):
        self.sock = socket.create_connection((host, port))

    def put(self, data: np.ndarray) -> int:
        self.sock.sendall(b"P" + struct.pack("<Q", data.nbytes))
        self.sock.sendall(memoryview(data))
        answer = bytearray(8)
        recv_exactly(self.sock, memoryview(answer))
        return struct.unpack("<Q", answer)[0]

    def get(self, out: np.ndarray) -> int:
        self.sock.sendall(b"G" + struct.pack("<Q", out.nbytes))
        recv_exactly(self.sock, memoryview(out))
        return out.nbytes

    def close(self) -> None:
        self.sock.close()


CLIENTS = {"flight": FlightArm, "grpc": GrpcArm, "tcp": TcpArm}


def open_arm(arm: str, host: str, ports: dict[str, int], creds: dict[str, bytes]):
    kind, frame = ARMS[arm]
    return CLIENTS[kind](host, ports[kind], creds, frame)


# -- one topology's measurement (the client side) -------------------------------------------------


def usage() -> tuple[float, int]:
    """This process's CPU seconds and minor page faults so far (the client's own; servers' are not counted)."""
    now = resource.getrusage(resource.RUSAGE_SELF)
    return now.ru_utime + now.ru_stime, now.ru_minflt


def check_same(sent: np.ndarray, got: np.ndarray, stamps: list[int], full: bool) -> None:
    """The bytes that came back are those sent: the stamped slices and both ends, and with `full`
    the crc32 of the whole (AssertionError otherwise)."""
    for at in [*stamps, 0, sent.nbytes - 64]:
        if not np.array_equal(sent[at:at + 64], got[at:at + 64]):
            raise AssertionError(f"bytes at offset {at} differ from those sent")
    if full and zlib.crc32(sent) != zlib.crc32(got):
        raise AssertionError("the crc32 of the bytes returned differs from that of the bytes sent")


def round_trip(client, sent: np.ndarray, received: np.ndarray, rng: np.random.Generator, full_check: bool) -> dict:
    stamps = sorted(int(s) for s in rng.integers(0, sent.nbytes - 64, 8))
    for at in stamps:  # this run's own bytes: a put that stored nothing cannot pass the check
        sent[at:at + 64] = rng.integers(0, 256, 64, dtype=np.uint8)
        received[at:at + 64] = ~sent[at:at + 64]
    received[:64], received[-64:] = ~sent[:64], ~sent[-64:]
    before, start = usage(), time.perf_counter()
    stored = client.put(sent)
    put_done = time.perf_counter()
    returned = client.get(received)
    end = time.perf_counter()
    after = usage()
    if stored != sent.nbytes or returned != sent.nbytes:
        raise AssertionError(f"{sent.nbytes} bytes sent, {stored} stored, {returned} returned")
    check_same(sent, received, stamps, full_check)
    mb = sent.nbytes / 1e6
    return {"put_s": round(put_done - start, 4), "get_s": round(end - put_done, 4),
            "put_mb_per_s": round(mb / (put_done - start), 1), "get_mb_per_s": round(mb / (end - put_done), 1),
            "roundtrip_mb_per_s": round(mb / (end - start), 1), "client_cpu_s": round(after[0] - before[0], 3),
            "client_minor_faults": after[1] - before[1]}


FIGURES = ("put_mb_per_s", "get_mb_per_s", "roundtrip_mb_per_s")


def measure(host: str, ports: dict[str, int], credentials: Path, nbytes: int, reps: int,
            arms: tuple[str, ...] = tuple(ARMS)) -> dict:
    """Every arm against the servers at `host`/`ports`: one untimed warm-up each, then `reps`
    rounds of all arms, reversed every other round."""
    creds, rng = read_credentials(credentials), np.random.default_rng(0)
    sent = rng.integers(0, 256, nbytes, dtype=np.uint8)
    received = np.ones(nbytes, np.uint8)  # touched once, as the servers' stores are
    clients = {arm: open_arm(arm, host, ports, creds) for arm in arms}
    runs: dict[str, list[dict]] = {arm: [] for arm in arms}
    try:
        warm = min(nbytes, WARMUP_BYTES)
        for arm in arms:
            round_trip(clients[arm], sent[:warm], received[:warm], rng, full_check=True)
        for rep in range(reps):
            for arm in arms if rep % 2 == 0 else arms[::-1]:
                runs[arm].append(round_trip(clients[arm], sent, received, rng, full_check=rep == 0))
                progress(f"{host} rep {rep + 1}/{reps} {arm}: {runs[arm][-1]['roundtrip_mb_per_s']} MB/s round trip")
    finally:
        for client in clients.values():
            client.close()
    result = {}
    for arm in arms:
        result[arm] = {figure: statistics.median(r[figure] for r in runs[arm]) for figure in FIGURES}
        for figure in ("client_cpu_s", "client_minor_faults"):
            result[arm][figure] = statistics.median(r[figure] for r in runs[arm])
        result[arm]["verified"] = {"runs": len(runs[arm]), "crc32_of_all_bytes_runs": 1 if runs[arm] else 0,
                                   "stamped_slices_per_run": 10}
        result[arm]["runs"] = runs[arm]
    if "tcp" in result:
        for arm in arms:
            result[arm]["vs_tcp"] = {f: ratio(result[arm][f], result["tcp"][f]) for f in FIGURES}
    return result


# -- topologies ------------------------------------------------------------------------------------


def start_server_process(kind: str, host: str, credentials: Path, nbytes: int, prefix: tuple[str, ...] = ()):
    command = [*prefix, sys.executable, str(HERE), "--role", "server", "--kind", kind, "--host", host,
               "--port", "0", "--credentials", str(credentials), "--bytes", str(nbytes)]
    process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    line = process.stdout.readline().split()
    if line[:1] != ["ready"]:
        stop_process(process)
        raise RuntimeError(f"the {kind} server did not start (exit {process.returncode})")
    return process, int(line[1])


def stop_process(process: subprocess.Popen) -> None:
    with contextlib.suppress(OSError):
        process.stdin.close()
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def with_servers(host: str, credentials: Path, nbytes: int, prefix: tuple[str, ...], run) -> dict:
    processes = []
    try:
        ports = {}
        for kind in KINDS:
            process, ports[kind] = start_server_process(kind, host, credentials, nbytes, prefix)
            processes.append(process)
        return run(ports)
    finally:
        for process in processes:
            stop_process(process)


def run_loopback(folder: Path, nbytes: int, reps: int) -> dict:
    credentials = make_credentials(folder / "loopback", ["127.0.0.1"])
    arms = with_servers("127.0.0.1", credentials, nbytes, (),
                        lambda ports: measure("127.0.0.1", ports, credentials, nbytes, reps))
    return {"server": "127.0.0.1, 3 subprocesses", "client": "this process", "arms": arms}


def load_multihost():
    spec = importlib.util.spec_from_file_location("accelmesh_netns_multihost", MULTIHOST)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@dataclass
class VethPair:
    """Two namespaces joined by one veth pair, made and undone as multihost.NetnsHosts does."""

    ip: callable
    tag: str = field(default_factory=lambda: str(os.getpid()))
    third: int = 0
    _made: list[tuple[str, ...]] = field(default_factory=list)

    @property
    def names(self) -> tuple[str, str]:
        return f"am-{self.tag}-h1", f"am-{self.tag}-h2"  # multihost.NETNS_PATTERN: its --cleanup-stale finds them

    def address(self, end: int) -> str:
        return f"{SUBNET_PREFIX}.{self.third}.{end}"

    def create(self) -> VethPair:
        self.third = int(self.tag) % 254 + 1  # only inside the two namespaces: no clash with the root's routes
        try:
            for netns in self.names:
                self._do(("netns", "add", netns), ("netns", "del", netns))
            first, second = f"amv{self.tag}h1", f"amv{self.tag}h2"
            self._do(("link", "add", first, "type", "veth", "peer", "name", second), ("link", "del", first))
            for end, (link, netns) in enumerate(zip((first, second), self.names), 1):
                self.ip("link", "set", link, "netns", netns)
                self.ip("-n", netns, "addr", "add", f"{self.address(end)}/24", "dev", link)
                self.ip("-n", netns, "link", "set", link, "up")
                self.ip("-n", netns, "link", "set", "lo", "up")
        except BaseException:
            self.destroy()
            raise
        return self

    def _do(self, args: tuple[str, ...], undo: tuple[str, ...]) -> None:
        self.ip(*args)
        self._made.append(undo)

    def destroy(self) -> list[str]:
        problems = []
        for undo in reversed(self._made):
            if undo[0] == "netns":
                for pid in self.ip("netns", "pids", undo[2], check=False).stdout.split():
                    with contextlib.suppress(ProcessLookupError, ValueError):
                        os.kill(int(pid), signal.SIGKILL)
            result = self.ip(*undo, check=False)
            if result.returncode != 0 and "Cannot find" not in result.stderr and "No such" not in result.stderr:
                problems.append(f"ip {' '.join(undo)}: {result.stderr.strip()}")
        self._made.clear()
        return problems


def run_netns(folder: Path, nbytes: int, reps: int) -> dict:
    multihost = load_multihost()
    multihost.check_permitted()
    pair, on_interrupt = VethPair(multihost.ip), signal.getsignal(signal.SIGINT)
    try:
        pair.create()
        server_ns, client_ns = pair.names
        host = pair.address(1)
        progress(f"netns: servers in {server_ns} ({host}), client in {client_ns} ({pair.address(2)})")
        credentials = make_credentials(folder / "netns", [host])

        def client(ports: dict[str, int]) -> dict:
            command = ["ip", "netns", "exec", client_ns, sys.executable, str(HERE), "--role", "client", "--host", host,
                       "--ports", json.dumps(ports), "--credentials", str(credentials), "--bytes", str(nbytes),
                       "--reps", str(reps)]
            return json.loads(subprocess.run(command, stdout=subprocess.PIPE, text=True, check=True).stdout)

        arms = with_servers(host, credentials, nbytes, ("ip", "netns", "exec", server_ns), client)
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not stop the clean-up half way
        problems = pair.destroy()
        signal.signal(signal.SIGINT, on_interrupt)
        for problem in problems:
            progress(f"could not remove: {problem}")
    return {"server": f"netns {server_ns} {host}, 3 subprocesses", "client": f"netns {client_ns} {pair.address(2)}",
            "link": "veth pair, MTU 1500", "arms": arms}


def choose(topologies: dict) -> dict:
    where = "netns" if "netns" in topologies else "loopback"
    arms = topologies[where]["arms"]
    best = {kind: max((a for a in arms if ARMS[a][0] == kind), key=lambda a: arms[a]["roundtrip_mb_per_s"])
            for kind in ("flight", "grpc")}
    flight_mb, grpc_mb = (arms[best[k]]["roundtrip_mb_per_s"] for k in ("flight", "grpc"))
    return {"path": "grpc" if grpc_mb >= flight_mb else "flight", "topology": where, "best_arms": best,
            "roundtrip_mb_per_s": {"flight": flight_mb, "grpc": grpc_mb},
            "ratio_grpc_over_flight": ratio(grpc_mb, flight_mb), "rule": "the faster of flight and grpc on round "
            "trip MB/s (best frame size of each) in netns, loopback when netns was not run"}


def machine() -> dict:
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor())
    return {"cores": os.cpu_count(), "cpu": model, "python": platform.python_version(), "pyarrow": pa.__version__,
            "grpcio": grpc.__version__, "numpy": np.__version__, "platform": platform.platform(),
            "load_average_1m_at_start": round(os.getloadavg()[0], 2)}


def cpu_accounts() -> dict[str, float]:
    """CPU seconds so far: the whole machine busy and stolen by the hypervisor (/proc/stat), and this
    process with its waited-for children (the servers and the netns client)."""
    ticks = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    hz = os.sysconf("SC_CLK_TCK")
    ours = sum(getattr(resource.getrusage(who), f) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
               for f in ("ru_utime", "ru_stime"))
    return {"busy": (sum(ticks) - ticks[3] - ticks[4]) / hz, "steal": ticks[7] / hz, "ours": ours}


def other_load(before: dict[str, float], after: dict[str, float]) -> dict:
    """What else used this machine's CPUs during the run: on a quiet machine near 0."""
    return {"machine_busy_cpu_s": round(after["busy"] - before["busy"], 1),
            "this_run_cpu_s": round(after["ours"] - before["ours"], 1),
            "others_cpu_s": round(after["busy"] - before["busy"] - after["ours"] + before["ours"], 1),
            "steal_cpu_s": round(after["steal"] - before["steal"], 1)}


def stop_on_signal(signum, _frame):
    raise KeyboardInterrupt(signal.Signals(signum).name)


def interruptible(run: Callable[[], dict], removed: str) -> dict | None:
    """`run()` with SIGINT, SIGTERM and SIGHUP raising KeyboardInterrupt, so every `finally:` on
    the way out runs (namespaces, links, processes removed); None if it was stopped so."""
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, stop_on_signal)
    try:
        return run()
    except KeyboardInterrupt as stop:
        progress(f"stopped by {stop}; {removed} removed")
        return None


def command_line(script: str, argv: list[str] | None) -> str:
    """How this run was started, for the JSON."""
    return " ".join([script, *(sys.argv[1:] if argv is None else argv)])


def run_benchmark(where: str, nbytes: int, reps: int, command: str) -> dict:
    started, accounts = time.perf_counter(), cpu_accounts()
    result = {"benchmark": "transfer_spike", "command": command, "date": datetime.date.today().isoformat(),
              "bytes": nbytes, "reps": reps, "machine": machine(), "topologies": {}}
    with tempfile.TemporaryDirectory(prefix="accelmesh-transfer-spike-") as tmp:
        for topology in ("loopback", "netns") if where == "both" else (where,):
            progress(f"{topology}: {nbytes // MIB} MiB x {reps} repetitions of {', '.join(ARMS)}")
            run = run_loopback if topology == "loopback" else run_netns
            result["topologies"][topology] = run(Path(tmp), nbytes, reps)
    result["choice"] = choose(result["topologies"])
    result["machine"]["cpu_during_measurement"] = other_load(accounts, cpu_accounts())
    progress("how fast this machine hands out fresh memory (common.fresh_memory)")
    result["host_fresh_memory"] = fresh_memory(min(nbytes, 256 * MIB))
    result["machine"]["load_average_1m_at_end"] = round(os.getloadavg()[0], 2)
    result["wall_s"] = round(time.perf_counter() - started, 1)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--where", choices=("loopback", "netns", "both"), default="both")
    parser.add_argument("--mib", type=int, default=256, help="bytes moved each way per run, in MiB")
    parser.add_argument("--quick", action="store_true", help="32 MiB: a smoke run, not a measurement")
    parser.add_argument("--reps", type=int, default=3, help="timed repetitions of every arm (medians over them)")
    parser.add_argument("--role", choices=("bench", "server", "client"), default="bench", help="internal")
    parser.add_argument("--kind", choices=KINDS, help="server: which protocol")
    parser.add_argument("--host", default="127.0.0.1", help="server: where to listen; client: whom to dial")
    parser.add_argument("--port", type=int, default=0, help="server: the port (0: any free one)")
    parser.add_argument("--ports", default="{}", help="client: the servers' ports by kind, as JSON")
    parser.add_argument("--credentials", default="", help="server and client: the folder of certificates")
    parser.add_argument("--bytes", type=int, default=0, help="server and client: the transfer size")
    args = parser.parse_args(argv)
    if args.role == "server":
        serve_role(args.kind, args.host, args.port, Path(args.credentials), args.bytes)
        return 0
    if args.role == "client":
        result = measure(args.host, json.loads(args.ports), Path(args.credentials), args.bytes, args.reps)
    else:
        nbytes = (32 if args.quick else args.mib) * MIB
        command = command_line("bench/transfer_spike.py", argv)
        result = interruptible(lambda: run_benchmark(args.where, nbytes, args.reps, command),
                               "servers, namespaces and links")
        if result is None:
            return 130
    json.dump(result, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
