"""Worker (node agent) configuration: one frozen dataclass from flags, defaults beside each field."""

from __future__ import annotations

import argparse
import ipaddress
import os
import socket
from dataclasses import dataclass, field

from accelmesh import errors
from accelmesh.runtime.config import DEFAULT_MAX_MESSAGE_BYTES, env_bool, env_float, env_int, env_str
from accelmesh.runtime.https import HttpLimits, http_limits_from_env
from accelmesh.security.config import Security, add_security_arguments, security_from_env, service_security
from accelmesh.security.identity import Role
from worker_svc.held_tensors import MAX_HELD_TENSORS
from worker_svc.objects import MAX_OBJECTS

# Read by CUDA and JAX at their start (the worker sets them before importing jax); an operator's
# own values win.
GPU_ENVIRONMENT = {
    # CUDA's ordinals follow the PCI bus as NVML's indices do, so "cuda:<index>" names one GPU in both
    "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
    # JAX otherwise takes 75% of every GPU's memory at start: the inventory would see the GPU full,
    # and the memory a job reserves would not be there for it
    "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
}


@dataclass(frozen=True)
class WorkerConfig:
    listen: str = "127.0.0.1:50070"  # ACCELMESH_WORKER_LISTEN: where the worker serves gRPC
    advertise_ip: str = ""  # ACCELMESH_NODE_IP: IP in device ids; default from `listen` or the host name
    cpu_devices: int = 1  # ACCELMESH_CPU_DEVICES: split the host CPU into this many XLA devices
    emulate: tuple[str, ...] = ()  # ACCELMESH_EMULATE: catalog profiles mapped onto the CPU devices
    inventory: str = ""  # ACCELMESH_INVENTORY: inventory address to register with at start
    # ACCELMESH_COMPILE: the compile service artifacts are fetched from (the only source)
    compile: str = "127.0.0.1:50061"
    # ACCELMESH_PROC_ROOT: where CPU and memory facts are read; a container that mounts the
    # host's /proc elsewhere (e.g. /host/proc) names that folder
    proc_root: str = "/proc"
    # ACCELMESH_WORKER_NVML: probe NVIDIA GPUs through NVML; 0 leaves them out, so the node offers
    # its CPU (and emulated profiles) only, e.g. a CPU agent on a host whose GPUs serve other work
    nvml: bool = True
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES  # ACCELMESH_MAX_MESSAGE_BYTES
    artifact_dir: str = ".accelmesh/worker-artifacts"  # ACCELMESH_WORKER_ARTIFACT_DIR: fetched artifacts, verified
    max_input_bytes: int = 1024**3  # ACCELMESH_WORKER_MAX_INPUT_BYTES: largest total of one shard's inputs
    # ACCELMESH_WORKER_MAX_INPUTS: most inputs (tensors and references) one shard may send; each
    # costs memory whatever its size, so a stream of empty tensors is bounded too
    max_inputs: int = 4096
    # ACCELMESH_WORKER_HELD_BYTES: host memory for tensors kept for a job's later shards (its
    # parameters, sent once); least recently used dropped first; 0 keeps none.
    held_bytes: int = 1024**3
    # ACCELMESH_WORKER_HELD_TENSORS: most tensors held at once over all jobs, least recently used
    # dropped first; a call asking to keep more than this is refused (RESOURCE_EXHAUSTED)
    held_tensors: int = MAX_HELD_TENSORS
    held_idle_s: float = 600.0  # ACCELMESH_WORKER_HELD_IDLE_S: a job's held tensors dropped after this unused
    # ACCELMESH_WORKER_STORE_BYTES: the object store's bound (jobs' inputs put by clients, shards'
    # outputs waiting to be fetched), in shared memory; a put past it waits, then is refused
    store_bytes: int = 4 * 1024**3
    store_root: str = "/dev/shm"  # ACCELMESH_WORKER_STORE_ROOT: where the store's segment files are made
    store_ttl_s: float = 900.0  # ACCELMESH_WORKER_STORE_TTL_S: a job's objects freed after this untouched
    store_wait_s: float = 30.0  # ACCELMESH_WORKER_STORE_WAIT_S: how long a put waits for room before it is refused
    store_objects: int = MAX_OBJECTS  # ACCELMESH_WORKER_STORE_OBJECTS: objects at once (each holds a file descriptor)
    # ACCELMESH_CA_FILE, ACCELMESH_CERT_FILE, ACCELMESH_KEY_FILE, ACCELMESH_TOKENS_FILE, ACCELMESH_JWT_*,
    # ACCELMESH_CREDENTIALS_DIR, ACCELMESH_INSECURE: see accelmesh/security/config.py
    security: Security = field(default_factory=service_security(Role.WORKER))
    health_listen: str = ""  # ACCELMESH_HEALTH_LISTEN: plaintext health alone, for probes
    metrics_listen: str = ""  # ACCELMESH_METRICS_LISTEN: /metrics for Prometheus (accelmesh/runtime/metrics.py)
    # ACCELMESH_HTTP_HANDSHAKE_TIMEOUT_S, _READ_TIMEOUT_S, _MAX_CONNECTIONS: its HTTP endpoints (runtime/https.py)
    http: HttpLimits = HttpLimits()

    @property
    def node_ip(self) -> str:
        if self.advertise_ip:
            return self.advertise_ip
        host = self.listen.rsplit(":", 1)[0].strip("[]")
        try:
            if not ipaddress.ip_address(host).is_unspecified:
                return host
        except ValueError:
            pass
        try:
            return socket.gethostbyname(socket.gethostname())
        except OSError:
            return "127.0.0.1"


