"""The queue's scheduling round on a real mesh (an inventory, a compile service and a worker with
two emulated V100s and an emulated A100 as processes, the dispatcher in this process): two jobs
queued while the pool is full start together once it frees up, each on the devices the default
policy (min_total_time: each type to the jobs it speeds up most) gives it. The operator's
throughput table (ACCELMESH_SCHEDULING_THROUGHPUTS) says that `mlp_classifier` runs 10x faster on
an A100 and `identity` (a copy) no faster: the A100 goes to the job that gains from it although
the other came first, where FIFO would hand it to the first, equal rates going to the first type
by name (tests/dispatch/admission/test_scheduling_rounds.py checks the policies on the same inputs)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from test_queue_e2e import Running

from accelmesh.client import MeshClient
from accelmesh.dispatch.v1 import job_pb2 as job_pb
from accelmesh.inventory.v1 import inventory_service_pb2 as inv_pb
from compile_svc.programs.builtin import IDENTITY_WIDTH

from conftest import small_mesh

pytestmark = pytest.mark.slow

OCCUPIER = "occupier-of-the-test"
V100, A100 = "v100-32gb", "a100-80gb"
TABLE = f"""
[identity]
"{V100}" = 100.0
"{A100}" = 100.0

[mlp_classifier]
"{V100}" = 10.0
"{A100}" = 100.0
"""


def test_two_queued_jobs_start_together_each_on_the_type_the_default_policy_gives_it(tmp_path):
    table = tmp_path / "throughputs.toml"
    table.write_text(TABLE)
    with small_mesh(tmp_path / "mesh", emulate=(V100, V100, A100), queue_poll_s=0.1,
                    scheduling_throughputs=str(table)) as (server, _, inventory):
        devices = {d.id: d for d in inventory.ListDevices(inv_pb.ListDevicesRequest()).devices}
        assert sorted(d.type for d in devices.values()) == [A100, V100, V100]
        inventory.ReserveDevices(inv_pb.ReserveDevicesRequest(job_id=OCCUPIER, ttl_seconds=300, claims=[
            inv_pb.DeviceClaim(device_id=d.id, memory_bytes=d.status.memory_free_bytes, compute_fraction=1.0)
            for d in devices.values()]))
        rng = np.random.default_rng(7)
        inputs = {"identity": rng.standard_normal((64, IDENTITY_WIDTH)).astype(np.float32),
                  "mlp_classifier": rng.standard_normal((64, 64)).astype(np.float32)}
        with MeshClient(f"127.0.0.1:{server.port}") as client:
            calls = {}
            for program in ("identity", "mlp_classifier"):  # identity first: FIFO would give it the A100
                calls[program] = Running(client, inputs[program], program=program, name=program)
                queued = calls[program].until(job_pb.JOB_EVENT_TYPE_QUEUED)
                assert queued.queue.position == len(calls)
            inventory.ReleaseDevices(inv_pb.ReleaseDevicesRequest(job_id=OCCUPIER))
            for call in calls.values():
                call.rest()
        placed = {}
        plans = {}
        for program, call in calls.items():
            assert call.job.state == job_pb.JOB_STATE_SUCCEEDED, call.job.error
            placed[program] = sorted({devices[s.device_id].type for s in call.job.shards})
            plans[program] = [e.message for e in call.events if e.type == job_pb.JOB_EVENT_TYPE_PLANNED][-1]
            assert "the queue's min_total_time policy gave it" in plans[program], plans
        assert placed == {"identity": [V100], "mlp_classifier": [A100]}, (placed, plans)
        np.testing.assert_array_equal(calls["identity"].results.results()["y"], inputs["identity"])
        assert calls["mlp_classifier"].results.results()["logits"].shape[0] == 64
        print(json.dumps({"policy": "min_total_time", "placed": placed, "plans": plans}))

