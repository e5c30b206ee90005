"""A program's single-device fp32 answer on this machine, asked of the compile service.

What a client compares a mesh job against (requirements A7): the compile service builds the program
for a plain CPU that has no flag any rule reads, so the catch-all fp32 rule (highest matmul
precision) applies whatever this machine's CPU can do; the portable artifact and the program's
initial parameters come over gRPC, are checked against the digest Compile announced, and run here.
Nothing of the compile service's own code is imported.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

from accelmesh import errors
from accelmesh.artifacts import load_portable, run_portable
from accelmesh.compile.v1 import compile_service_pb2 as pb
from accelmesh.compile.v1 import compile_service_pb2_grpc
from accelmesh.hardware.model import DeviceSpec
from accelmesh.programs import BuildOptions
from accelmesh.runtime.channels import open_channel
from accelmesh.runtime.devices import device_to_proto
from accelmesh.runtime.tensors import TensorCollector
from accelmesh.security.config import Security

CALL_TIMEOUT_S = 120.0
# A CPU with no capability flags: no CPU rule's `requires` holds, so the catch-all fp32 rule does.
PLAIN_CPU = DeviceSpec(id="127.0.0.1/cpu:0", node_ip="127.0.0.1", local_index=0, platform="cpu",
                       kind="plain CPU (reference)", type="cpu", execution_device="cpu:0")


def reference_outputs(compile_address: str, program: str, inputs: Sequence[np.ndarray], *,
                      parameter_seed: int = 0, security: Security | None = None,
                      chunk_rows: int | None = None) -> list[np.ndarray]:
    """`program`'s outputs for `inputs` (data inputs in the program's order), with the initial
    parameters of `parameter_seed`, computed in fp32 on this machine. `chunk_rows`: run that many
    rows at a time and join the outputs row-wise, so the memory the run takes is a chunk's (for a
    program whose every output is per row, as an inference model's is)."""
    with open_channel(compile_address, security=security) as channel:
        stub = compile_service_pb2_grpc.CompileServiceStub(channel)
        response = stub.Compile(pb.CompileRequest(program=program, targets=[device_to_proto(PLAIN_CPU)]),
                                timeout=CALL_TIMEOUT_S)
        (build,) = response.builds
        if build.rule.build.compute_dtype != "fp32":
            raise errors.FailedPrecondition(f"the compile rules give a flagless CPU the {build.rule.name} rule "
                                            f"({build.rule.build.compute_dtype}); a reference needs an fp32 one")
        data = b"".join(part.chunk for part in stub.FetchArtifact(
            pb.FetchArtifactRequest(key=build.portable.key), timeout=CALL_TIMEOUT_S))
        if hashlib.sha256(data).hexdigest() != build.portable.digest:
            raise errors.Unavailable(f"artifact {build.portable.key} does not hash to the digest Compile announced")
        parameters = TensorCollector("parameter").collect(stub.FetchParameters(pb.FetchParametersRequest(
            program=response.program, version=response.version, seed=parameter_seed), timeout=CALL_TIMEOUT_S))
    artifact, values = load_portable(data), list(parameters.values())
    rows = len(inputs[0]) if inputs else 0
    step = chunk_rows or rows or 1
    parts = [[np.asarray(o) for o in run_portable(artifact, BuildOptions(), *values,
                                                 *(x[start:start + step] for x in inputs))]
             for start in range(0, max(rows, 1), step)]
    return parts[0] if len(parts) == 1 else [np.concatenate(column) for column in zip(*parts)]
