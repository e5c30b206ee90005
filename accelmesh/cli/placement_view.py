"""A placement as text: the layer table, the device table, the strategies compared, the summary."""

from __future__ import annotations

from accelmesh.cli.tables import table
from accelmesh.dispatch.v1 import plan_pb2 as plan_pb

MIB = 1024**2
GIB = 1024**3


def strategy_name(value: int) -> str:
    return plan_pb.PlacementStrategy.Name(value).removeprefix("PLACEMENT_STRATEGY_").lower()


def format_bytes(n: int) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / MIB:.1f} MiB"


def _ms(seconds: float) -> str:
    ms = seconds * 1e3
    return f"{ms:.3f}" if ms >= 0.1 or ms == 0 else f"{ms:.3g}"


def _share(used: int, capacity: int) -> str:
    if not capacity:
        return "?"
    return "<1%" if 0 < used < capacity / 100 else f"{used / capacity:.0%}"


def _orders(orders: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5'."""
    runs: list[list[int]] = []
    for o in sorted(orders):
        if runs and o == runs[-1][1] + 1:
            runs[-1][1] = o
        else:
            runs.append([o, o])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def format_layer_table(placement: plan_pb.Placement) -> str:
    rows = [("#", "LAYER", "DEVICE", "TARGET TYPE", "PARAMS", "MEMORY", "COMPUTE ms", "STAGE")]
    for layer in placement.layers:
        rows.append((str(layer.order), layer.layer, layer.device_id, layer.target_type, f"{layer.parameter_count:,}",
                     format_bytes(layer.memory_bytes), _ms(layer.compute_seconds), str(layer.stage)))
    return table(rows)


def format_device_table(placement: plan_pb.Placement) -> str:
    order_of = {layer.layer: layer.order for layer in placement.layers}
    totals = [d.compute_seconds + d.transfer_seconds for d in placement.devices]
    busiest = totals.index(max(totals)) if totals else -1
    rows = [("DEVICE", "TARGET TYPE", "MEMORY USED / USABLE", "USED", "COMPUTE ms", "SEND ms", "TOTAL ms", "LAYERS",
             "SCORE", "")]
    for i, (d, total) in enumerate(zip(placement.devices, totals)):
        orders = [order_of[name] for name in d.layers if name in order_of]
        rows.append((
            d.device_id, d.target_type, f"{format_bytes(d.memory_bytes)} / {format_bytes(d.memory_capacity_bytes)}",
            _share(d.memory_bytes, d.memory_capacity_bytes), _ms(d.compute_seconds), _ms(d.transfer_seconds),
            _ms(total), f"{len(d.layers)} (#{_orders(orders)})" if orders else str(len(d.layers)), f"{d.score:.3f}",
            "busiest" if i == busiest else "",
        ))
    return table(rows)


def format_candidates(placement: plan_pb.Placement) -> str:
    bound = placement.lower_bound_offered_step_seconds or placement.lower_bound_step_seconds
    rows = [("STRATEGY", "FEASIBLE", "STEP ms", "x LOWER BOUND", "TRANSFERS", "DEVICES", "")]
    for c in placement.candidates:
        taken = c.strategy == placement.strategy
        rows.append((strategy_name(c.strategy) + (" (taken)" if taken else ""), "yes" if c.feasible else "no",
                     _ms(c.predicted_step_seconds) if c.feasible else "-",
                     f"{c.predicted_step_seconds / bound:.2f}" if c.feasible and bound > 0 else "-",
                     str(c.cross_device_transfers) if c.feasible else "-", str(c.device_count) if c.feasible else "-",
                     c.error))
    return table(rows)


def _ratio(step: float, bound: float) -> str:
    return f"{step / bound:.2f}" if bound > 0 else "n/a"


def format_summary(placement: plan_pb.Placement) -> str:
    step, bound = placement.predicted_step_seconds, placement.lower_bound_step_seconds
    offered = placement.lower_bound_offered_step_seconds
    lines = [(f"predicted step {_ms(step)} ms per micro-batch of {placement.micro_batch_rows} rows "
              f"(the busiest device); lower bound over the devices offered {_ms(offered)} ms, ratio "
              f"{_ratio(step, offered)}; over the {placement.device_count} used {_ms(bound)} ms, ratio "
              f"{_ratio(step, bound)}"),
             (f"{placement.cross_device_transfers} cross-device transfer(s) per micro-batch "
              f"on {placement.device_count} device(s)")]
    for stage in placement.stages:
        if stage.replica_device_ids:
            lines.append(f"stage {stage.index} runs on {1 + len(stage.replica_device_ids)} devices taking "
                         f"micro-batches in turn: {', '.join([stage.device_id, *stage.replica_device_ids])}")
    if placement.micro_batches:
        lines.append(f"predicted {_ms(placement.predicted_seconds)} ms for {placement.micro_batches} micro-batch(es): "
                     f"one pass to fill the pipeline, then one step each")
    w = placement.weights
    lines.append(f"weights: compute {w.compute:.2f}  memory {w.memory:.2f}  bandwidth {w.bandwidth:.2f}"
                 + (f"  ({placement.weights_rule})" if placement.weights_rule else ""))
    return "\n".join(lines)


def render_placement(placement: plan_pb.Placement, model: str, *, explain: bool = False, note: str = "") -> str:
    """Everything `accelmesh plan` prints on stdout for one placement; `note` joins the heading."""
    parts = [(f"{model}: {strategy_name(placement.strategy)} placement over {placement.device_count} device(s)"
              f"{' (' + note + ')' if note else ''}\n"),
             format_layer_table(placement), "", format_device_table(placement)]
    if placement.candidates:
        parts += ["", "strategies compared:", format_candidates(placement)]
    parts += ["", format_summary(placement)]
    if explain:
        parts += ["", "explain:", *(f"  {line}" for line in placement.explain)]
    return "\n".join(parts)
