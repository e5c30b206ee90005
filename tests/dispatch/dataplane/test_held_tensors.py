"""Tensors a worker holds for a job: the worker's store and the dispatcher's bookkeeping on their
own; GrpcWorkers.execute against real worker processes (references after the first call, a
transparent resend after an eviction or a restart); and whole jobs through a dispatcher in this
process, whose counts show each worker got a job's parameters once, not once per shard."""

from __future__ import annotations

import dataclasses
import threading

import numpy as np
import pytest

from accelmesh.client import MeshClient
from accelmesh.dispatch.v1 import job_pb2 as job_pb
from accelmesh.dispatch.v1 import plan_pb2 as plan_pb
from accelmesh.embedded import start_compile, start_inventory, start_worker
from accelmesh.runtime.devices import device_from_proto
from accelmesh.runtime.launcher import start_service
from accelmesh.security.identity import Role
from accelmesh.worker.v1 import worker_service_pb2 as worker_pb
from accelmesh.worker.v1 import worker_service_pb2_grpc
from compile_svc.config import CompileConfig
from compile_svc.programs import default_registry
from compile_svc.server import build_compile_service
from dispatch_svc.config import DispatchConfig
from dispatch_svc.dataplane.device_queues import CancelScope
from dispatch_svc.dataplane.held_keys import MAX_MISSES, HeldKeys
from dispatch_svc.ports import JobDevice
from dispatch_svc.server import build_dispatch
from worker_svc.held_tensors import HeldTensors

from conftest import CREDENTIALS, DispatchClients, mesh_stub

pytestmark = pytest.mark.fixture_cpu

CALL_TIMEOUT_S = 60.0
ROWS = 32
MLP = "mlp_classifier"
MLP_PARAMETER_BYTES = 104_488
HELD_BYTES = 150_000  # one job's mlp parameters fit, two jobs' do not


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def tensor(nbytes: int) -> np.ndarray:
    return np.zeros(nbytes, np.uint8)


# -- the worker's store ----------------------------------------------------------------------------

def test_the_store_drops_the_least_recently_used_beyond_its_byte_limit():
    store = HeldTensors(300, idle_s=60)
    for key in "abc":
        assert store.keep("job", key, tensor(100))
    assert store.get("job", "a") is not None  # a is now the most recently used
    assert store.keep("job", "d", tensor(100))
    assert store.get("job", "b") is None and all(store.get("job", k) is not None for k in "acd")
    assert not store.keep("job", "huge", tensor(301)), "a tensor over the whole limit is not kept"
    stats = store.stats()
    assert (stats.tensors, stats.bytes, stats.evicted, stats.missed) == (3, 300, 2, 1)


def test_the_store_keeps_jobs_apart_and_a_key_kept_again_replaces_its_tensor():
    store = HeldTensors(1000, idle_s=60)
    store.keep("one", "k", np.ones(4))
    store.keep("one", "k", np.full(4, 2.0))
    assert store.get("two", "k") is None
    np.testing.assert_array_equal(store.get("one", "k"), np.full(4, 2.0))
    assert store.stats().bytes == 32


def test_a_job_unused_for_idle_s_loses_its_tensors_and_a_used_one_keeps_them():
    clock = Clock()
    store = HeldTensors(1000, idle_s=10, clock=clock)
    store.keep("idle", "k", tensor(10))
    store.keep("busy", "k", tensor(10))
    for _ in range(3):
        clock.now += 6
        assert store.get("busy", "k") is not None
    store.expire()
    assert store.get("idle", "k") is None
    assert store.stats().expired == 1 and store.stats().tensors == 1


# -- the dispatcher's bookkeeping ------------------------------------------------------------------

def never() -> bool:
    return False


def test_keys_go_in_full_until_their_call_arrived_then_by_reference():
    book = HeldKeys()
    first = book.plan("w", "job", {"a", "b"}, never)
    assert first.full == {"a", "b"} and not first.refs and first.keep
    book.arrived(first)
    second = book.plan("w", "job", {"a", "b", "c"}, never)
    assert second.refs == {"a", "b"} and second.full == {"c"}
    assert book.plan("other-worker", "job", {"a"}, never).full == {"a"}
    assert book.plan("w", "other-job", {"a"}, never).full == {"a"}


