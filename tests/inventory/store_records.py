"""What the store tests build: a node address, device specs, samples, node reports, and two stores
(fresh, and with one registered A100) as fixtures the test modules import: each fixture's
function is named ``*_fixture``, so a test's parameter of the fixture's name shadows no import. Each store fixture runs
once per engine: on a SQLite file and on a database of the session's PostgreSQL server."""

from __future__ import annotations

import pytest

from accelmesh.hardware.model import DeviceSample, DeviceSpec, NodeDescription, Performance, device_id
from inventory_svc.store import SqlStore

GB = 10**9
NODE = "10.0.0.1:50051"


def spec(ip: str = "10.0.0.1", index: int = 0, platform: str = "cuda", memory: int = 80 * GB, **extra) -> DeviceSpec:
    return DeviceSpec(
        id=device_id(ip, platform, index), node_ip=ip, local_index=index, platform=platform,
        kind=extra.pop("kind", "NVIDIA A100-SXM4-80GB"), type=extra.pop("type", "a100-80gb"),
        capabilities=frozenset(extra.pop("capabilities", {"bf16", "tf32"})),
        performance=Performance({"fp32": 19.5, "bf16": 312.0}, memory, 2039.0), **extra,
    )


def sample(device: DeviceSpec, ts: float, used: int = 0, utilization: float = 0.0) -> DeviceSample:
    return DeviceSample(device.id, ts, device.performance.memory_bytes, used, utilization, 40.0, 100.0)


def report(devices, samples=(), ip: str = "10.0.0.1") -> NodeDescription:
    return NodeDescription(ip, "host-" + ip, tuple(devices), tuple(samples))


@pytest.fixture(name="store")
def store_fixture(database_url):
    s = SqlStore(database_url)
    yield s
    s.close()


@pytest.fixture(scope="module", params=["sqlite", "postgresql"], name="module_database_url")
def module_database_url_fixture(request, tmp_path_factory):
    """``database_url`` for a module-scoped store (one large inventory built once per engine)."""
    if request.param == "sqlite":
        return str(tmp_path_factory.mktemp("db") / "db.sqlite")
    from conftest import _postgres_server

    return _postgres_server().database()


@pytest.fixture(name="one_device")
def one_device_fixture(store):
    store.upsert_node(NODE, "10.0.0.1", "host", now=0.0)
    gpu = spec()
    store.record_poll_success(NODE, report([gpu], [sample(gpu, 0.0)]), now=0.0)
    return gpu
