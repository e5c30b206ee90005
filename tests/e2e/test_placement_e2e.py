"""A model placed layer by layer across devices of two types, planned and run as a pipeline
through the whole mesh as real processes (requirements B3-B7); bad tables and options refused with
the field named; nothing reserved is left behind."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from accelmesh.client import MeshClient
from accelmesh.dispatch.v1 import job_pb2 as job_pb
from accelmesh.dispatch.v1 import plan_pb2 as plan_pb
from accelmesh.embedded import start_embedded_mesh
from accelmesh.inventory.v1 import inventory_service_pb2 as inv_pb
from compile_svc.programs import default_registry
from dispatch_svc.execution.strategies.pipeline import weighted_turns

from conftest import reservations, rpc_error

pytestmark = [pytest.mark.slow, pytest.mark.fixture_cpu]

EMULATE = ("a100-80gb", "a100-80gb", "v100-32gb")  # 3 devices of 2 types
RANKED, BALANCED, AUTO = (plan_pb.PLACEMENT_STRATEGY_RANKED, plan_pb.PLACEMENT_STRATEGY_BALANCED,
                          plan_pb.PLACEMENT_STRATEGY_AUTO)
GB = 10**9


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    # plans from the catalog alone: what the tests below assert must not follow this host's timing
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("ACCELMESH_STAGE_CALIBRATION", "0")
        with start_embedded_mesh(tmp_path_factory.mktemp("mesh"), devices=3, emulate=EMULATE) as running:
            yield running


def test_finished_stage_calls_calibrate_the_next_plan_of_their_types(tmp_path):
    x = tokens(24)
    options = plan_pb.PlacementOptions(strategy=BALANCED, device_count=3, micro_batch_rows=8)
    with start_embedded_mesh(tmp_path, devices=3, emulate=EMULATE) as calibrating, \
            MeshClient(calibrating.dispatch.address, security=calibrating.client) as c:
        before = c.plan("transformer_encoder", {"tokens": x}, placement=options).placement
        assert not any(line.startswith("calibrated") for line in before.explain)
        ran = c.run("transformer_encoder", {"tokens": x}, placement=options).job
        after = c.plan("transformer_encoder", {"tokens": x}, placement=options).placement
    calls: dict[str, int] = {}
    for record in ran.shards:  # every stage call of the job, by its device's type
        calls[record.target_type] = calls.get(record.target_type, 0) + 1
    lines = [line for line in after.explain if line.startswith("calibrated")]
    assert len(lines) == len(calls) == 2  # the A100s' and the V100's
    for target_type, count in calls.items():
        assert any(line.startswith(f"calibrated: {target_type} from {count} stage call(s): compute ") for line in lines)


@pytest.fixture
def client(mesh):
    with MeshClient(mesh.dispatch.address) as c:
        yield c


def tokens(rows: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 512, size=(rows, 32), dtype=np.int32)


def single_device(x: np.ndarray) -> np.ndarray:
    program = default_registry().get("transformer_encoder")
    return np.asarray(program.fn(*program.init_params(0), x)[0])


def explicit(*rows: tuple) -> list[plan_pb.LayerCost]:
    return [plan_pb.LayerCost(name=name, order=order, parameter_count=count, parameter_bytes=4 * count,
                              flops_per_sample=2.0 * count, activation_bytes_per_sample=4096)
            for name, order, count in rows]


@pytest.mark.parametrize("strategy", [RANKED, BALANCED])
def test_transformer_runs_as_a_pipeline_across_three_devices_of_two_types(client, mesh, strategy):
    x = tokens(50)
    result = client.run("transformer_encoder", {"tokens": x},
                        placement=plan_pb.PlacementOptions(strategy=strategy, device_count=3, micro_batch_rows=8))
    assert result.job.state == job_pb.JOB_STATE_SUCCEEDED, result.job.error
    placement = result.job.plan.placement
    assert placement.strategy == strategy
    assert len(placement.devices) == 3
    assert {d.target_type.split(":")[1].split("[")[0] for d in placement.devices} == {"a100-80gb", "v100-32gb"}
    assert [layer.layer for layer in placement.layers] == ["embed", *(f"block_{i}" for i in range(4)), "head"]
    stages = placement.stages
    assert all(s.artifact_key and s.rule for s in stages), "each stage built for its device's rule"
    assert len({s.artifact_key for s in stages}) == len(stages)
    assert {s.rule for s in stages} == {"cuda-bf16", "cuda-fp32"}
    assert placement.micro_batches == 7 and placement.cross_device_transfers == len(stages) - 1
    # Every micro-batch went through every stage on the stage's own device (of a replicated
    # stage: on the device whose turn it was, by the plan's shares).
    assert len(result.job.shards) == 7 * len(stages)
    for record in result.job.shards:
        stage = stages[record.index % len(stages)]
        devices = [stage.device_id, *stage.replica_device_ids]
        turns = weighted_turns(tuple(stage.micro_batch_shares) or (1.0,) * len(devices), 7)
        assert record.done and record.device_id == devices[turns[record.index // len(stages)]]
        # the plan's seconds for this stage on this device, beside what the call took
        assert record.predicted_seconds > 0 and record.total_seconds > 0
    # the job's predicted makespan beside its measured one (first stage call to the last outputs)
    assert result.job.plan.predicted_seconds > 0 and result.job.measured_seconds > 0
    wall_s = result.job.end_time.ToNanoseconds() / 1e9 - result.job.create_time.ToNanoseconds() / 1e9
    assert result.job.measured_seconds <= wall_s
    if strategy == BALANCED:  # the two A100s share the heavy stage, taking micro-batches in turn
        replicated = [s for s in stages if s.replica_device_ids]
        assert len(replicated) == 1 and len(replicated[0].replica_device_ids) == 1
        assert {r.device_id for r in result.job.shards if r.index % len(stages) == replicated[0].index} == \
            {replicated[0].device_id, *replicated[0].replica_device_ids}
        assert "sharing micro-batches 50% / 50%" in "\n".join(placement.explain)
    logits = result.outputs["logits"]
    expected = single_device(x)
    assert logits.shape == (50, 16)
    assert np.max(np.abs(logits - expected)) / np.max(np.abs(expected)) <= 5e-2  # the bf16 rule's tolerance
    assert reservations(mesh) == []


def single_device_training(x: np.ndarray, labels: np.ndarray, options: job_pb.TrainingOptions):
    """The same steps on one fp32 device: mean cross-entropy over each mini-batch, jax.grad, the
    optimizer data-parallel training uses."""
    import jax
    import jax.numpy as jnp

    from dispatch_svc.jobs.training_options import SgdMomentum, minibatches

    program = default_registry().get("transformer_encoder")
    params = [np.asarray(p) for p in program.init_params(0)]
    optimizer = SgdMomentum(options.learning_rate, options.momentum)

    def loss(leaves, xs, ys):
        logits = program.fn(*leaves, xs)[0]
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), ys[:, None], axis=1))

    losses = []
    for batch in minibatches(len(x), options.batch_size, options.epochs, options.shuffle_seed):
        value, grads = jax.value_and_grad(loss)(params, x[batch.indices], labels[batch.indices])
        params = optimizer.step(params, [np.asarray(g) for g in grads])
        losses.append(float(value))
    return dict(zip((p.name for p in program.parameters), params)), losses


def test_a_placed_transformer_trains_as_a_pipeline_and_matches_single_device_training(client, mesh):
    x, labels = tokens(48, seed=1), np.random.default_rng(2).integers(0, 16, size=48).astype(np.int32)
    options = job_pb.TrainingOptions(epochs=1, batch_size=24, learning_rate=0.5, momentum=0.9, shuffle_seed=3)
    result = client.run("transformer_encoder", {"tokens": x, "labels": labels}, training=options,
                        placement=plan_pb.PlacementOptions(strategy=BALANCED, device_count=3, micro_batch_rows=8))
    assert result.job.state == job_pb.JOB_STATE_SUCCEEDED, result.job.error
    placement = result.job.plan.placement
    assert len(placement.stages) >= 2 and len(placement.devices) == 3
    assert {d.target_type.split(":")[1].split("[")[0] for d in placement.devices} == {"a100-80gb", "v100-32gb"}
    # every micro-batch's forward and backward pass of every stage ran (3 micro-batches a step)
    assert len(result.job.shards) == 3 * len(placement.stages) * 2 and all(r.done for r in result.job.shards)
    assert all(r.predicted_seconds > 0 for r in result.job.shards)
    # one optimizer step predicted, against the mean step measured
    assert result.job.plan.predicted_seconds > 0 and result.job.measured_seconds > 0
    expected, expected_losses = single_device_training(x, labels, options)
    assert len(result.job.losses) == 2
    np.testing.assert_allclose(result.job.losses, expected_losses, rtol=5e-2)
    program = default_registry().get("transformer_encoder")
    initial = dict(zip((p.name for p in program.parameters), program.init_params(0)))
    # What training changed, here and on one device: the A100 stages compute in bf16, so the
    # pipeline's update is the fp32 one within that rule's tolerance (5e-2), leaf by leaf on the
    # scale of the largest change, and as a whole.
    got = {name: result.outputs[name] - np.asarray(initial[name]) for name in expected}
    want = {name: expected[name] - np.asarray(initial[name]) for name in expected}
    scale = max(np.max(np.abs(w)) for w in want.values())
    assert scale > 1e-3, "it trained"
    for name in expected:
        assert result.outputs[name].shape == expected[name].shape and result.outputs[name].dtype == expected[name].dtype
        assert np.max(np.abs(got[name] - want[name])) <= 5e-2 * scale, name
    flat = lambda d: np.concatenate([v.ravel() for v in d.values()])  # noqa: E731
    assert np.linalg.norm(flat(got) - flat(want)) <= 5e-2 * np.linalg.norm(flat(want))
    assert reservations(mesh) == []


def test_placed_training_refuses_inputs_without_labels(client):
    options = job_pb.TrainingOptions(epochs=1, batch_size=8)
    with pytest.raises(grpc.RpcError) as info:
        client.run("transformer_encoder", {"tokens": tokens(8)}, training=options,
                   placement=plan_pb.PlacementOptions(strategy=BALANCED, device_count=2))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "['tokens', 'labels']" in info.value.details()


def test_plan_reports_both_strategies_and_takes_the_faster(client):
    plan = client.plan("transformer_encoder", {"tokens": tokens(64)},
                       placement=plan_pb.PlacementOptions(strategy=AUTO, device_count=3))
    placement = plan.placement
    by_strategy = {c.strategy: c for c in placement.candidates}
    assert set(by_strategy) == {RANKED, BALANCED}
    best = min(c.predicted_step_seconds for c in placement.candidates if c.feasible)
    assert placement.predicted_step_seconds == pytest.approx(best)
    assert placement.lower_bound_step_seconds <= placement.predicted_step_seconds
    assert placement.micro_batch_rows == 8 and placement.micro_batches == 8
    assert sum(d.memory_bytes for d in placement.devices) >= sum(layer.memory_bytes for layer in placement.layers)
    assert all(0 < d.memory_bytes <= d.memory_capacity_bytes for d in placement.devices)
    assert placement.weights.compute + placement.weights.memory + placement.weights.bandwidth == pytest.approx(1)
    assert "arithmetic intensity" in placement.weights_rule or placement.weights_rule
    assert any(line.startswith("auto: took") for line in placement.explain)
    for candidate in placement.candidates:  # per-device memory and load of each strategy, not only the taken one
        assert len(candidate.devices) == candidate.device_count
        busiest = max(d.compute_seconds + d.transfer_seconds for d in candidate.devices)
        assert busiest == pytest.approx(candidate.predicted_step_seconds)
    taken = by_strategy[placement.strategy]
    assert [d.device_id for d in taken.devices] == [d.device_id for d in placement.devices]
    assert not plan.shards


def test_client_weights_override_the_derived_ones(client):
    options = plan_pb.PlacementOptions(strategy=RANKED, device_count=1,
                                       weights=inv_pb.TaskWeights(compute=0.0, memory=1.0, bandwidth=0.0))
    placement = client.plan("transformer_encoder", {"tokens": tokens(8)}, placement=options).placement
    assert (placement.weights.compute, placement.weights.memory) == (0.0, 1.0)
    # All memory: an A100 (80 GB) beats the V100 (32 GB).
    assert "a100-80gb" in placement.devices[0].target_type


def test_an_explicit_layer_table_is_planned_without_a_program(client):
    rows = [("embed", 0, 50_000_000), *((f"block_{i}", i + 1, 200_000_000) for i in range(6)), ("head", 7, 50_000_000)]
    plan = client.plan("my-model", {}, placement=plan_pb.PlacementOptions(strategy=BALANCED, layers=explicit(*rows)))
    placement = plan.placement
    assert [layer.layer for layer in placement.layers] == [name for name, _, _ in rows]
    assert placement.device_count >= 1 and not any(s.artifact_key for s in placement.stages)


@pytest.mark.parametrize("options, code, message", [
    (plan_pb.PlacementOptions(strategy=RANKED, layers=explicit(("a", 0, 10), ("a", 1, 10))),
     grpc.StatusCode.INVALID_ARGUMENT, "spec.placement.layers[1].name 'a' is also spec.placement.layers[0].name"),
    (plan_pb.PlacementOptions(strategy=RANKED, layers=[plan_pb.LayerCost(name="a", order=0, parameter_count=-3)]),
     grpc.StatusCode.INVALID_ARGUMENT, "spec.placement.layers[0].parameter_count of layer 'a' must be"),
    (plan_pb.PlacementOptions(strategy=RANKED, layers=explicit(("a", 0, 10), ("b", 5, 10))),
     grpc.StatusCode.INVALID_ARGUMENT, "must number the 2 layers 0..1"),
    (plan_pb.PlacementOptions(strategy=RANKED, memory_headroom=1.5, layers=explicit(("a", 0, 10))),
     grpc.StatusCode.INVALID_ARGUMENT, "spec.placement.memory_headroom must be in [0, 1)"),
    (plan_pb.PlacementOptions(strategy=RANKED, device_count=9, layers=explicit(("a", 0, 10))),
     grpc.StatusCode.INVALID_ARGUMENT, "spec.placement.device_count is 9 but only 3 devices"),
    (plan_pb.PlacementOptions(layers=explicit(("a", 0, 10))),
     grpc.StatusCode.INVALID_ARGUMENT, "spec.placement.strategy must be"),
    (plan_pb.PlacementOptions(strategy=AUTO, layers=explicit(("huge", 0, 20 * GB), ("tail", 1, 1000))),
     grpc.StatusCode.RESOURCE_EXHAUSTED, "'huge'"),
    (plan_pb.PlacementOptions(strategy=BALANCED, layers=explicit(*((f"l{i}", i, 20 * GB) for i in range(3)))),
     grpc.StatusCode.RESOURCE_EXHAUSTED, "short by"),
])
def test_bad_tables_and_options_are_refused_naming_the_field(client, mesh, options, code, message):
    err = rpc_error(client.plan, "my-model", {}, placement=options)
    assert err.code() == code
    assert message in err.details()
    assert reservations(mesh) == []


def test_a_model_that_fits_on_no_device_set_reports_the_shortfall_in_bytes(client):
    rows = [(f"l{i}", i, 20 * GB) for i in range(3)]  # 240 GB of float32 parameters; 172.8 GB usable
    err = rpc_error(client.plan, "my-model", {},
                    placement=plan_pb.PlacementOptions(strategy=RANKED, layers=explicit(*rows)))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "short by" in err.details() and "bytes" in err.details()


def test_unknown_models_and_non_models_are_refused(client, mesh):
    options = plan_pb.PlacementOptions(strategy=RANKED)
    err = rpc_error(client.plan, "no_such_model", {"tokens": tokens(4)}, placement=options)
    assert err.code() == grpc.StatusCode.NOT_FOUND and "no_such_model" in err.details()
    x = np.zeros((4, 8), np.float32)
    err = rpc_error(client.run, "identity", {"x": x}, placement=options)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "name a model program" in err.details()
    err = rpc_error(client.run, "my-model", {"tokens": tokens(4)},
                    placement=plan_pb.PlacementOptions(strategy=RANKED, layers=explicit(("a", 0, 10))))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "PlanJob" in err.details()
    assert reservations(mesh) == []


def test_cancelling_a_pipeline_stops_it_and_releases_every_device(client, mesh):
    options = plan_pb.PlacementOptions(strategy=BALANCED, device_count=3, micro_batch_rows=4)
    job_id = client.submit("transformer_encoder", {"tokens": tokens(4000, seed=3)}, placement=options)
    for event in client.watch(job_id):
        if event.type == job_pb.JOB_EVENT_TYPE_SHARD_STARTED:
            break
    held = {r.device_id: r.memory_bytes for r in reservations(mesh)}
    planned = {d.device_id: d.memory_bytes for d in client.get(job_id).plan.placement.devices}
    assert held == planned, "a running pipeline holds what its plan needs on each device"
    job = client.cancel(job_id)
    assert job.state == job_pb.JOB_STATE_CANCELLED
    assert list(client.watch(job_id))[-1].type == job_pb.JOB_EVENT_TYPE_CANCELLED
    assert reservations(mesh) == []
