"""DATA_PATH_DIRECT through real processes (inventory, compile, a worker of two devices) and a
dispatcher in this process: the client puts each shard's rows into the worker's object store and
fetches the outputs from there; results equal the relay path's bit for bit in fp32, over shared
memory and over gRPC streams alike; what the direct path cannot run is refused before anything is
reserved, naming spec.data_path."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from accelmesh import object_client
from accelmesh.client import MeshClient, job_spec
from accelmesh.dispatch.v1 import dispatch_service_pb2 as pb
from accelmesh.dispatch.v1 import job_pb2 as job_pb
from accelmesh.object_client import SHARED, STREAMED
from accelmesh.runtime.batches import unbatched
from accelmesh.worker.v1 import worker_service_pb2 as pb_worker
from dispatch_svc.dataplane.workers import GrpcWorkers
from dispatch_svc.execution import direct

from conftest import CREDENTIALS, rpc_error, small_mesh

pytestmark = [pytest.mark.slow, pytest.mark.fixture_cpu]

SHARD_BYTES = 32 * 1024
ROWS = 1024  # 8 shards of 128 rows of the mlp's 64 float32 features


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    with small_mesh(tmp_path_factory.mktemp("direct"), emulate=("v100-32gb", "v100-32gb"),
                    max_shard_bytes=SHARD_BYTES) as (server, inventory, stub):
        yield server, inventory, stub


@pytest.fixture
def client(mesh):
    server, _, _ = mesh
    with MeshClient(f"127.0.0.1:{server.port}", security=CREDENTIALS.client()) as c:
        yield c


@pytest.fixture(scope="module")
def x():
    return np.random.default_rng(3).standard_normal((ROWS, 64)).astype(np.float32)


def _ran(result) -> None:
    assert result.job.state == job_pb.JOB_STATE_SUCCEEDED, result.job.error
    assert len(result.job.shards) > 1 and len({s.device_id for s in result.job.shards}) == 2


def test_a_direct_job_equals_the_relayed_one_and_its_bytes_go_through_shared_memory(client, x):
    relayed = client.run("mlp_classifier", {"x": x}, precision="fp32")
    direct = client.run("mlp_classifier", {"x": x}, precision="fp32", data_path="direct")
    _ran(direct)
    assert np.array_equal(direct.outputs["logits"], relayed.outputs["logits"])
    assert direct.data_path == "direct" and relayed.data_path == "relay"
    assert direct.moved_bytes == {SHARED: x.nbytes + direct.outputs["logits"].nbytes}
    wanted = [e for e in direct.events if e.type == job_pb.JOB_EVENT_TYPE_INPUTS_WANTED]
    assert len(wanted) == 1 and f"{len(direct.job.shards)} shards" in wanted[0].message


def test_a_direct_job_s_shards_go_to_their_device_in_groups_and_equal_the_relayed_ones(client, monkeypatch):
    """32 shards on one device: those queued behind the ones running go to the worker in groups
    (one message each way), parameters held by key, and the outputs equal the relay path's."""
    sizes: list[int] = []
    real = GrpcWorkers.execute_group

    def recording(self, calls, scope):
        sizes.append(len(calls))
        return real(self, calls, scope)
    monkeypatch.setattr(GrpcWorkers, "execute_group", recording)
    x = np.random.default_rng(9).standard_normal((32 * 128, 64)).astype(np.float32)
    relayed = client.run("mlp_classifier", {"x": x}, precision="fp32", max_devices=1)
    sizes.clear()  # the direct job's groups alone
    grouped = client.run("mlp_classifier", {"x": x}, precision="fp32", max_devices=1, data_path="direct")
    assert grouped.job.state == job_pb.JOB_STATE_SUCCEEDED, grouped.job.error
    assert len(grouped.job.shards) == 32 and all(s.attempts == 1 for s in grouped.job.shards)
    assert np.array_equal(grouped.outputs["logits"], relayed.outputs["logits"])
    assert max(sizes) > 1 and sum(sizes) <= 32


def test_a_direct_job_streams_to_a_worker_that_shares_no_memory_with_it(client, x):
    """As from another host: the worker's segments are not opened, PutObjects and FetchObjects carry the rows."""
    first = client.run("identity", {"x": np.ones((8, 1024), np.float32)}, data_path="direct")
    address = {a for a in client._direct.objects._ways}
    assert first.moved_bytes and address
    for worker in address:
        client._direct.objects._ways[worker] = STREAMED
    wide = np.random.default_rng(4).standard_normal((64, 1024)).astype(np.float32)
    result = client.run("identity", {"x": wide}, data_path="direct")
    assert result.job.state == job_pb.JOB_STATE_SUCCEEDED
    assert np.array_equal(result.outputs["y"], wide)
    assert result.moved_bytes == {STREAMED: 2 * wide.nbytes}


