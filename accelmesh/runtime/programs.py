"""Proto <-> domain translations of the program contract, written once for every service.

Programs, tensor specs, layer rows, build options and artifact formats cross three boundaries
(compile service -> dispatch, dispatch -> workers, compile service -> clients); each side uses
these, so an enum value or a field added is translated in one place.
"""

from __future__ import annotations

from accelmesh import errors
from accelmesh.compile.v1 import build_pb2 as build_pb
from accelmesh.compile.v1 import program_pb2 as program_pb
from accelmesh.programs import BuildOptions, LayerInfo, OutputSpec, Program, TensorSpec, layer_cost_fields, proto_fields
from accelmesh.runtime.tensors import dtype_code_for_name, dtype_name

BATCH = -1  # how a symbolic batch dimension travels in TensorSpec.shape
COMBINE_TO_PROTO = {"concat": program_pb.COMBINE_RULE_CONCAT, "sum": program_pb.COMBINE_RULE_SUM,
                    "mean": program_pb.COMBINE_RULE_MEAN}
COMBINE_FROM_PROTO = {v: k for k, v in COMBINE_TO_PROTO.items()}
KIND_TO_PROTO = {"function": program_pb.PROGRAM_KIND_FUNCTION, "model": program_pb.PROGRAM_KIND_MODEL,
                 "training_step": program_pb.PROGRAM_KIND_TRAINING_STEP, "uploaded": program_pb.PROGRAM_KIND_UPLOADED}
KIND_FROM_PROTO = {v: k for k, v in KIND_TO_PROTO.items()}
FORMAT_TO_PROTO = {"stablehlo": build_pb.ARTIFACT_FORMAT_STABLEHLO, "executable": build_pb.ARTIFACT_FORMAT_EXECUTABLE}
FORMAT_FROM_PROTO = {v: k for k, v in FORMAT_TO_PROTO.items()}


def tensor_spec_to_proto(spec: TensorSpec) -> program_pb.TensorSpec:
    return program_pb.TensorSpec(
        name=spec.name, dtype=dtype_code_for_name(spec.dtype), shape=[BATCH if d is None else d for d in spec.shape]
    )


def tensor_spec_from_proto(msg: program_pb.TensorSpec, field: str) -> TensorSpec:
    if any(d < BATCH for d in msg.shape):
        raise errors.InvalidArgument(f"{field}.shape {errors.quoted(list(msg.shape))}: "
                                     "dimensions are >= 0, or -1 for the batch")
    return TensorSpec(msg.name, dtype_name(msg.dtype, f"{field}.dtype"),
                      tuple(None if d == BATCH else d for d in msg.shape))


def layer_to_proto(layer: LayerInfo) -> program_pb.Layer:
    return program_pb.Layer(
        kind=layer.kind,
        parameters=[tensor_spec_to_proto(TensorSpec(n, "float32", tuple(s)))
                    for n, s in layer.parameter_shapes.items()],
        **proto_fields(layer_cost_fields(layer)),
    )


def layer_from_proto(msg: program_pb.Layer) -> LayerInfo:
    return LayerInfo(kind=msg.kind, parameter_shapes={p.name: tuple(p.shape) for p in msg.parameters},
                     **layer_cost_fields(msg))


def program_to_proto(program: Program, with_layers: bool = True) -> program_pb.Program:
    count = 0
    for spec in program.parameters:
        size = 1
        for d in spec.shape:
            size *= d
        count += size
    return program_pb.Program(
        name=program.name,
        version=program.version,
        kind=KIND_TO_PROTO[program.kind],
        description=program.description,
        parameters=[tensor_spec_to_proto(p) for p in program.parameters],
        inputs=[tensor_spec_to_proto(i) for i in program.inputs],
        outputs=[program_pb.OutputSpec(tensor=tensor_spec_to_proto(o), combine=COMBINE_TO_PROTO[o.combine])
                 for o in program.outputs],
        digest=program.digest,
        layers=[layer_to_proto(layer) for layer in program.layers] if with_layers else [],
        parameter_count=count,
    )


def program_from_proto(msg: program_pb.Program) -> Program:
    """A program as the compile service describes it (no function: that stays with the service)."""
    return Program(
        name=msg.name,
        version=msg.version,
        kind=KIND_FROM_PROTO.get(msg.kind, "function"),
        description=msg.description,
        parameters=tuple(tensor_spec_from_proto(p, "program.parameters") for p in msg.parameters),
        inputs=tuple(tensor_spec_from_proto(i, "program.inputs") for i in msg.inputs),
        outputs=tuple(OutputSpec(*_spec_fields(tensor_spec_from_proto(o.tensor, "program.outputs")),
                                 COMBINE_FROM_PROTO[o.combine]) for o in msg.outputs),
        digest=msg.digest,
        layers=tuple(layer_from_proto(layer) for layer in msg.layers),
    )


def _spec_fields(spec: TensorSpec) -> tuple:
    return spec.name, spec.dtype, spec.shape


def build_options_to_proto(build: BuildOptions) -> build_pb.BuildOptions:
    return build_pb.BuildOptions(compute_dtype=build.compute_dtype, matmul_precision=build.matmul_precision,
                                 remat=build.remat, xla_options={k: str(v) for k, v in build.xla_options.items()},
                                 tolerance=build.tolerance)


def build_options_from_proto(msg: build_pb.BuildOptions) -> BuildOptions:
    """Unset fields take BuildOptions' defaults; XLA options stay strings (artifacts.py types them)."""
    default = BuildOptions()
    return BuildOptions(compute_dtype=msg.compute_dtype or default.compute_dtype,
                        matmul_precision=msg.matmul_precision or default.matmul_precision, remat=msg.remat,
                        xla_options=dict(msg.xla_options), tolerance=msg.tolerance or default.tolerance)
