"""Bucketed shard sizes through the whole mesh as real processes: jobs of one program and input
size, planned on the rates the dispatcher measures as they run, leave the compile service's cache
with a handful of executables per target type (one XLA compile each), and every result equals a
one-device run.

The bound, BUCKET_RUNGS + 1 = 6 sizes per target type: a job's shards are its bucket ladder's
rungs plus at most one tail, and the ladder depends only on the job's rows and largest shard
(dispatch_svc.planner.buckets), so however the measured rates move the plans, no new size comes.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from accelmesh.client import MeshClient
from accelmesh.dispatch.v1 import job_pb2 as job_pb
from accelmesh.embedded import start_embedded_mesh
from compile_svc.programs import default_registry
from dispatch_svc.planner import BUCKET_RUNGS, bucket_ladder

pytestmark = pytest.mark.slow

EMULATE = ("v100-32gb", "v100-32gb", "t4")  # two fp32 target types: results equal a one-device run
JOBS = 8
ROWS = 1500  # under the default 16 MiB shard cap: the largest shard is the job, unit 93, tail 12


def executables(cache_dir) -> dict[str, set[int]]:
    """Batch sizes of the executables in the compile service's cache, per target type."""
    sizes: dict[str, set[int]] = {}
    for sidecar in cache_dir.glob("??/*.json"):
        meta = json.loads(sidecar.read_text())["metadata"]
        if meta.get("format") == "executable" and meta.get("program", "").startswith("mlp_classifier@"):
            sizes.setdefault(meta["target"], set()).add(meta["batch_size"])
    return sizes


def test_jobs_under_measured_rates_compile_a_handful_of_sizes_per_target_type(tmp_path):
    x = np.random.default_rng(6).standard_normal((ROWS, 64)).astype(np.float32)
    ladder = bucket_ladder(ROWS)
    splits = set()
    with start_embedded_mesh(tmp_path / "mesh", devices=len(EMULATE), emulate=EMULATE) as mesh:
        program = default_registry().get("mlp_classifier")  # JAX runs here only once the processes are up
        (expected,) = [np.asarray(o) for o in program.fn(*program.init_params(0), x)]
        with MeshClient(mesh.dispatch.address) as client:
            for _ in range(JOBS):
                result = client.run("mlp_classifier", {"x": x}, timeout=120)
                assert result.job.state == job_pb.JOB_STATE_SUCCEEDED, result.job.error
                np.testing.assert_allclose(result.outputs["logits"], expected, rtol=1e-5, atol=1e-6)
                assert {s.rows for s in result.job.shards} <= set(ladder.sizes)
                splits.add(tuple(s.rows for s in result.job.shards))
        built = executables(mesh.data_dir / "artifacts")
    assert len(built) == 2, built  # the V100s share one target type, the T4 has its own
    for target, sizes in built.items():
        assert sizes <= set(ladder.sizes) and len(sizes) <= BUCKET_RUNGS + 1, (target, sorted(sizes))
    print(json.dumps({"jobs": JOBS, "distinct_splits": len(splits),
                      "executables": {t: sorted(s) for t, s in built.items()}}))