def test_a_spot_checked_direct_job_is_refused_before_any_device_is_reserved(client, x, mesh):
    """Spot checks compare outputs in the dispatcher, which the direct path never sees."""
    error = rpc_error(client.run, "mlp_classifier", {"x": x}, data_path="direct", verify_fraction=0.5)
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION and "DATA_PATH_RELAY" in error.details()
    assert _reservations(mesh) == []


def _reservations(mesh):
    from accelmesh.inventory.v1 import inventory_service_pb2 as inv_pb

    _, _, stub = mesh
    return list(stub.ListReservations(inv_pb.ListReservationsRequest()).reservations)


def test_training_and_submit_job_are_refused_the_direct_path_naming_the_field(client, x):
    from accelmesh.dispatch.v1 import job_pb2

    training = job_spec("mlp_train_step", {"x": x, "y": np.zeros(ROWS, np.int32)}, training=job_pb2.TrainingOptions(),
                        data_path="direct")
    error = rpc_error(lambda: list(client.stub.RunJob(iter([pb.RunJobRequest(spec=training)]))))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "spec.data_path" in error.details()
    inference = job_spec("mlp_classifier", {"x": x}, data_path="direct")
    error = rpc_error(client.stub.SubmitJob, iter([pb.SubmitJobRequest(spec=inference)]))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "RunJob" in error.details()


class _Recording:
    """A dispatcher stub whose RunJob calls are recorded: the requests the client sends, and the
    response parts (batches unpacked) it reads, in order."""

    def __init__(self, stub):
        self._stub, self.sent, self.parts = stub, [], []

    def RunJob(self, requests, timeout=None):
        def sent():
            for request in requests:
                self.sent.append(request)
                yield request
        return _Tapped(self._stub.RunJob(sent(), timeout=timeout), self.parts)


class _Tapped:
    def __init__(self, call, parts):
        self._call, self._parts = call, parts

    def __iter__(self):
        for response in unbatched(self._call):
            kept = type(response)()
            kept.CopyFrom(response)  # as it came: the client fills in the shards' tickets of its own
            self._parts.append(kept)
            yield response

    def cancel(self):
        self._call.cancel()


def _direct_run(client, recording, program, inputs):
    spec = job_spec(program, inputs, data_path="direct")
    return client._direct.run(recording, spec, inputs, None)


def _parts(recording, kind: str) -> list[int]:
    return [i for i, r in enumerate(recording.parts) if r.WhichOneof("part") == kind]


def test_a_shard_s_inputs_are_said_stored_as_put_and_its_outputs_come_as_it_finishes(client, monkeypatch):
    """With put groups and output batches of one shard each, every shard is said stored on its
    own, and the outputs of the first shard to finish are named before the last shard finishes
    (each shard once)."""
    monkeypatch.setattr(object_client, "PUT_GROUP_BYTES", 1)
    monkeypatch.setattr(direct, "TELL_BYTES", 1)
    wide = np.random.default_rng(5).standard_normal((64, 1024)).astype(np.float32)  # 8 shards of 32 KiB
    recording = _Recording(client.stub)
    result = _direct_run(client, recording, "identity", {"x": wide})
    assert result.job.state == job_pb.JOB_STATE_SUCCEEDED and np.array_equal(result.outputs["y"], wide)
    shards = len(result.job.shards)
    assert shards == 8
    stored = [list(r.stored.shard_indexes) for r in recording.sent if r.WhichOneof("part") == "stored"]
    assert sorted(stored) == [[i] for i in range(shards)]

    finished = [i for i in _parts(recording, "event")
                if recording.parts[i].event.type == job_pb.JOB_EVENT_TYPE_SHARD_FINISHED]
    told = _parts(recording, "outputs")
    assert len(finished) == shards and told and told[0] < finished[-1]
    named = [s.shard_index for i in told for s in recording.parts[i].outputs.shards]
    assert sorted(named) == list(range(shards))


