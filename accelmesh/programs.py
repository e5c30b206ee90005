"""Plain-Python shapes shared by the compile service's registry, rules, lowering and cache.

Calling convention of every program (and so of every artifact): positional arguments are the
flattened parameter leaves in `Program.parameters` order, then the data inputs in
`Program.inputs` order; the result is a tuple in `Program.outputs` order. Weights are arguments,
never closed-over constants, so artifacts stay small and one artifact serves any weights.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from accelmesh.errors import InvalidArgument

DTYPES = ("float32", "float16", "bfloat16", "float64", "int8", "int16", "int32", "int64", "uint8", "uint32", "bool")
COMBINE_RULES = ("concat", "sum", "mean")  # concat on the batch axis; sum; mean weighted by shard size
PROGRAM_KINDS = ("function", "model", "training_step", "uploaded")
COMPUTE_DTYPES = ("fp32", "bf16", "fp16")
MATMUL_PRECISIONS = ("default", "high", "highest")
FORMATS = ("stablehlo", "executable")  # portable jax.export bytes; serialized compiled executable


@dataclass(frozen=True)
class TensorSpec:
    """A named array. In `shape`, None marks the symbolic batch dimension (axis 0 of data inputs)."""

    name: str
    dtype: str  # one of DTYPES
    shape: tuple[int | None, ...]

    @property
    def batched(self) -> bool:
        return bool(self.shape) and self.shape[0] is None


@dataclass(frozen=True)
class OutputSpec(TensorSpec):
    combine: str = "concat"  # one of COMBINE_RULES


@dataclass(frozen=True)
class LayerInfo:
    """One top-level entry of a model's params pytree (requirements B3)."""

    name: str
    kind: str  # e.g. "embedding", "transformer_block", "dense"
    order: int
    parameter_shapes: Mapping[str, tuple[int, ...]]  # leaf path within the layer -> shape
    parameter_count: int
    parameter_bytes: int
    flops_per_sample: float | None  # XLA cost analysis of the layer at batch 1; None where XLA gave none
    bytes_accessed_per_sample: float
    activation_bytes_per_sample: int  # size of the layer's output for one sample
    # Tied weights: an earlier layer whose parameters this one also reads (counted in the
    # owner's parameter_count/bytes), and their bytes, needed again where the owner is not.
    shared_from: str = ""
    shared_parameter_bytes: int = 0
    buffer_bytes: int = 0  # state that is not trained (none in a JAX params pytree)


# The cost columns of a layer row, whatever carries it (LayerInfo, the planner's LayerCost, the
# compile and dispatch protos' rows): one list, so every translation copies every column.
LAYER_COST_FIELDS = ("name", "order", "parameter_count", "parameter_bytes", "flops_per_sample",
                     "bytes_accessed_per_sample", "activation_bytes_per_sample", "shared_from",
                     "shared_parameter_bytes", "buffer_bytes")


def layer_cost_fields(row: Any) -> dict[str, Any]:
    """`row`'s cost columns by name, to build another kind of layer row from. FLOPs are unknown
    (None) where a message row leaves its optional field unset, never 0 (0 is a layer without
    arithmetic); build a message from ``proto_fields`` of them."""
    fields = {name: getattr(row, name) for name in LAYER_COST_FIELDS}
    has_field = getattr(row, "HasField", None)
    if has_field is not None and not has_field("flops_per_sample"):
        fields["flops_per_sample"] = None
    return fields


def proto_fields(fields: dict[str, Any]) -> dict[str, Any]:
    """``layer_cost_fields`` as a message's keyword arguments: an unknown value stays unset."""
    return {name: value for name, value in fields.items() if value is not None}


@dataclass(frozen=True)
class Program:
    """A registered program: what it computes and how its results combine across shards."""

    name: str
    version: str
    kind: str  # one of PROGRAM_KINDS
    description: str
    parameters: tuple[TensorSpec, ...]  # flattened parameter leaves, unbatched
    inputs: tuple[TensorSpec, ...]  # data inputs, batched on axis 0
    outputs: tuple[OutputSpec, ...]
    digest: str  # content digest: changes whenever what the program computes changes
    # fn(*parameter_leaves, *inputs) -> tuple of outputs, traceable by JAX; None for uploaded programs.
    fn: Callable[..., tuple] | None = None
    # Deterministic initial parameter values (leaves in `parameters` order); None if the program has none.
    init_params: Callable[[int], list[Any]] | None = None
    layers: tuple[LayerInfo, ...] = ()
    exported: bytes | None = None  # uploaded programs: the client's serialized jax.export
    metadata: Mapping[str, str] = field(default_factory=dict)

    @property
    def ref(self) -> str:
        return f"{self.name}@{self.version}"


@dataclass(frozen=True)
class BuildOptions:
    """What a compile rule decides for a target (requirements A4)."""

    compute_dtype: str = "fp32"  # one of COMPUTE_DTYPES: dtype the math runs in; interfaces stay as declared
    matmul_precision: str = "default"  # one of MATMUL_PRECISIONS
    remat: bool = False  # rematerialise activations in the backward pass (jax.checkpoint)
    xla_options: Mapping[str, str | int | float | bool] = field(default_factory=dict)  # per-compilation
    tolerance: float = 1e-5  # max relative error against an fp32 reference a build of this rule may show


@dataclass(frozen=True)
class TargetType:
    """Devices that can share one artifact: same platforms, device type and rule-relevant capabilities.

    The catalog type ("a100-80gb"), not the vendor's kind string, names the hardware: kinds of
    emulated devices carry the CPU device they run on, and NVML names vary by driver. Memory is
    not part of the key: one type has one memory size, so memory rules see the same figure.
    """

    platform: str  # what the device is (cuda for an emulated A100)
    execution_platform: str  # the XLA backend that runs the code (cpu for an emulated A100)
    device_type: str  # catalog type, e.g. "a100-80gb"
    capabilities: frozenset[str]  # only the flags some rule reads

    @property
    def key(self) -> str:
        """`platform[@execution platform]:device type[flag,flag]`, what travels as target_type."""
        caps = ",".join(sorted(self.capabilities))
        on = "" if self.execution_platform == self.platform else f"@{self.execution_platform}"
        return f"{self.platform}{on}:{self.device_type}[{caps}]"

    @classmethod
    def parse(cls, key: str, field: str = "target_type") -> TargetType:
        """The inverse of `key`; InvalidArgument naming `field` for anything else."""
        match = _TARGET_TYPE_KEY.fullmatch(key)
        if match is None:
            raise InvalidArgument(f"{field} {key!r} is not of the form 'platform[@execution platform]:type[flags]'; "
                                  "pass the one Compile returned")
        return cls(match["platform"], match["execution"] or match["platform"], match["type"],
                   frozenset(f for f in match["flags"].split(",") if f))


_TARGET_TYPE_KEY = re.compile(
    r"(?P<platform>[^@:\[\]]+)(?:@(?P<execution>[^@:\[\]]+))?:(?P<type>[^\[\]]+)\[(?P<flags>[^\[\]]*)\]")
