"""`accelmesh plan`: arguments, the text it prints, the picture, and one run through the embedded mesh."""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest

from accelmesh import errors
from accelmesh.cli import main
from accelmesh.cli.placement_plot import plot_placement
from accelmesh.cli.placement_view import render_placement
from accelmesh.cli.plan import declared_inputs, load_layer_table, parse_devices, plan_request
from accelmesh.common.v1 import common_pb2
from accelmesh.compile.v1 import program_pb2 as program_pb
from accelmesh.dispatch.v1 import job_pb2 as job_pb
from accelmesh.dispatch.v1 import plan_pb2 as plan_pb
from accelmesh.inventory.v1 import inventory_service_pb2 as inv_pb

pytestmark = pytest.mark.fixture_cpu

GIB = 1024**3
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
A100, V100, T4 = "cuda@cpu:a100-80gb[bf16]", "cuda@cpu:v100-32gb[]", "cuda@cpu:t4[]"


def hand_built_placement(stages: list[tuple[str, str, int, float]], *, capacity_gib: float = 72.0) -> plan_pb.Placement:
    """Consecutive stages of (device, target type, layers, ms per layer); one stage per device."""
    placement = plan_pb.Placement(strategy=plan_pb.PLACEMENT_STRATEGY_BALANCED, micro_batch_rows=8, micro_batches=4,
                                  device_count=len(stages), cross_device_transfers=len(stages) - 1,
                                  weights=inv_pb.TaskWeights(compute=0.5, memory=0.25, bandwidth=0.25),
                                  weights_rule="given", explain=["balanced: searched 12 step times"])
    order = 0
    for index, (device, target, count, ms) in enumerate(stages):
        names = []
        for _ in range(count):
            placement.layers.add(layer=f"block_{order}", order=order, device_id=device, target_type=target,
                                 parameter_count=1000 * (order + 1), memory_bytes=(order + 1) * 64 * 1024**2,
                                 compute_seconds=ms / 1e3, stage=index)
            names.append(f"block_{order}")
            order += 1
        send = 0.0 if index == len(stages) - 1 else 0.0005
        placement.stages.add(index=index, device_id=device, target_type=target, first_layer=order - count,
                             layer_count=count, compute_seconds=count * ms / 1e3, transfer_seconds=send)
        placement.devices.add(device_id=device, target_type=target,
                              memory_bytes=sum(lp.memory_bytes for lp in placement.layers if lp.device_id == device),
                              memory_capacity_bytes=int(capacity_gib * GIB), compute_seconds=count * ms / 1e3,
                              transfer_seconds=send, layers=names, score=1.0 - index / 10)
    placement.predicted_step_seconds = max(d.compute_seconds + d.transfer_seconds for d in placement.devices)
    placement.lower_bound_step_seconds = placement.predicted_step_seconds / 2
    placement.predicted_seconds = placement.predicted_step_seconds * 5
    placement.candidates.add(strategy=plan_pb.PLACEMENT_STRATEGY_RANKED, feasible=False,
                             error="block_3 needs 4.0 GiB; no device has room")
    placement.candidates.add(strategy=plan_pb.PLACEMENT_STRATEGY_BALANCED, feasible=True,
                             predicted_step_seconds=placement.predicted_step_seconds,
                             cross_device_transfers=len(stages) - 1, device_count=len(stages))
    return placement


THREE_DEVICES = [("127.0.0.1/cuda:0", A100, 3, 2.0), ("127.0.0.1/cuda:1", A100, 2, 2.0),
                 ("127.0.0.1/cuda:2", V100, 1, 1.5)]
# GPT-2 XL's shape: 50 layers over five devices.
FIFTY_LAYERS = [("127.0.0.1/cuda:0", A100, 16, 1.0), ("127.0.0.1/cuda:1", A100, 16, 1.0),
                ("127.0.0.1/cuda:2", V100, 7, 2.2), ("127.0.0.1/cuda:3", V100, 7, 2.2),
                ("127.0.0.1/cuda:4", T4, 4, 3.5)]


