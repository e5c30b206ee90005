from accelmesh.common.v1 import common_pb2 as _common_pb2
from accelmesh.compile.v1 import build_pb2 as _build_pb2
from accelmesh.compile.v1 import program_pb2 as _program_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ListProgramsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListProgramsResponse(_message.Message):
    __slots__ = ("programs",)
    PROGRAMS_FIELD_NUMBER: _ClassVar[int]
    programs: _containers.RepeatedCompositeFieldContainer[_program_pb2.Program]
    def __init__(self, programs: _Optional[_Iterable[_Union[_program_pb2.Program, _Mapping]]] = ...) -> None: ...

class DescribeProgramRequest(_message.Message):
    __slots__ = ("name", "version")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: str
    def __init__(self, name: _Optional[str] = ..., version: _Optional[str] = ...) -> None: ...

class DescribeProgramResponse(_message.Message):
    __slots__ = ("program",)
    PROGRAM_FIELD_NUMBER: _ClassVar[int]
    program: _program_pb2.Program
    def __init__(self, program: _Optional[_Union[_program_pb2.Program, _Mapping]] = ...) -> None: ...

class UploadHeader(_message.Message):
    __slots__ = ("name", "version", "input_names", "output_combine", "description", "total_bytes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    INPUT_NAMES_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_COMBINE_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: str
    input_names: _containers.RepeatedScalarFieldContainer[str]
    output_combine: _containers.RepeatedScalarFieldContainer[_program_pb2.CombineRule]
    description: str
    total_bytes: int
    def __init__(self, name: _Optional[str] = ..., version: _Optional[str] = ..., input_names: _Optional[_Iterable[str]] = ..., output_combine: _Optional[_Iterable[_Union[_program_pb2.CombineRule, str]]] = ..., description: _Optional[str] = ..., total_bytes: _Optional[int] = ...) -> None: ...

class UploadProgramRequest(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: UploadHeader
    chunk: bytes
    def __init__(self, header: _Optional[_Union[UploadHeader, _Mapping]] = ..., chunk: _Optional[bytes] = ...) -> None: ...

class UploadProgramResponse(_message.Message):
    __slots__ = ("program",)
    PROGRAM_FIELD_NUMBER: _ClassVar[int]
    program: _program_pb2.Program
    def __init__(self, program: _Optional[_Union[_program_pb2.Program, _Mapping]] = ...) -> None: ...

class DeleteProgramRequest(_message.Message):
    __slots__ = ("name", "version")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: str
    def __init__(self, name: _Optional[str] = ..., version: _Optional[str] = ...) -> None: ...

class DeleteProgramResponse(_message.Message):
    __slots__ = ("ref",)
    REF_FIELD_NUMBER: _ClassVar[int]
    ref: str
    def __init__(self, ref: _Optional[str] = ...) -> None: ...

class ListRulesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListRulesResponse(_message.Message):
    __slots__ = ("rules", "origin")
    RULES_FIELD_NUMBER: _ClassVar[int]
    ORIGIN_FIELD_NUMBER: _ClassVar[int]
    rules: _containers.RepeatedCompositeFieldContainer[_build_pb2.Rule]
    origin: str
    def __init__(self, rules: _Optional[_Iterable[_Union[_build_pb2.Rule, _Mapping]]] = ..., origin: _Optional[str] = ...) -> None: ...

class ExplainRuleRequest(_message.Message):
    __slots__ = ("device", "precision")
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    PRECISION_FIELD_NUMBER: _ClassVar[int]
    device: _common_pb2.Device
    precision: _common_pb2.Precision
    def __init__(self, device: _Optional[_Union[_common_pb2.Device, _Mapping]] = ..., precision: _Optional[_Union[_common_pb2.Precision, str]] = ...) -> None: ...

class ExplainRuleResponse(_message.Message):
    __slots__ = ("rule", "verdicts", "target_type")
    RULE_FIELD_NUMBER: _ClassVar[int]
    VERDICTS_FIELD_NUMBER: _ClassVar[int]
    TARGET_TYPE_FIELD_NUMBER: _ClassVar[int]
    rule: _build_pb2.Rule
    verdicts: _containers.RepeatedCompositeFieldContainer[_build_pb2.RuleVerdict]
    target_type: str
    def __init__(self, rule: _Optional[_Union[_build_pb2.Rule, _Mapping]] = ..., verdicts: _Optional[_Iterable[_Union[_build_pb2.RuleVerdict, _Mapping]]] = ..., target_type: _Optional[str] = ...) -> None: ...

class CompileRequest(_message.Message):
    __slots__ = ("program", "version", "inputs", "targets", "batch_sizes", "layers", "precision")
    PROGRAM_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    TARGETS_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZES_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    PRECISION_FIELD_NUMBER: _ClassVar[int]
    program: str
    version: str
    inputs: _containers.RepeatedCompositeFieldContainer[_program_pb2.TensorSpec]
    targets: _containers.RepeatedCompositeFieldContainer[_common_pb2.Device]
    batch_sizes: _containers.RepeatedScalarFieldContainer[int]
    layers: LayerRange
    precision: _common_pb2.Precision
    def __init__(self, program: _Optional[str] = ..., version: _Optional[str] = ..., inputs: _Optional[_Iterable[_Union[_program_pb2.TensorSpec, _Mapping]]] = ..., targets: _Optional[_Iterable[_Union[_common_pb2.Device, _Mapping]]] = ..., batch_sizes: _Optional[_Iterable[int]] = ..., layers: _Optional[_Union[LayerRange, _Mapping]] = ..., precision: _Optional[_Union[_common_pb2.Precision, str]] = ...) -> None: ...

class LayerRange(_message.Message):
    __slots__ = ("first", "count", "backward")
    FIRST_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    BACKWARD_FIELD_NUMBER: _ClassVar[int]
    first: int
    count: int
    backward: bool
    def __init__(self, first: _Optional[int] = ..., count: _Optional[int] = ..., backward: _Optional[bool] = ...) -> None: ...

class CompileResponse(_message.Message):
    __slots__ = ("program", "version", "builds", "stage")
    PROGRAM_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    BUILDS_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    program: str
    version: str
    builds: _containers.RepeatedCompositeFieldContainer[_build_pb2.TargetBuild]
    stage: _program_pb2.Program
    def __init__(self, program: _Optional[str] = ..., version: _Optional[str] = ..., builds: _Optional[_Iterable[_Union[_build_pb2.TargetBuild, _Mapping]]] = ..., stage: _Optional[_Union[_program_pb2.Program, _Mapping]] = ...) -> None: ...

class FetchArtifactRequest(_message.Message):
    __slots__ = ("key", "chunk_bytes")
    KEY_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    key: str
    chunk_bytes: int
    def __init__(self, key: _Optional[str] = ..., chunk_bytes: _Optional[int] = ...) -> None: ...

class FetchArtifactResponse(_message.Message):
    __slots__ = ("digest", "total_bytes", "chunk")
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    digest: str
    total_bytes: int
    chunk: bytes
    def __init__(self, digest: _Optional[str] = ..., total_bytes: _Optional[int] = ..., chunk: _Optional[bytes] = ...) -> None: ...

class FetchParametersRequest(_message.Message):
    __slots__ = ("program", "version", "seed")
    PROGRAM_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    program: str
    version: str
    seed: int
    def __init__(self, program: _Optional[str] = ..., version: _Optional[str] = ..., seed: _Optional[int] = ...) -> None: ...

class FetchParametersResponse(_message.Message):
    __slots__ = ("tensor", "chunk")
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    tensor: _common_pb2.TensorHeader
    chunk: _common_pb2.TensorChunk
    def __init__(self, tensor: _Optional[_Union[_common_pb2.TensorHeader, _Mapping]] = ..., chunk: _Optional[_Union[_common_pb2.TensorChunk, _Mapping]] = ...) -> None: ...
