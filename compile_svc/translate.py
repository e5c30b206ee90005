"""Proto <-> domain translations of the compile service (programs, rules, builds)."""

from __future__ import annotations

from accelmesh import errors
from accelmesh.compile.v1 import compile_service_pb2 as pb
from accelmesh.runtime.devices import PLATFORM_TO_PROTO
from accelmesh.runtime.tensors import dtype_code_for_name, dtype_name
from compile_svc.compiler import EXECUTABLE, BuiltArtifact, TargetBuild
from accelmesh.programs import LayerInfo, Program, TensorSpec
from compile_svc.programs.stages import LayerRange
from compile_svc.rules import Explanation, Rule

BATCH = -1  # how a symbolic batch dimension travels in TensorSpec.shape
COMBINE_TO_PROTO = {"concat": pb.COMBINE_RULE_CONCAT, "sum": pb.COMBINE_RULE_SUM, "mean": pb.COMBINE_RULE_MEAN}
COMBINE_FROM_PROTO = {v: k for k, v in COMBINE_TO_PROTO.items()}
KIND_TO_PROTO = {
    "function": pb.PROGRAM_KIND_FUNCTION,
    "model": pb.PROGRAM_KIND_MODEL,
    "training_step": pb.PROGRAM_KIND_TRAINING_STEP,
    "uploaded": pb.PROGRAM_KIND_UPLOADED,
}


def tensor_spec_to_proto(spec: TensorSpec) -> pb.TensorSpec:
    return pb.TensorSpec(
        name=spec.name, dtype=dtype_code_for_name(spec.dtype), shape=[BATCH if d is None else d for d in spec.shape]
    )


def tensor_spec_from_proto(msg: pb.TensorSpec, field: str) -> TensorSpec:
    if any(d < BATCH for d in msg.shape):
        raise errors.InvalidArgument(f"{field}.shape {list(msg.shape)}: dimensions are >= 0, or -1 for the batch")
    return TensorSpec(msg.name, dtype_name(msg.dtype, f"{field}.dtype"), tuple(None if d == BATCH else d for d in msg.shape))


def layer_range_from_proto(msg: pb.LayerRange) -> LayerRange:
    return LayerRange(first=msg.first, count=msg.count)


def layer_to_proto(layer: LayerInfo) -> pb.Layer:
    return pb.Layer(
        name=layer.name,
        kind=layer.kind,
        order=layer.order,
        parameters=[tensor_spec_to_proto(TensorSpec(n, "float32", tuple(s))) for n, s in layer.parameter_shapes.items()],
        parameter_count=layer.parameter_count,
        parameter_bytes=layer.parameter_bytes,
        flops_per_sample=layer.flops_per_sample,
        bytes_accessed_per_sample=layer.bytes_accessed_per_sample,
        activation_bytes_per_sample=layer.activation_bytes_per_sample,
        shared_from=layer.shared_from,
        shared_parameter_bytes=layer.shared_parameter_bytes,
    )


def program_to_proto(program: Program, with_layers: bool = True) -> pb.Program:
    count = 0
    for spec in program.parameters:
        size = 1
        for d in spec.shape:
            size *= d
        count += size
    return pb.Program(
        name=program.name,
        version=program.version,
        kind=KIND_TO_PROTO[program.kind],
        description=program.description,
        parameters=[tensor_spec_to_proto(p) for p in program.parameters],
        inputs=[tensor_spec_to_proto(i) for i in program.inputs],
        outputs=[pb.OutputSpec(tensor=tensor_spec_to_proto(o), combine=COMBINE_TO_PROTO[o.combine]) for o in program.outputs],
        digest=program.digest,
        layers=[layer_to_proto(layer) for layer in program.layers] if with_layers else [],
        parameter_count=count,
    )


def rule_to_proto(rule: Rule) -> pb.Rule:
    build = rule.build
    return pb.Rule(
        name=rule.name,
        description=rule.description,
        match=pb.RuleMatch(
            platform=PLATFORM_TO_PROTO[rule.platform] if rule.platform else 0,
            requires=sorted(rule.requires),
            forbids=sorted(rule.forbids),
            min_memory_bytes=rule.min_memory_bytes or 0,
            max_memory_bytes=rule.max_memory_bytes or 0,
            kind_pattern=rule.kind_pattern or "",
        ),
        build=pb.BuildOptions(
            compute_dtype=build.compute_dtype,
            matmul_precision=build.matmul_precision,
            remat=build.remat,
            xla_options={k: str(v) for k, v in build.xla_options.items()},
            tolerance=build.tolerance,
        ),
        line=rule.line,
    )


def explanation_to_proto(explanation: Explanation) -> pb.ExplainRuleResponse:
    return pb.ExplainRuleResponse(
        rule=rule_to_proto(explanation.rule),
        verdicts=[pb.RuleVerdict(rule=v.rule, matched=v.matched, reason=v.reason) for v in explanation.verdicts],
        target_type=explanation.target_type.key,
    )


def artifact_to_proto(a: BuiltArtifact) -> pb.Artifact:
    return pb.Artifact(
        key=a.key,
        format=pb.ARTIFACT_FORMAT_EXECUTABLE if a.format == EXECUTABLE else pb.ARTIFACT_FORMAT_STABLEHLO,
        batch_size=a.batch_size,
        size_bytes=a.size_bytes,
        digest=a.digest,
        platform=a.platform,
        cache_hit=a.cache_hit,
        build_seconds=a.build_seconds,
    )


def build_to_proto(build: TargetBuild) -> pb.TargetBuild:
    return pb.TargetBuild(
        target_type=build.target_type.key,
        rule=rule_to_proto(build.rule),
        device_ids=list(build.device_ids),
        portable=artifact_to_proto(build.portable),
        executables=[artifact_to_proto(e) for e in build.executables],
    )
