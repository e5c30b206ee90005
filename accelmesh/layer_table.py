"""The rows of a model's layer table as the planner reads them (requirements B3), and their check.

Here, not in the dispatcher, so that a client (`accelmesh plan --layers`) refuses a bad table
with the dispatcher's own words before it starts a mesh to ask.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from accelmesh.dispatch.v1 import plan_pb2 as plan_pb
from accelmesh.errors import InvalidArgument
from accelmesh.programs import layer_cost_fields, proto_fields

# Layers a table may have: placing 1,024 over 150 devices takes ~0.7 s (balanced) here.
MAX_LAYERS = 1024


@dataclass(frozen=True)
class LayerCost:
    """One row of a layer table (LayerInfo, or a client's explicit LayerCost)."""

    name: str
    order: int
    parameter_count: int
    parameter_bytes: int
    flops_per_sample: float | None = None  # None: unknown (FLOPS_PER_PARAMETER per parameter); 0 is no FLOPs
    bytes_accessed_per_sample: float = 0.0
    activation_bytes_per_sample: int = 0
    shared_from: str = ""
    shared_parameter_bytes: int = 0
    buffer_bytes: int = 0  # state that is not trained (position ids, rotary tables): held once, no gradients



def check_layers(layers: Sequence[LayerCost], where: str = "spec.placement.layers") -> None:
    """A layer table must be complete and consistent; every problem names its row and field."""
    if not layers:
        raise InvalidArgument(f"{where} is empty; a model needs at least one layer")
    if len(layers) > MAX_LAYERS:
        raise InvalidArgument(f"{where} has {len(layers)} rows; at most {MAX_LAYERS} can be placed (the balanced "
                              "search grows with their square): describe the model by blocks, not by operation")
    seen: dict[str, int] = {}
    orders = sorted(layer.order for layer in layers)
    if orders != list(range(len(layers))):
        raise InvalidArgument(f"{where}[].order must number the {len(layers)} layers 0..{len(layers) - 1} once each, "
                              f"got {orders}")
    by_name = {layer.name: layer for layer in layers}
    for i, layer in enumerate(layers):
        row = f"{where}[{i}]"
        if not layer.name:
            raise InvalidArgument(f"{row}.name is empty; every layer needs a unique name")
        if layer.name in seen:
            raise InvalidArgument(f"{row}.name {layer.name!r} is also {where}[{seen[layer.name]}].name; "
                                  "layer names must be unique")
        seen[layer.name] = i
        for name in ("parameter_count", "parameter_bytes", "flops_per_sample", "bytes_accessed_per_sample",
                     "activation_bytes_per_sample", "shared_parameter_bytes", "buffer_bytes"):
            value = getattr(layer, name)
            if value is None and name == "flops_per_sample":  # unknown: estimated from the parameters
                continue
            if not math.isfinite(value) or value < 0:
                raise InvalidArgument(f"{row}.{name} of layer {layer.name!r} must be a finite number >= 0, got {value}")
        if layer.parameter_count and not (
                layer.parameter_count / 8 <= layer.parameter_bytes <= layer.parameter_count * 8):
            raise InvalidArgument(
                f"{row}.parameter_bytes of layer {layer.name!r} is {layer.parameter_bytes} for "
                f"{layer.parameter_count} parameters ({layer.parameter_bytes / layer.parameter_count:.3g} bytes each); "
                "give the bytes at the stored dtype, between 1/8 and 8 bytes per parameter (4 for float32)")
        if layer.parameter_bytes and not layer.parameter_count:
            raise InvalidArgument(f"{row}.parameter_count of layer {layer.name!r} is 0 but parameter_bytes is "
                                  f"{layer.parameter_bytes}; give the count too, or, for state that is not trained "
                                  "(position ids, rotary tables, running statistics), put its bytes in buffer_bytes")
        if layer.shared_from:
            owner = by_name.get(layer.shared_from)
            if owner is None or owner.order >= layer.order:
                raise InvalidArgument(f"{row}.shared_from {layer.shared_from!r} of layer {layer.name!r} must name an "
                                      "earlier layer of the table")
        elif layer.shared_parameter_bytes:
            raise InvalidArgument(f"{row}.shared_parameter_bytes of layer {layer.name!r} is set but shared_from is "
                                  "empty; name the layer whose parameters it shares")


def layer_cost_from_proto(msg: plan_pb.LayerCost) -> LayerCost:
    """A client's layer row; FLOPs left unset are unknown (None), not 0."""
    return LayerCost(**layer_cost_fields(msg))


def layer_cost_to_proto(layer: LayerCost) -> plan_pb.LayerCost:
    return plan_pb.LayerCost(**proto_fields(layer_cost_fields(layer)))