def test_a_job_of_small_shards_puts_once_and_is_told_its_outputs_once(client):
    """Under PUT_GROUP_BYTES and TELL_BYTES in all, one `stored` and one `outputs` for the job."""
    wide = np.random.default_rng(6).standard_normal((64, 1024)).astype(np.float32)
    recording = _Recording(client.stub)
    result = _direct_run(client, recording, "identity", {"x": wide})
    assert np.array_equal(result.outputs["y"], wide) and len(result.job.shards) == 8
    stored = [list(r.stored.shard_indexes) for r in recording.sent if r.WhichOneof("part") == "stored"]
    assert stored == [list(range(8))]
    told = _parts(recording, "outputs")
    assert len(told) == 1 and [s.shard_index for s in recording.parts[told[0]].outputs.shards] == list(range(8))
    # One ticket for each worker in a message, not one a shard (a ticket is about 1 KiB).
    for message in (recording.parts[told[0]].outputs, recording.parts[_parts(recording, "put_inputs")[0]].put_inputs):
        assert not any(s.ticket for s in message.shards)
        assert set(message.tickets) == {s.worker_address for s in message.shards} and all(message.tickets.values())


def test_fetched_outputs_are_freed_in_the_store_by_the_time_the_client_is_closed(mesh):
    """The release goes without waiting for the worker's answer; closing the client waits for it."""
    server, _, _ = mesh
    wide = np.random.default_rng(7).standard_normal((64, 1024)).astype(np.float32)
    with MeshClient(f"127.0.0.1:{server.port}", security=CREDENTIALS.client()) as own:
        recording = _Recording(own.stub)
        assert np.array_equal(_direct_run(own, recording, "identity", {"x": wide}).outputs["y"], wide)
        told = [(s, recording.parts[i].outputs.tickets[s.worker_address])
                for i in _parts(recording, "outputs") for s in recording.parts[i].outputs.shards]
    assert told
    with MeshClient(f"127.0.0.1:{server.port}", security=CREDENTIALS.client()) as other:
        for shard, ticket in told:
            request = pb_worker.FetchObjectsRequest(ticket=ticket, object_ids=list(shard.object_ids))
            stub = other._direct.objects._stub(shard.worker_address)
            error = rpc_error(lambda stub=stub, request=request: list(stub.FetchObjects(request)))
            assert error.code() == grpc.StatusCode.NOT_FOUND, error.details()


STORE_BYTES = 512 * 1024


@pytest.fixture(scope="module")
def small_store(tmp_path_factory):
    """A mesh whose worker's store holds a quarter of the job below."""
    env = {"ACCELMESH_WORKER_STORE_BYTES": str(STORE_BYTES), "ACCELMESH_WORKER_STORE_WAIT_S": "10"}
    with small_mesh(tmp_path_factory.mktemp("small-store"), max_shard_bytes=SHARD_BYTES, worker_env=env) as mesh:
        yield mesh


def test_a_job_four_times_the_worker_store_runs_as_puts_wait_for_finished_shards(small_store, monkeypatch):
    """The client puts at most PUT_AHEAD_BYTES ahead of the shards said finished, the dispatcher
    frees a finished shard's inputs, the client each fetched batch's outputs: the store holds a
    window of the job, never all of it (without those, the puts fill it and are refused)."""
    monkeypatch.setattr(object_client, "PUT_GROUP_BYTES", 64 * 1024)
    monkeypatch.setattr(object_client, "PUT_AHEAD_BYTES", 128 * 1024)
    monkeypatch.setattr(direct, "TELL_BYTES", 64 * 1024)
    server, _, _ = small_store
    x = np.random.default_rng(8).standard_normal((512, 1024)).astype(np.float32)
    assert x.nbytes == 4 * STORE_BYTES
    with MeshClient(f"127.0.0.1:{server.port}", security=CREDENTIALS.client()) as own:
        result = own.run("identity", {"x": x}, data_path="direct")
    assert result.job.state == job_pb.JOB_STATE_SUCCEEDED, result.job.error
    assert np.array_equal(result.outputs["y"], x) and len(result.job.shards) == 64


def test_a_put_that_fails_ends_the_call_and_is_the_error_raised(client, monkeypatch):
    real = object_client.ObjectClient._put_one
    calls = []

    def failing(self, address, ticket, objects):
        calls.append(address)
        if len(calls) == 2:
            raise OSError("the disk under the segment went away")
        return real(self, address, ticket, objects)

    monkeypatch.setattr(object_client, "PUT_GROUP_BYTES", 1)
    monkeypatch.setattr(object_client.ObjectClient, "_put_one", failing)
    wide = np.ones((64, 1024), np.float32)
    with pytest.raises(OSError, match="went away"):
        client.run("identity", {"x": wide}, data_path="direct")