@pytest.mark.parametrize("stages, capacity_gib", [(THREE_DEVICES, 72.0), (FIFTY_LAYERS, 72.0), (THREE_DEVICES, 0.5)])
def test_the_plot_is_a_png_with_one_bar_per_device_and_a_segment_per_layer(tmp_path, stages, capacity_gib):
    placement = hand_built_placement(stages, capacity_gib=capacity_gib)
    path = tmp_path / "plan.png"
    fig = plot_placement(placement, path, model="gpt2_xl", note="emulated devices")

    assert path.read_bytes()[:8] == PNG_SIGNATURE and path.stat().st_size > 10_000
    memory_ax, time_ax = fig.axes[:2]
    for ax, extra in ((memory_ax, 0), (time_ax, len(stages) - 1)):  # the time panel adds a sending segment
        bars = [patch for patch in ax.patches if patch.get_width() == pytest.approx(0.7)]
        assert len({round(bar.get_x() + bar.get_width() / 2, 6) for bar in bars}) == len(stages)
        assert len(bars) == len(placement.layers) + extra
        assert [t.get_text().split("\n")[1] for t in ax.get_xticklabels()] == [target.split(":", 1)[1]
                                                                                for _, target, _, _ in stages]
    # The busiest device's stack reaches the predicted step time.
    tops = [bar.get_y() + bar.get_height() for bar in time_ax.patches]
    assert max(tops) == pytest.approx(placement.predicted_step_seconds * 1e3)
    assert "balanced placement on" in fig.get_suptitle() and "emulated devices" in fig.get_suptitle()
    assert len(fig.axes) == 3  # the two panels and the layer-position colorbar


def test_the_text_shows_layers_devices_strategies_and_the_bound():
    placement = hand_built_placement(THREE_DEVICES)
    text = render_placement(placement, "transformer_encoder")
    lines = text.splitlines()

    assert lines[0] == "transformer_encoder: balanced placement over 3 device(s)"
    assert any(line.split()[:4] == ["5", "block_5", "127.0.0.1/cuda:2", V100] for line in lines)
    busiest = next(line for line in lines if line.rstrip().endswith("busiest"))
    assert busiest.startswith("127.0.0.1/cuda:0") and "3 (#0-2)" in busiest and "6.500" in busiest
    assert any(line.startswith("balanced (taken)") and "2.00" in line for line in lines)
    assert any(line.startswith("ranked") and "no device has room" in line for line in lines)
    assert "predicted step 6.500 ms per micro-batch of 8 rows" in text and "ratio 2.00" in text
    assert "explain:" not in text
    assert "  balanced: searched 12 step times" in render_placement(placement, "m", explain=True)


def test_devices_expand_to_canonical_catalog_types_in_order():
    assert parse_devices("2xa100-80gb,1xV100M32, 1xt4") == ("a100-80gb", "a100-80gb", "v100-32gb", "t4")


def test_the_request_declares_four_micro_batches_of_the_programs_inputs():
    program = program_pb.Program(name="transformer_encoder", inputs=[
        program_pb.TensorSpec(name="tokens", dtype=common_pb2.DATA_TYPE_INT32, shape=[-1, 32])])
    args = SimpleNamespace(model="transformer_encoder", strategy="balanced", kind="training", device_count=3,
                           micro_batch_rows=0, rows=0, headroom=None, filter="")
    (tokens,) = declared_inputs(program, 32)
    assert list(tokens.shape) == [32, 32] and tokens.total_bytes == 32 * 32 * 4

    spec = plan_request(args, [tokens], []).spec
    assert spec.placement.strategy == plan_pb.PLACEMENT_STRATEGY_BALANCED and spec.placement.device_count == 3
    assert not spec.placement.HasField("memory_headroom")  # unset: the service's default applies
    assert spec.kind == job_pb.JOB_KIND_TRAINING and spec.training.batch_size == 32
    args.headroom = 0.0
    assert plan_request(args, [tokens], []).spec.placement.HasField("memory_headroom")


