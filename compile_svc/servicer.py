"""CompileService adapter: protos in, Compiler / registry / uploads calls, protos out."""

from __future__ import annotations

from accelmesh import errors
from accelmesh.compile.v1 import compile_service_pb2 as pb
from accelmesh.compile.v1 import compile_service_pb2_grpc
from accelmesh.runtime import programs as programs_pb
from accelmesh.runtime.devices import device_from_proto
from accelmesh.runtime.tensors import DEFAULT_CHUNK_BYTES, split_frames
from compile_svc import translate as tr
from compile_svc.compiler import Compiler
from compile_svc.config import CompileConfig
from compile_svc.programs.params_io import check_initialisable
from compile_svc.programs.registry import check_reference
from compile_svc.programs.uploaded import MAX_UPLOAD_TENSORS
from compile_svc.uploads import UploadStore


class CompileServicer(compile_service_pb2_grpc.CompileServiceServicer):
    def __init__(self, compiler: Compiler, uploads: UploadStore, max_message_bytes: int,
                 max_parameter_bytes: int = CompileConfig.max_parameter_bytes):
        self.compiler = compiler
        self.uploads = uploads
        self.max_parameter_bytes = max_parameter_bytes
        # A chunk plus its envelope must fit in one message.
        self._max_chunk_bytes = max_message_bytes - 1024

    def ListPrograms(self, request, context):
        self.uploads.refresh()  # every lookup first: uploads and deletes through another replica
        programs = self.compiler.registry.list()
        return pb.ListProgramsResponse(programs=[programs_pb.program_to_proto(p, with_layers=False) for p in programs])

    def DescribeProgram(self, request, context):
        if not request.name:
            raise errors.InvalidArgument("name is required; ListPrograms shows what is registered")
        check_reference(request.name, request.version)
        self.uploads.refresh()
        program = self.compiler.registry.get(request.name, request.version)
        return pb.DescribeProgramResponse(program=programs_pb.program_to_proto(program))

    def UploadProgram(self, request_iterator, context):
        first = next(request_iterator, None)
        if first is None or first.WhichOneof("part") != "header":
            raise errors.InvalidArgument("the first UploadProgramRequest must carry the header")
        header = first.header
        if header.total_bytes <= 0:
            raise errors.InvalidArgument("header.total_bytes must be the artifact's size in bytes (> 0)")
        if header.total_bytes > self.uploads.max_bytes:
            raise errors.ResourceExhausted(
                f"header.total_bytes {header.total_bytes} is over the upload limit of {self.uploads.max_bytes} bytes; "
                "export a smaller function, or raise ACCELMESH_MAX_UPLOAD_BYTES", field="header.total_bytes"
            )
        # Refuse before the artifact streams in.
        self.uploads.check(header.name, header.version, header.total_bytes, header.input_names, header.description)
        if len(header.output_combine) > MAX_UPLOAD_TENSORS:
            raise errors.InvalidArgument(f"header.output_combine has {len(header.output_combine)} rules; an upload "
                                         f"may return at most {MAX_UPLOAD_TENSORS} outputs")
        combine = []
        for i, code in enumerate(header.output_combine):
            if code not in programs_pb.COMBINE_FROM_PROTO:
                raise errors.InvalidArgument(f"header.output_combine[{i}] must be CONCAT, SUM or MEAN")
            combine.append(programs_pb.COMBINE_FROM_PROTO[code])
        data = bytearray()
        # Each chunk is checked as it arrives, so no more than total_bytes (itself within the
        # limit) is ever held, however long the stream goes on.
        for message in request_iterator:
            if message.WhichOneof("part") != "chunk":
                raise errors.InvalidArgument("only chunks may follow the header")
            data += message.chunk
            if len(data) > header.total_bytes:
                raise errors.InvalidArgument(f"chunks carry more than header.total_bytes ({header.total_bytes})")
        if len(data) != header.total_bytes:
            raise errors.InvalidArgument(f"stream ended after {len(data)} of header.total_bytes {header.total_bytes}")
        program = self.uploads.upload(
            header.name, header.version, bytes(data), combine, list(header.input_names), header.description
        )
        return pb.UploadProgramResponse(program=programs_pb.program_to_proto(program))

    def DeleteProgram(self, request, context):
        check_reference(request.name, request.version)
        return pb.DeleteProgramResponse(ref=self.uploads.delete(request.name, request.version).ref)

    def ListRules(self, request, context):
        table = self.compiler.rules
        return pb.ListRulesResponse(rules=[tr.rule_to_proto(r) for r in table.rules], origin=str(table.origin))

    def ExplainRule(self, request, context):
        if not request.HasField("device"):
            raise errors.InvalidArgument("device is required; pass a Device as ListDevices returns it")
        precision = tr.precision_from_proto(request.precision)
        spec, _ = device_from_proto(request.device, "device")
        return tr.explanation_to_proto(self.compiler.explain(spec, precision))

    def Compile(self, request, context):
        if not request.program:
            raise errors.InvalidArgument("program is required; ListPrograms shows what is registered")
        check_reference(request.program, request.version, name_field="program")
        precision = tr.precision_from_proto(request.precision)
        self.uploads.refresh()
        targets = [device_from_proto(d, f"targets[{i}]")[0] for i, d in enumerate(request.targets)]
        inputs = [programs_pb.tensor_spec_from_proto(s, f"inputs[{i}]") for i, s in enumerate(request.inputs)]
        layers = tr.layer_range_from_proto(request.layers) if request.HasField("layers") else None
        result = self.compiler.compile(
            request.program, request.version, targets, inputs=inputs, batch_sizes=list(request.batch_sizes),
            layers=layers, precision=precision,
        )
        return pb.CompileResponse(
            program=result.program.name,
            version=result.program.version,
            builds=[tr.build_to_proto(b) for b in result.builds],
            stage=programs_pb.program_to_proto(result.stage) if result.stage is not None else None,
        )

    def FetchArtifact(self, request, context):
        chunk = request.chunk_bytes or DEFAULT_CHUNK_BYTES
        if not 0 < chunk <= self._max_chunk_bytes:
            raise errors.InvalidArgument(
                f"chunk_bytes must be within 1..{self._max_chunk_bytes}, got {request.chunk_bytes}")
        artifact = self.compiler.fetch(request.key)
        view = memoryview(artifact.payload)
        yield pb.FetchArtifactResponse(digest=artifact.digest, total_bytes=len(view), chunk=bytes(view[:chunk]))
        for offset in range(chunk, len(view), chunk):
            yield pb.FetchArtifactResponse(chunk=bytes(view[offset : offset + chunk]))

    def FetchParameters(self, request, context):
        if not request.program:
            raise errors.InvalidArgument("program is required; ListPrograms shows what is registered")
        check_reference(request.program, request.version, name_field="program")
        self.uploads.refresh()
        program = self.compiler.registry.get(request.program, request.version)
        if program.init_params is None:
            raise errors.FailedPrecondition(
                f"program {program.ref} has no initial parameters; send its parameters with the job instead"
            )
        if not -(2**31) <= request.seed < 2**31:
            raise errors.InvalidArgument(f"seed {request.seed} must fit in 32 bits")
        check_initialisable(program, self.max_parameter_bytes)
        chunk = min(DEFAULT_CHUNK_BYTES, self._max_chunk_bytes)
        for spec, value in zip(program.parameters, program.init_params(request.seed)):
            header, chunks = split_frames(spec.name, value, chunk, pb.FetchParametersResponse)
            yield pb.FetchParametersResponse(tensor=header)
            yield from chunks
