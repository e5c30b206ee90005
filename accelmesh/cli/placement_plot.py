"""A placement as a picture (matplotlib): per-device memory and predicted time, one bar per
device, a segment per layer coloured by its position, so imbalance shows at a glance."""

from __future__ import annotations

from pathlib import Path

from accelmesh.cli.placement_view import GIB, MIB, _ms, _share, format_bytes, strategy_name
from accelmesh.dispatch.v1 import plan_pb2 as plan_pb


def plot_placement(placement: plan_pb.Placement, path: str | Path, *, model: str, note: str = ""):
    """Save a two-panel PNG (memory, time per micro-batch; one bar per device) and return the figure.

    Segments are layers coloured by their position in the forward pass, so a model of 50 layers
    reads as a gradient with a colorbar rather than a 50-entry legend. `note` joins the title.
    One function: matplotlib's figure, axes and colour map are shared by both panels, and the
    drawing reads top to bottom as the picture is laid out.
    """
    import matplotlib
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import Normalize
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    devices = list(placement.devices)
    by_device: dict[str, list[plan_pb.LayerPlacement]] = {d.device_id: [] for d in devices}
    for layer in sorted(placement.layers, key=lambda lp: lp.order):
        by_device.setdefault(layer.device_id, []).append(layer)
    last = max((lp.order for lp in placement.layers), default=0)
    cmap, norm = matplotlib.colormaps["viridis"], Normalize(0, max(last, 1))
    x = list(range(len(devices)))
    one_node = len({d.device_id.split("/", 1)[0] for d in devices}) <= 1
    labels = [f"{d.device_id.split('/', 1)[-1] if one_node else d.device_id}\n{_short_type(d.target_type)}"
              for d in devices]

    fig = Figure(figsize=(max(9.0, 1.6 * len(devices) * 2), 5.5), layout="constrained")
    memory_ax, time_ax = fig.subplots(1, 2)

    def stack(ax, value_of, scale) -> list[float]:
        """Draw one stacked bar per device, a segment per layer; return each bar's height."""
        heights = []
        for i, d in enumerate(devices):
            bottom, stage = 0.0, None
            for layer in by_device[d.device_id]:
                height = value_of(layer) * scale
                ax.bar(i, height, bottom=bottom, width=0.7, color=cmap(norm(layer.order)), edgecolor="white",
                       linewidth=0.3)
                if stage is not None and layer.stage != stage:  # a new pipeline stage on the same device
                    ax.hlines(bottom, i - 0.35, i + 0.35, colors="black", linewidth=1.2)
                bottom, stage = bottom + height, layer.stage
            heights.append(bottom)
        return heights

    peak = max([d.memory_bytes for d in devices] + [layer.memory_bytes for layer in placement.layers], default=0)
    unit, unit_bytes = ("GiB", GIB) if peak >= GIB else ("MiB", MIB)
    tallest = max(stack(memory_ax, lambda lp: lp.memory_bytes, 1 / unit_bytes), default=0.0)
    capacities = [d.memory_capacity_bytes / unit_bytes for d in devices]
    # Capacity far above every bar would flatten the bars: then it is written at the top instead.
    top = max(capacities, default=0.0)
    if top > 4 * tallest:
        top = tallest * 1.3
    for i, (d, capacity) in enumerate(zip(devices, capacities)):
        shown = min(capacity, top)
        memory_ax.hlines(shown, i - 0.45, i + 0.45, colors="crimson", linestyles="-" if capacity <= top else ":",
                         linewidth=2)
        share = f"{_share(d.memory_bytes, d.memory_capacity_bytes)} of {format_bytes(d.memory_capacity_bytes)}"
        memory_ax.annotate(share, (i, shown), xytext=(0, 3), textcoords="offset points", ha="center", fontsize=8)
    memory_ax.set_ylim(0, (top or 1.0) * 1.12)
    memory_ax.set_title(f"memory per device ({unit})")
    handles = []
    if any(capacity <= top for capacity in capacities):
        handles.append(Line2D([], [], color="crimson", linewidth=2, label="usable capacity"))
    if any(capacity > top for capacity in capacities):
        handles.append(Line2D([], [], color="crimson", linestyle=":", linewidth=2,
                              label="capacity far above (written)"))
    _legend_below(memory_ax, handles)

    computes = stack(time_ax, lambda lp: lp.compute_seconds, 1e3)
    for i, (d, compute) in enumerate(zip(devices, computes)):
        if d.transfer_seconds > 0:
            time_ax.bar(i, d.transfer_seconds * 1e3, bottom=compute, width=0.7, color="lightgrey", hatch="//",
                        edgecolor="dimgrey", linewidth=0.3)
    time_ax.axhline(placement.predicted_step_seconds * 1e3, color="crimson", linewidth=1.5)
    time_ax.axhline(placement.lower_bound_step_seconds * 1e3, color="black", linestyle="--", linewidth=1)
    time_ax.set_title("predicted time per micro-batch (ms)")
    _legend_below(time_ax, [Patch(facecolor="lightgrey", hatch="//", edgecolor="dimgrey", label="sending activations"),
                            Line2D([], [], color="crimson", label="step time (busiest device)"),
                            Line2D([], [], color="black", linestyle="--", label="lower bound")])

    for ax in (memory_ax, time_ax):
        ax.set_xticks(x, labels, fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    fig.colorbar(ScalarMappable(norm=norm, cmap=cmap), ax=[memory_ax, time_ax],
                 label="layer position in the forward pass (black rule: new stage)")
    fig.suptitle(f"{model}: {strategy_name(placement.strategy)} placement on {len(devices)} device(s)"
                 f"{' (' + note + ')' if note else ''}\n"
                 f"predicted step {_ms(placement.predicted_step_seconds)} ms per micro-batch of "
                 f"{placement.micro_batch_rows} rows (lower bound {_ms(placement.lower_bound_step_seconds)} ms)")
    fig.savefig(path, format="png", dpi=120)
    return fig


def _short_type(target_type: str) -> str:
    """`cuda@cpu:a100-80gb[bf16]` -> `a100-80gb[bf16]`: a compile target key is too wide for an axis label."""
    platforms, _, rest = target_type.partition(":")
    return rest if "@" in platforms and rest else target_type


def _legend_below(ax, handles) -> None:
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=len(handles), fontsize=8,
              frameon=False)
