"""Proto <-> domain translations of the compile service's own types (rules, builds); programs and
build options are shared ones (accelmesh.runtime.programs)."""

from __future__ import annotations

from accelmesh import errors
from accelmesh.common.v1 import common_pb2
from accelmesh.compile.v1 import build_pb2 as build_pb
from accelmesh.compile.v1 import compile_service_pb2 as pb
from accelmesh.runtime.devices import PLATFORM_TO_PROTO
from accelmesh.runtime.programs import FORMAT_TO_PROTO, build_options_to_proto
from compile_svc.compiler import BuiltArtifact, TargetBuild
from compile_svc.programs.stages import LayerRange
from compile_svc.rules import Explanation, Rule

PRECISION_FROM_PROTO = {common_pb2.PRECISION_UNSPECIFIED: "", common_pb2.PRECISION_FP32: "fp32",
                        common_pb2.PRECISION_BF16_ALLOWED: "bf16", common_pb2.PRECISION_FP16_ALLOWED: "fp16"}


def precision_from_proto(value: int) -> str:
    """The request's precision as rules.PRECISIONS names it; proto3 passes unknown numbers through."""
    if value not in PRECISION_FROM_PROTO:
        raise errors.InvalidArgument(f"precision {value} is not a Precision; use PRECISION_FP32, "
                                     "PRECISION_BF16_ALLOWED, PRECISION_FP16_ALLOWED or leave it unset",
                                     field="precision")
    return PRECISION_FROM_PROTO[value]


def layer_range_from_proto(msg: pb.LayerRange) -> LayerRange:
    return LayerRange(first=msg.first, count=msg.count, backward=msg.backward)


def rule_to_proto(rule: Rule) -> build_pb.Rule:
    build = rule.build
    return build_pb.Rule(
        name=rule.name,
        description=rule.description,
        match=build_pb.RuleMatch(
            platform=PLATFORM_TO_PROTO[rule.platform] if rule.platform else 0,
            requires=sorted(rule.requires),
            forbids=sorted(rule.forbids),
            min_memory_bytes=rule.min_memory_bytes or 0,
            max_memory_bytes=rule.max_memory_bytes or 0,
            kind_pattern=rule.kind_pattern or "",
        ),
        build=build_options_to_proto(build),
        line=rule.line,
    )


def explanation_to_proto(explanation: Explanation) -> pb.ExplainRuleResponse:
    return pb.ExplainRuleResponse(
        rule=rule_to_proto(explanation.rule),
        verdicts=[build_pb.RuleVerdict(rule=v.rule, matched=v.matched, reason=v.reason) for v in explanation.verdicts],
        target_type=explanation.target_type.key,
    )


def artifact_to_proto(a: BuiltArtifact) -> build_pb.Artifact:
    return build_pb.Artifact(
        key=a.key,
        format=FORMAT_TO_PROTO[a.format],
        batch_size=a.batch_size,
        size_bytes=a.size_bytes,
        digest=a.digest,
        platform=a.platform,
        cache_hit=a.cache_hit,
        build_seconds=a.build_seconds,
    )


def build_to_proto(build: TargetBuild) -> build_pb.TargetBuild:
    return build_pb.TargetBuild(
        target_type=build.target_type.key,
        rule=rule_to_proto(build.rule),
        device_ids=list(build.device_ids),
        portable=artifact_to_proto(build.portable),
        executables=[artifact_to_proto(e) for e in build.executables],
    )
