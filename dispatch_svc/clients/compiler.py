"""The `Compiler` port over gRPC (ports.py): programs, the rule a device gets, builds per target
type and a model's stages, initial parameters, protos <-> domain."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from accelmesh import errors
from accelmesh.common.v1 import common_pb2
from accelmesh.compile.v1 import build_pb2 as build_pb
from accelmesh.compile.v1 import compile_service_pb2 as compile_pb
from accelmesh.compile.v1 import compile_service_pb2_grpc
from accelmesh.programs import BuildOptions, Program
from accelmesh.runtime.channels import ChannelPool
from accelmesh.runtime.devices import device_to_proto
from accelmesh.runtime.programs import FORMAT_FROM_PROTO, program_from_proto
from accelmesh.runtime.tensors import TensorCollector
from accelmesh.security.config import Security
from accelmesh.security.identity import Role
from dispatch_svc.clients.calls import CALL_TIMEOUT_S, asked, call
from dispatch_svc.dataplane.descriptors import ArtifactRef, Build, JobDevice
from dispatch_svc.ports import RuleChoice

# A job's precision (records.PRECISIONS) as the compile service's Precision.
PRECISION_TO_PROTO = {"": common_pb2.PRECISION_UNSPECIFIED, "fp32": common_pb2.PRECISION_FP32,
                      "bf16": common_pb2.PRECISION_BF16_ALLOWED, "fp16": common_pb2.PRECISION_FP16_ALLOWED}


def _artifact(msg: build_pb.Artifact) -> ArtifactRef:
    return ArtifactRef(msg.key, msg.digest, FORMAT_FROM_PROTO[msg.format], msg.batch_size)


def _builds(response: compile_pb.CompileResponse) -> list[Build]:
    return [Build(b.target_type, b.rule.name, b.rule.build.compute_dtype, b.rule, tuple(b.device_ids),
                  _artifact(b.portable), {e.batch_size: _artifact(e) for e in b.executables},
                  b.rule.build.tolerance or BuildOptions.tolerance)
            for b in response.builds]


class GrpcCompiler:
    def __init__(self, address: str, security: Security, *, tracer_provider=None, max_message_bytes: int):
        self.address = address
        self._channels = ChannelPool(security, Role.COMPILE, tracer_provider=tracer_provider,
                                     max_message_bytes=max_message_bytes)

    @property
    def stub(self) -> compile_service_pb2_grpc.CompileServiceStub:
        return compile_service_pb2_grpc.CompileServiceStub(self._channels.get(self.address))

    def close(self) -> None:
        self._channels.close()

    def explain_rule(self, device: JobDevice, precision: str = "") -> RuleChoice:
        response = call("compile service rules", self.stub.ExplainRule, compile_pb.ExplainRuleRequest(
            device=device_to_proto(device.spec), precision=PRECISION_TO_PROTO[precision]), replicated=True)
        return RuleChoice(response.target_type, response.rule.name, response.rule.build.compute_dtype)

    def describe_program(self, name: str, version: str) -> Program:
        if not name:
            raise errors.InvalidArgument("spec.program is required; ListPrograms on the compile service shows them")
        response = call("compile service", self.stub.DescribeProgram,
                              compile_pb.DescribeProgramRequest(name=name, version=version), replicated=True)
        return program_from_proto(response.program)

    def compile(self, program: Program, devices: Sequence[JobDevice], batch_sizes: Sequence[int],
                precision: str = "") -> list[Build]:
        return _builds(self._compile(program, devices, batch_sizes, precision))

    def compile_stage(self, program: Program, devices: Sequence[JobDevice], first: int, count: int,
                      batch_sizes: Sequence[int] = (), backward: bool = False,
                      precision: str = "") -> tuple[Program, list[Build]]:
        """Build layers first .. first + count - 1 of a layered model as one pipeline stage (its
        backward pass with `backward`); the stage program says what its artifacts take (its
        parameter leaves, then the activation, and for the backward pass the cotangent)."""
        response = self._compile(program, devices, batch_sizes, precision,
                                 compile_pb.LayerRange(first=first, count=count, backward=backward))
        if not response.HasField("stage"):
            raise errors.FailedPrecondition(f"the compile service at {self.address} built {program.ref} whole, "
                                            "not the stage asked for; upgrade it to one that supports layers")
        return program_from_proto(response.stage), _builds(response)

    def _compile(self, program: Program, devices: Sequence[JobDevice], batch_sizes: Sequence[int], precision: str,
                 layers: compile_pb.LayerRange | None = None) -> compile_pb.CompileResponse:
        return call("compile service", self.stub.Compile, compile_pb.CompileRequest(
            program=program.name, version=program.version, batch_sizes=list(batch_sizes),
            targets=[device_to_proto(d.spec) for d in devices], layers=layers,
            precision=PRECISION_TO_PROTO[precision]), replicated=True)

    def fetch_parameters(self, program: Program, seed: int) -> list[np.ndarray]:
        """The program's initial parameter leaves. Fetched whole again when a replica goes away
        mid-stream (`asked`), into a fresh collector, so nothing of the cut-off stream is kept:
        they are a pure function of program, version and seed, whichever replica answers."""
        request = compile_pb.FetchParametersRequest(program=program.name, version=program.version, seed=seed)

        def fetch() -> dict[str, np.ndarray]:
            return TensorCollector("parameter").collect(self.stub.FetchParameters(request, timeout=CALL_TIMEOUT_S))
        return list(asked("compile service parameters", fetch).values())
