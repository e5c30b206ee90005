"""Status scores: the documented default weights, hand-checked rankings, reservations, bad input."""

from __future__ import annotations

import pytest

from accelmesh.errors import InvalidArgument
from accelmesh.hardware.model import DeviceSample, DeviceSpec, NodeDescription, Performance
from inventory_svc.records import DeviceRecord
from inventory_svc.scoring import DeviceStatus, TaskProfile, Weights, score_devices, status_of, weights_for
from inventory_svc.store import SqlStore

GB = 10**9


def device(
    name: str, fp32_tflops: float, bandwidth_gbps: float, memory: int, *, used: int = 0, utilization: float = 0.0,
    reserved_memory: int = 0, reserved_compute: float = 0.0, peaks: dict[str, float] | None = None,
) -> DeviceRecord:
    spec = DeviceSpec(
        id=f"10.0.0.1/cuda:{name}", node_ip="10.0.0.1", local_index=0, platform="cuda", kind=name, type=name,
        performance=Performance(peaks or {"fp32": fp32_tflops}, memory, bandwidth_gbps),
    )
    sample = DeviceSample(spec.id, 1.0, memory, used, utilization)
    return DeviceRecord(spec, "10.0.0.1:50051", "healthy", sample, reserved_memory, reserved_compute, 0.0, 0.0)


# X is compute-rich, Y memory- and bandwidth-rich, Z in between but busy (60% utilised).
# Balance points (FLOP/B): X 100, Y 10, Z 50 -> median 50.
X = device("x", 100.0, 1000.0, 16 * GB)
Y = device("y", 20.0, 2000.0, 80 * GB)
Z = device("z", 50.0, 1000.0, 40 * GB, utilization=0.6)


def test_status_combines_peak_utilisation_reservations_and_precision():
    record = device(
        "s", 0.0, 1000.0, 80 * GB, used=20 * GB, utilization=0.5, reserved_memory=10 * GB, reserved_compute=0.25,
        peaks={"fp32": 20.0, "bf16": 100.0},
    )
    assert status_of(record, "bf16").compute_tflops == pytest.approx(100.0 * 0.5 * 0.75)
    assert status_of(record, "fp8").compute_tflops == pytest.approx(20.0 * 0.5 * 0.75)  # falls back to fp32
    assert status_of(record).memory_free_bytes == 50 * GB
    assert status_of(record).bandwidth_gbps == pytest.approx(750.0)
    oversubscribed = device("o", 10.0, 1000.0, 8 * GB, reserved_memory=9 * GB, reserved_compute=1.5)
    assert status_of(oversubscribed) == DeviceStatus(0.0, 0, 0.0)


@pytest.mark.parametrize(
    "profile, expected",
    [
        # I=100, B=50: compute 2/3; the remaining 1/3 splits 2:1 for training.
        (TaskProfile("training"), (2 / 3, 2 / 9, 1 / 9)),
        # I=10, B=50: compute 1/6; the remaining 5/6 splits evenly for inference.
        (TaskProfile("inference"), (1 / 6, 5 / 12, 5 / 12)),
        # An explicit intensity replaces the default: I=50=B gives compute 1/2.
        (TaskProfile("training", arithmetic_intensity=50.0), (1 / 2, 1 / 3, 1 / 6)),
        (TaskProfile("inference", weights=Weights(2, 1, 1)), (0.5, 0.25, 0.25)),
    ],
)
def test_default_weights_follow_the_documented_rule(profile, expected):
    weights = weights_for(profile, [X, Y, Z])
    assert (weights.compute, weights.memory, weights.bandwidth) == pytest.approx(expected)


def test_training_ranking_is_hand_checked():
    ranked = score_devices([Z, Y, X], TaskProfile("training"))
    assert [s.record.id for s in ranked] == [X.id, Y.id, Z.id]
    # X: 2/3*1 + 2/9*0.2 + 1/9*0.5;  Y: 2/3*0.2 + 2/9*1 + 1/9*1;  Z: 2/3*0.2 + 2/9*0.5 + 1/9*0.5
    assert [s.score for s in ranked] == pytest.approx([69 / 90, 42 / 90, 27 / 90])
    assert ranked[2].components == pytest.approx({"compute": 0.2, "memory": 0.5, "bandwidth": 0.5})


def test_compute_rich_wins_training_and_memory_rich_wins_inference():
    assert score_devices([X, Y, Z], TaskProfile("training"))[0].record.id == X.id
    inference = score_devices([X, Y, Z], TaskProfile("inference"))
    assert [s.record.id for s in inference] == [Y.id, X.id, Z.id]
    assert inference[0].score == pytest.approx(1 / 6 * 0.2 + 5 / 12 + 5 / 12)


def test_ties_break_by_id_and_limit_keeps_the_top():
    twin_b, twin_a = device("b", 10.0, 500.0, 8 * GB), device("a", 10.0, 500.0, 8 * GB)
    assert [s.record.id for s in score_devices([twin_b, twin_a], TaskProfile("training"))] == [twin_a.id, twin_b.id]
    assert [s.record.id for s in score_devices([X, Y, Z], TaskProfile("training"), limit=1)] == [X.id]
    assert score_devices([], TaskProfile("inference")) == []


def test_reservation_changes_the_ranking_and_release_restores_it(database_url):
    store = SqlStore(database_url)
    store.upsert_node("10.0.0.1:50051", "10.0.0.1", "host", now=0.0)
    fast, slower = (
        DeviceSpec(
            id=f"10.0.0.1/cuda:{i}", node_ip="10.0.0.1", local_index=i, platform="cuda", kind="g", type="g",
            performance=Performance({"fp32": tflops}, 80 * GB, 1000.0),
        )
        for i, tflops in ((0, 100.0), (1, 90.0))
    )
    samples = tuple(DeviceSample(s.id, 0.0, 80 * GB, 0) for s in (fast, slower))
    store.record_poll_success("10.0.0.1:50051", NodeDescription("10.0.0.1", "host", (fast, slower), samples), now=0.0)

    def ranking() -> list[str]:
        records, _ = store.list_devices(now=1.0)
        return [s.record.id for s in score_devices(records, TaskProfile("training"))]

    assert ranking() == [fast.id, slower.id]
    store.reserve("job-1", fast.id, 60 * GB, 0.5, ttl_s=60, now=0.5)
    assert ranking() == [slower.id, fast.id]
    assert store.release("job-1") == 1
    assert ranking() == [fast.id, slower.id]
    store.close()


@pytest.mark.parametrize(
    "weights, field",
    [
        ((-1.0, 1.0, 1.0), "task.weights.compute"),
        ((1.0, float("nan"), 1.0), "task.weights.memory"),
        ((1.0, 1.0, float("inf")), "task.weights.bandwidth"),
        (("1", 1.0, 1.0), "task.weights.compute"),
        ((0.0, 0.0, 0.0), "are all 0"),
    ],
)
def test_bad_weights_name_the_field(weights, field):
    with pytest.raises(InvalidArgument, match=field):
        score_devices([X], TaskProfile("training", weights=Weights(*weights)))


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"kind": "training", "precision": "fp12"}, "task.precision"),
        ({"kind": "finetune"}, "task.kind"),
        ({"kind": "inference", "arithmetic_intensity": -3.0}, "task.arithmetic_intensity"),
    ],
)
def test_bad_task_profiles_name_the_field(kwargs, field):
    with pytest.raises(InvalidArgument, match=field):
        score_devices([X], TaskProfile(**kwargs))