@pytest.mark.parametrize("outcome, expected_refs", [("arrived", {"a"}), ("abandoned", set())])
def test_a_call_needing_a_key_another_call_is_sending_waits_for_it(outcome, expected_refs):
    book = HeldKeys()
    sending = book.plan("w", "job", {"a"}, never)
    got = []
    waiter = threading.Thread(target=lambda: got.append(book.plan("w", "job", {"a"}, never)))
    waiter.start()
    waiter.join(0.3)
    assert waiter.is_alive(), "it must not send the same tensor while the first call is sending it"
    getattr(book, outcome)(sending)
    waiter.join(5)
    assert got and got[0].refs == expected_refs and got[0].full == {"a"} - expected_refs


def test_a_cancelled_call_stops_waiting():
    book = HeldKeys()
    book.plan("w", "job", {"a"}, never)
    assert book.plan("w", "job", {"a"}, lambda: True) is None


def test_a_miss_forgets_the_job_on_that_worker_and_repeated_misses_stop_keeping():
    book = HeldKeys()
    for _ in range(MAX_MISSES):
        transfer = book.plan("w", "job", {"a"}, never)
        assert transfer.keep
        book.arrived(transfer)
        assert book.plan("w", "job", {"a"}, never).refs == {"a"}
        book.missed("w", "job")
        resend = book.plan("w", "job", {"a"}, never, resend=True)
        assert resend.full == {"a"} and not resend.refs
        book.abandoned(resend)
    transfer = book.plan("w", "job", {"a"}, never)
    assert transfer.full == {"a"} and not transfer.keep
    assert book.counts.resends == MAX_MISSES
    book.forget_worker("w")  # a new process on the address starts afresh
    assert book.plan("w", "job", {"a"}, never).keep


def test_a_worker_gone_or_a_job_ended_is_forgotten():
    book = HeldKeys()
    for worker, job in (("w1", "j1"), ("w1", "j2"), ("w2", "j1")):
        book.arrived(book.plan(worker, job, {"a"}, never))
    book.forget_worker("w1")
    assert book.plan("w1", "j2", {"a"}, never).full == {"a"}
    assert book.plan("w2", "j1", {"a"}, never).refs == {"a"}
    book.forget_job("j1")
    assert book.plan("w2", "j1", {"a"}, never).full == {"a"}


# -- GrpcWorkers.execute against real workers ---------------------------------------------------------

@pytest.fixture(scope="module")
def compile_address(tmp_path_factory):
    root = tmp_path_factory.mktemp("compile")
    server, _ = build_compile_service(CompileConfig(
        listen="127.0.0.1:0", cache_dir=str(root / "artifacts"), programs_dir=str(root / "programs")))
    server.start()
    yield f"127.0.0.1:{server.port}"
    server.stop(0)


def start_node(compile_address, artifact_dir, listen: str = "127.0.0.1:0"):
    return start_service("worker", "worker_svc", [
        "--listen", listen, "--devices", "1", "--compile", compile_address, "--artifact-dir", str(artifact_dir)],
        env={**CREDENTIALS.env(Role.WORKER), "ACCELMESH_WORKER_HELD_BYTES": str(HELD_BYTES)})


@pytest.fixture(scope="module")
def worker(tmp_path_factory, compile_address):
    process = start_node(compile_address, tmp_path_factory.mktemp("worker-artifacts"))
    yield process
    process.terminate()


@pytest.fixture(scope="module")
def mesh(compile_address):
    mesh = DispatchClients.open(compile_address)
    yield mesh
    mesh.close()


@dataclasses.dataclass
class Shards:
    """Runs mlp shards on one worker's device through GrpcWorkers.execute, parameters keyed."""

    mesh: DispatchClients
    device: JobDevice
    build: object
    params: list[tuple[str, np.ndarray]]

    @classmethod
    def on(cls, mesh: DispatchClients, address: str) -> Shards:
        (described,) = mesh_stub(worker_service_pb2_grpc.WorkerServiceStub, address).DescribeNode(
            worker_pb.DescribeNodeRequest(), timeout=CALL_TIMEOUT_S).devices
        device = JobDevice(device_from_proto(described, described.id)[0], address)
        program = mesh.compiler.describe_program(MLP, "")
        (build,) = mesh.compiler.compile(program, [device], [ROWS])
        params = list(zip((p.name for p in program.parameters), mesh.compiler.fetch_parameters(program, 0)))
        return cls(mesh, JobDevice(device.spec, address, build.target_type), build, params)

    def run(self, job_id: str, seed: int = 0, *, keyed: bool = True) -> np.ndarray:
        x = np.random.default_rng(seed).standard_normal((ROWS, 64)).astype(np.float32)
        keys = {name: f"params:{name}" for name, _ in self.params} if keyed else None
        out = self.mesh.workers.execute(job_id, seed, 1, self.device, self.build, self.build.executables[ROWS],
                                [*self.params, ("x", x)], ROWS, CancelScope(), held_keys=keys)
        return out.outputs[0]