def test_a_layer_table_file_reads_proto_and_json_names_and_names_a_bad_row(tmp_path):
    path = tmp_path / "layers.json"
    path.write_text(json.dumps([{"name": "embed", "order": 0, "parameter_count": 10, "parameter_bytes": 40},
                                {"name": "head", "order": 1, "sharedFrom": "embed", "sharedParameterBytes": 40},
                                {"name": "rotary", "order": 2, "bufferBytes": 256, "flops_per_sample": 0}]))
    embed, head, rotary = load_layer_table(str(path))
    assert embed.parameter_count == 10 and head.shared_parameter_bytes == 40 and head.shared_from == "embed"
    assert rotary.buffer_bytes == 256 and rotary.HasField("flops_per_sample") and not embed.HasField("flops_per_sample")
    path.write_text(json.dumps([{"name": "embed"}, {"name": "head", "weight": 3}]))
    with pytest.raises(errors.InvalidArgument, match=r"layer \[1\]"):
        load_layer_table(str(path))


def test_an_inconsistent_layer_table_is_refused_naming_the_row_before_any_mesh_starts(tmp_path, capsys):
    path = tmp_path / "layers.json"
    path.write_text(json.dumps([{"name": "embed", "order": 0, "parameter_count": 10, "parameter_bytes": 40},
                                {"name": "position_ids", "order": 1, "parameter_bytes": 2048}]))
    assert main(["plan", "my-model", "--layers", str(path)]) == 1
    err = capsys.readouterr().err
    assert f"accelmesh: INVALID_ARGUMENT: --layers {path}[1].parameter_count of layer 'position_ids' is 0" in err
    assert "buffer_bytes" in err and "starting an embedded mesh" not in err


@pytest.mark.parametrize("argv, code, words", [
    (["--devices", "2xa100"], 2, "known types: a100-40gb, a100-80gb"),
    (["--devices", "2xnot-a-gpu,1xt4"], 2, "'not-a-gpu' is not in the catalog"),
    (["--devices", "x3"], 2, "'x3' is not COUNTxTYPE"),
    (["--devices", "2xa100-80gb,"], 2, "'' is not COUNTxTYPE"),
    (["--devices", "0xt4"], 2, "at least 1"),
    (["--devices", "65xt4"], 2, "at most 64"),
    (["--headroom", "1"], 2, "outside [0, 1)"),
    (["--headroom", "-0.1"], 2, "outside [0, 1)"),
    (["--headroom", "lots"], 2, "not a number"),
    (["--micro-batch-rows", "-8"], 2, "below 0"),
    (["--strategy", "greedy"], 2, "invalid choice"),
    (["--dispatch", "127.0.0.1:1", "--devices", "1xt4"], 1, "narrow it with --filter"),
    (["--layers", "/nonexistent/layers.json", "--dispatch", "127.0.0.1:1"], 1, "--layers /nonexistent/layers.json"),
    (["--plot", "/nonexistent/plan.png"], 1, "the folder /nonexistent does not exist"),
])
def test_bad_arguments_exit_non_zero_naming_the_problem(capsys, argv, code, words):
    with pytest.raises(SystemExit) as exit_info:
        sys.exit(main(["plan", "transformer_encoder", *argv]))
    assert exit_info.value.code == code
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err


@pytest.mark.slow
def test_plan_through_the_embedded_mesh_prints_the_placement_and_draws_it(tmp_path):
    plot = tmp_path / "plan.png"
    result = subprocess.run(
        [sys.executable, "-m", "accelmesh.cli", "plan", "transformer_encoder", "--devices", "2xa100-80gb,1xv100-32gb",
         "--device-count", "3", "--strategy", "auto", "--plot", str(plot)],
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "starting an embedded mesh with 3 emulated device(s)" in result.stderr
    assert "emulated devices" in out.splitlines()[0]
    for layer in ("embed", "block_0", "block_3", "head"):
        assert any(line.split()[1:2] == [layer] for line in out.splitlines())
    for device in ("127.0.0.1/cuda:0", "127.0.0.1/cuda:1", "127.0.0.1/cuda:2"):
        assert device in out
    assert "a100-80gb" in out and "v100-32gb" in out
    assert "ranked" in out and "balanced" in out and "(taken)" in out  # auto compares both
    assert "predicted step" in out and "lower bound" in out and "ratio" in out
    assert plot.read_bytes()[:8] == PNG_SIGNATURE