def parse_args(argv: list[str] | None = None, env=os.environ) -> WorkerConfig:
    parser = argparse.ArgumentParser(prog="accelmesh-worker", description="accelmesh node agent")
    parser.add_argument("--listen", default=env_str("ACCELMESH_WORKER_LISTEN", WorkerConfig.listen, env))
    parser.add_argument("--advertise-ip", default=env_str("ACCELMESH_NODE_IP", "", env))
    parser.add_argument(
        "--devices", type=int, default=env_int("ACCELMESH_CPU_DEVICES", 1, env, minimum=1),
        help="split the host CPU into N XLA devices",
    )
    parser.add_argument(
        "--emulate", default=env_str("ACCELMESH_EMULATE", "", env),
        help="comma list of catalog types (e.g. a100-80gb,v100-32gb) emulated on the CPU devices",
    )
    parser.add_argument("--inventory", default=env_str("ACCELMESH_INVENTORY", "", env))
    parser.add_argument("--compile", default=env_str("ACCELMESH_COMPILE", WorkerConfig.compile, env),
                        help="address of the compile service to fetch artifacts from")
    parser.add_argument("--proc-root", default=env_str("ACCELMESH_PROC_ROOT", WorkerConfig.proc_root, env),
                        help="where the host's /proc is mounted (CPU and memory facts)")
    parser.add_argument("--nvml", action=argparse.BooleanOptionalAction,
                        default=env_bool("ACCELMESH_WORKER_NVML", WorkerConfig.nvml, env),
                        help="probe NVIDIA GPUs through NVML (--no-nvml: offer the CPU and emulated devices only)")
    parser.add_argument(
        "--artifact-dir", default=env_str("ACCELMESH_WORKER_ARTIFACT_DIR", WorkerConfig.artifact_dir, env),
        help="where fetched artifacts are kept between shards and restarts",
    )
    add_security_arguments(parser, env)
    args = parser.parse_args(argv)
    emulate = tuple(p.strip() for p in args.emulate.split(",") if p.strip())
    if args.devices < 1:
        raise errors.InvalidArgument(f"--devices must be at least 1, got {args.devices}")
    if len(emulate) > args.devices:
        raise errors.InvalidArgument(
            f"--emulate names {len(emulate)} profiles but --devices is {args.devices}; raise --devices to at "
            f"least {len(emulate)}"
        )
    return WorkerConfig(
        security=security_from_env(Role.WORKER, env, insecure=args.insecure),
        health_listen=args.health_listen,
        metrics_listen=args.metrics_listen,
        http=http_limits_from_env(env),
        listen=args.listen,
        advertise_ip=args.advertise_ip,
        cpu_devices=args.devices,
        emulate=emulate,
        inventory=args.inventory,
        compile=args.compile,
        proc_root=args.proc_root,
        nvml=args.nvml,
        max_message_bytes=env_int("ACCELMESH_MAX_MESSAGE_BYTES", DEFAULT_MAX_MESSAGE_BYTES, env, minimum=65536),
        artifact_dir=args.artifact_dir,
        max_input_bytes=env_int("ACCELMESH_WORKER_MAX_INPUT_BYTES", WorkerConfig.max_input_bytes, env, minimum=1),
        max_inputs=env_int("ACCELMESH_WORKER_MAX_INPUTS", WorkerConfig.max_inputs, env, minimum=1),
        held_bytes=env_int("ACCELMESH_WORKER_HELD_BYTES", WorkerConfig.held_bytes, env, minimum=0),
        held_tensors=env_int("ACCELMESH_WORKER_HELD_TENSORS", WorkerConfig.held_tensors, env, minimum=1),
        held_idle_s=env_float("ACCELMESH_WORKER_HELD_IDLE_S", WorkerConfig.held_idle_s, env, minimum=1.0),
        store_bytes=env_int("ACCELMESH_WORKER_STORE_BYTES", WorkerConfig.store_bytes, env, minimum=0),
        store_root=env_str("ACCELMESH_WORKER_STORE_ROOT", WorkerConfig.store_root, env),
        store_ttl_s=env_float("ACCELMESH_WORKER_STORE_TTL_S", WorkerConfig.store_ttl_s, env, minimum=1.0),
        store_wait_s=env_float("ACCELMESH_WORKER_STORE_WAIT_S", WorkerConfig.store_wait_s, env, minimum=0.0),
        store_objects=env_int("ACCELMESH_WORKER_STORE_OBJECTS", WorkerConfig.store_objects, env, minimum=1),
    )


def xla_flags_for(cpu_devices: int, current: str = "") -> str:
    """XLA_FLAGS with the host device count set; must be in the environment before jax is imported."""
    kept = [f for f in current.split() if not f.startswith("--xla_force_host_platform_device_count")]
    return " ".join([*kept, f"--xla_force_host_platform_device_count={cpu_devices}"])