def counts(mesh: DispatchClients):
    return dataclasses.replace(mesh.workers.held.counts)


def sent_since(mesh: DispatchClients, before) -> dict[str, int]:
    now = mesh.workers.held.counts
    return {f.name: getattr(now, f.name) - getattr(before, f.name) for f in dataclasses.fields(now)}


@pytest.mark.slow
def test_later_shards_refer_to_the_parameters_and_give_the_same_outputs(mesh, worker):
    shards = Shards.on(mesh, worker.address)
    before = counts(mesh)
    keyed = [shards.run("refs", seed) for seed in range(3)]
    assert sent_since(mesh, before) == {"full": 6, "full_bytes": MLP_PARAMETER_BYTES, "refs": 12, "resends": 0}
    for seed, output in enumerate(keyed):
        np.testing.assert_array_equal(output, shards.run("no-keys", seed, keyed=False))


@pytest.mark.slow
def test_parameters_the_worker_evicted_are_resent_in_full_within_the_same_attempt(mesh, worker):
    shards = Shards.on(mesh, worker.address)
    expected = shards.run("evicted", 1, keyed=False)
    shards.run("evicted")
    shards.run("evicter")  # HELD_BYTES holds one job's parameters: these push the first job's out
    before = counts(mesh)
    np.testing.assert_array_equal(shards.run("evicted", 1), expected)
    assert sent_since(mesh, before) == {"full": 6, "full_bytes": MLP_PARAMETER_BYTES, "refs": 6, "resends": 1}
    before = counts(mesh)
    shards.run("evicted", 2)
    assert sent_since(mesh, before)["refs"] == 6, "held again after the resend"


def recording(mesh: DispatchClients, sent: list[str]) -> None:
    """Every message `mesh` sends its workers on ExecuteMany noted in `sent` by its part."""
    open_call = mesh.workers._execute_many

    def opening(address: str):
        call = open_call(address)

        def opened(requests, *args, **kwargs):
            def noted():
                for message in requests:
                    parsed = worker_pb.ExecuteManyRequest.FromString(message) if isinstance(message, bytes) else message
                    sent.append(parsed.WhichOneof("part"))
                    yield message
            return call(noted(), *args, **kwargs)
        return opened

    mesh.workers._execute_many = opening


@pytest.mark.slow
def test_once_a_worker_answered_in_batches_its_shards_go_batched_with_the_same_outputs(compile_address, worker):
    """The first shard goes part by part (the worker might be from before batches); its batched
    answer says the worker reads batches, so each later shard is one message."""
    mesh = DispatchClients.open(compile_address)
    try:
        sent: list[str] = []
        recording(mesh, sent)
        shards = Shards.on(mesh, worker.address)
        first = shards.run("batches", 0)
        assert sent[0] == "header" and "batch" not in sent
        assert worker.address in mesh.workers._batching
        del sent[:]
        later = [shards.run("batches", seed) for seed in (1, 2)]
        assert sent == ["batch", "batch"]  # header, six references and x: one message a shard
        for seed, output in enumerate([first, *later]):
            np.testing.assert_array_equal(output, shards.run("unbatched", seed, keyed=False))
    finally:
        mesh.close()


@pytest.mark.slow
def test_a_worker_restarted_on_its_address_gets_the_parameters_again_in_full(mesh, compile_address, tmp_path):
    process = start_node(compile_address, tmp_path)
    try:
        shards = Shards.on(mesh, process.address)
        expected = shards.run("restart", 1, keyed=False)
        shards.run("restart")
        process.terminate()
        # The same port: the dispatcher's channel reconnects.
        process = start_node(compile_address, tmp_path, process.address)
        before = counts(mesh)
        np.testing.assert_array_equal(shards.run("restart", 1), expected)
        assert sent_since(mesh, before)["resends"] == 1
    finally:
        process.terminate()


# -- whole jobs through a dispatcher in this process -----------------------------------------------

@pytest.fixture(scope="module")
def dispatcher(tmp_path_factory):
    """Inventory, compile and two workers (two devices on 127.0.0.1, one on 127.0.0.2) as processes;
    the dispatcher here, so the test can read what its GrpcWorkers sent."""
    root = tmp_path_factory.mktemp("jobs")
    processes = [start_inventory(root, CREDENTIALS)]
    # The inventory registers a node only for a worker whose certificate names the node's address.
    node_2 = CREDENTIALS.issue(Role.WORKER, "node-127.0.0.2", ["127.0.0.2"]).tls
    try:
        inventory = processes[0].address
        processes.append(compile_ := start_compile(root, CREDENTIALS))
        processes.append(start_worker(inventory, compile_.address, CREDENTIALS, devices=2,
                                      emulate=("a100-80gb", "v100-32gb"), artifact_dir=root / "worker-artifacts"))
        processes.append(start_worker(inventory, compile_.address, CREDENTIALS, devices=1, emulate=("v100-32gb",),
                                      listen="127.0.0.2:0", artifact_dir=root / "worker-artifacts", name="worker-2",
                                      env={"ACCELMESH_CERT_FILE": str(node_2.cert_file),
                                           "ACCELMESH_KEY_FILE": str(node_2.key_file)}))
        server, runner = build_dispatch(DispatchConfig(
            listen="127.0.0.1:0", inventory=inventory, compile=compile_.address, data_dir=str(root / "dispatch"),
            max_shard_bytes=32 * 1024))
        server.start()
        try:
            yield f"127.0.0.1:{server.port}", DispatchClients(runner.compiler, runner.workers)
        finally:
            server.stop(0)
    finally:
        for process in reversed(processes):
            process.terminate()


def reference(name: str, x: np.ndarray) -> np.ndarray:
    program = default_registry().get(name)
    return np.asarray(program.fn(*program.init_params(0), x)[0])


@pytest.mark.slow
def test_a_multi_shard_inference_job_sends_its_parameters_once_per_worker(dispatcher):
    address, mesh = dispatcher
    x = np.random.default_rng(5).standard_normal((1024, 64)).astype(np.float32)
    before = counts(mesh)
    with MeshClient(address) as client:
        result = client.run(MLP, {"x": x}, timeout=CALL_TIMEOUT_S)
    shards = result.job.shards
    workers = {s.device_id.split("/")[0] for s in shards}
    assert len(workers) == 2 and len(shards) >= 4 * len(workers)  # shards of at most 32 KiB, on both nodes
    sent = sent_since(mesh, before)
    assert sent["full_bytes"] == MLP_PARAMETER_BYTES * len(workers), sent
    assert sent["refs"] == 6 * (len(shards) - len(workers)) and sent["resends"] == 0, sent
    expected = reference(MLP, x)
    assert np.max(np.abs(result.outputs["logits"] - expected)) / np.max(np.abs(expected)) <= 5e-2


@pytest.mark.slow
def test_a_pipeline_stage_gets_its_parameters_once_not_per_micro_batch(dispatcher):
    address, mesh = dispatcher
    x = np.random.default_rng(6).integers(0, 512, size=(50, 32), dtype=np.int32)
    before = counts(mesh)
    with MeshClient(address) as client:
        result = client.run("transformer_encoder", {"tokens": x}, timeout=CALL_TIMEOUT_S,
                            placement=plan_pb.PlacementOptions(
                                strategy=plan_pb.PLACEMENT_STRATEGY_RANKED, device_count=3, micro_batch_rows=8))
    assert result.job.state == job_pb.JOB_STATE_SUCCEEDED, result.job.error
    micro_batches = result.job.plan.placement.micro_batches
    assert micro_batches == 7 and len(result.job.plan.placement.stages) >= 2
    sent = sent_since(mesh, before)
    # Each stage's leaves went in full with its first micro-batch, by reference with the six others.
    assert sent["full"] > 0 and sent["refs"] == (micro_batches - 1) * sent["full"], sent
    program = default_registry().get("transformer_encoder")
    assert sent["full_bytes"] <= sum(np.asarray(p).nbytes for p in program.init_params(0)), sent
    expected = reference("transformer_encoder", x)
    assert np.max(np.abs(result.outputs["logits"] - expected)) / np.max(np.abs(expected)) <= 5e-2
