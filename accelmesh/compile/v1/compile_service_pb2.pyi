from accelmesh.common.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class CombineRule(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    COMBINE_RULE_UNSPECIFIED: _ClassVar[CombineRule]
    COMBINE_RULE_CONCAT: _ClassVar[CombineRule]
    COMBINE_RULE_SUM: _ClassVar[CombineRule]
    COMBINE_RULE_MEAN: _ClassVar[CombineRule]

class ProgramKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PROGRAM_KIND_UNSPECIFIED: _ClassVar[ProgramKind]
    PROGRAM_KIND_FUNCTION: _ClassVar[ProgramKind]
    PROGRAM_KIND_MODEL: _ClassVar[ProgramKind]
    PROGRAM_KIND_TRAINING_STEP: _ClassVar[ProgramKind]
    PROGRAM_KIND_UPLOADED: _ClassVar[ProgramKind]

class ArtifactFormat(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ARTIFACT_FORMAT_UNSPECIFIED: _ClassVar[ArtifactFormat]
    ARTIFACT_FORMAT_STABLEHLO: _ClassVar[ArtifactFormat]
    ARTIFACT_FORMAT_EXECUTABLE: _ClassVar[ArtifactFormat]
COMBINE_RULE_UNSPECIFIED: CombineRule
COMBINE_RULE_CONCAT: CombineRule
COMBINE_RULE_SUM: CombineRule
COMBINE_RULE_MEAN: CombineRule
PROGRAM_KIND_UNSPECIFIED: ProgramKind
PROGRAM_KIND_FUNCTION: ProgramKind
PROGRAM_KIND_MODEL: ProgramKind
PROGRAM_KIND_TRAINING_STEP: ProgramKind
PROGRAM_KIND_UPLOADED: ProgramKind
ARTIFACT_FORMAT_UNSPECIFIED: ArtifactFormat
ARTIFACT_FORMAT_STABLEHLO: ArtifactFormat
ARTIFACT_FORMAT_EXECUTABLE: ArtifactFormat

class TensorSpec(_message.Message):
    __slots__ = ("name", "dtype", "shape")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: _common_pb2.DataType
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[_Union[_common_pb2.DataType, str]] = ..., shape: _Optional[_Iterable[int]] = ...) -> None: ...

class OutputSpec(_message.Message):
    __slots__ = ("tensor", "combine")
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    COMBINE_FIELD_NUMBER: _ClassVar[int]
    tensor: TensorSpec
    combine: CombineRule
    def __init__(self, tensor: _Optional[_Union[TensorSpec, _Mapping]] = ..., combine: _Optional[_Union[CombineRule, str]] = ...) -> None: ...

class Layer(_message.Message):
    __slots__ = ("name", "kind", "order", "parameters", "parameter_count", "parameter_bytes", "flops_per_sample", "bytes_accessed_per_sample", "activation_bytes_per_sample", "shared_from", "shared_parameter_bytes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    ORDER_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    PARAMETER_COUNT_FIELD_NUMBER: _ClassVar[int]
    PARAMETER_BYTES_FIELD_NUMBER: _ClassVar[int]
    FLOPS_PER_SAMPLE_FIELD_NUMBER: _ClassVar[int]
    BYTES_ACCESSED_PER_SAMPLE_FIELD_NUMBER: _ClassVar[int]
    ACTIVATION_BYTES_PER_SAMPLE_FIELD_NUMBER: _ClassVar[int]
    SHARED_FROM_FIELD_NUMBER: _ClassVar[int]
    SHARED_PARAMETER_BYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    kind: str
    order: int
    parameters: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    parameter_count: int
    parameter_bytes: int
    flops_per_sample: float
    bytes_accessed_per_sample: float
    activation_bytes_per_sample: int
    shared_from: str
    shared_parameter_bytes: int
    def __init__(self, name: _Optional[str] = ..., kind: _Optional[str] = ..., order: _Optional[int] = ..., parameters: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., parameter_count: _Optional[int] = ..., parameter_bytes: _Optional[int] = ..., flops_per_sample: _Optional[float] = ..., bytes_accessed_per_sample: _Optional[float] = ..., activation_bytes_per_sample: _Optional[int] = ..., shared_from: _Optional[str] = ..., shared_parameter_bytes: _Optional[int] = ...) -> None: ...

class Program(_message.Message):
    __slots__ = ("name", "version", "kind", "description", "parameters", "inputs", "outputs", "digest", "layers", "parameter_count")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    PARAMETER_COUNT_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: str
    kind: ProgramKind
    description: str
    parameters: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    inputs: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    outputs: _containers.RepeatedCompositeFieldContainer[OutputSpec]
    digest: str
    layers: _containers.RepeatedCompositeFieldContainer[Layer]
    parameter_count: int
    def __init__(self, name: _Optional[str] = ..., version: _Optional[str] = ..., kind: _Optional[_Union[ProgramKind, str]] = ..., description: _Optional[str] = ..., parameters: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., inputs: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., outputs: _Optional[_Iterable[_Union[OutputSpec, _Mapping]]] = ..., digest: _Optional[str] = ..., layers: _Optional[_Iterable[_Union[Layer, _Mapping]]] = ..., parameter_count: _Optional[int] = ...) -> None: ...

class ListProgramsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListProgramsResponse(_message.Message):
    __slots__ = ("programs",)
    PROGRAMS_FIELD_NUMBER: _ClassVar[int]
    programs: _containers.RepeatedCompositeFieldContainer[Program]
    def __init__(self, programs: _Optional[_Iterable[_Union[Program, _Mapping]]] = ...) -> None: ...

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
    program: Program
    def __init__(self, program: _Optional[_Union[Program, _Mapping]] = ...) -> None: ...

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
    output_combine: _containers.RepeatedScalarFieldContainer[CombineRule]
    description: str
    total_bytes: int
    def __init__(self, name: _Optional[str] = ..., version: _Optional[str] = ..., input_names: _Optional[_Iterable[str]] = ..., output_combine: _Optional[_Iterable[_Union[CombineRule, str]]] = ..., description: _Optional[str] = ..., total_bytes: _Optional[int] = ...) -> None: ...

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
    program: Program
    def __init__(self, program: _Optional[_Union[Program, _Mapping]] = ...) -> None: ...

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

class RuleMatch(_message.Message):
    __slots__ = ("platform", "requires", "forbids", "min_memory_bytes", "max_memory_bytes", "kind_pattern")
    PLATFORM_FIELD_NUMBER: _ClassVar[int]
    REQUIRES_FIELD_NUMBER: _ClassVar[int]
    FORBIDS_FIELD_NUMBER: _ClassVar[int]
    MIN_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    KIND_PATTERN_FIELD_NUMBER: _ClassVar[int]
    platform: _common_pb2.Platform
    requires: _containers.RepeatedScalarFieldContainer[str]
    forbids: _containers.RepeatedScalarFieldContainer[str]
    min_memory_bytes: int
    max_memory_bytes: int
    kind_pattern: str
    def __init__(self, platform: _Optional[_Union[_common_pb2.Platform, str]] = ..., requires: _Optional[_Iterable[str]] = ..., forbids: _Optional[_Iterable[str]] = ..., min_memory_bytes: _Optional[int] = ..., max_memory_bytes: _Optional[int] = ..., kind_pattern: _Optional[str] = ...) -> None: ...

class BuildOptions(_message.Message):
    __slots__ = ("compute_dtype", "matmul_precision", "remat", "xla_options", "tolerance")
    class XlaOptionsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    COMPUTE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    MATMUL_PRECISION_FIELD_NUMBER: _ClassVar[int]
    REMAT_FIELD_NUMBER: _ClassVar[int]
    XLA_OPTIONS_FIELD_NUMBER: _ClassVar[int]
    TOLERANCE_FIELD_NUMBER: _ClassVar[int]
    compute_dtype: str
    matmul_precision: str
    remat: bool
    xla_options: _containers.ScalarMap[str, str]
    tolerance: float
    def __init__(self, compute_dtype: _Optional[str] = ..., matmul_precision: _Optional[str] = ..., remat: _Optional[bool] = ..., xla_options: _Optional[_Mapping[str, str]] = ..., tolerance: _Optional[float] = ...) -> None: ...

class Rule(_message.Message):
    __slots__ = ("name", "description", "match", "build", "line")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    MATCH_FIELD_NUMBER: _ClassVar[int]
    BUILD_FIELD_NUMBER: _ClassVar[int]
    LINE_FIELD_NUMBER: _ClassVar[int]
    name: str
    description: str
    match: RuleMatch
    build: BuildOptions
    line: int
    def __init__(self, name: _Optional[str] = ..., description: _Optional[str] = ..., match: _Optional[_Union[RuleMatch, _Mapping]] = ..., build: _Optional[_Union[BuildOptions, _Mapping]] = ..., line: _Optional[int] = ...) -> None: ...

class ListRulesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListRulesResponse(_message.Message):
    __slots__ = ("rules", "origin")
    RULES_FIELD_NUMBER: _ClassVar[int]
    ORIGIN_FIELD_NUMBER: _ClassVar[int]
    rules: _containers.RepeatedCompositeFieldContainer[Rule]
    origin: str
    def __init__(self, rules: _Optional[_Iterable[_Union[Rule, _Mapping]]] = ..., origin: _Optional[str] = ...) -> None: ...

class ExplainRuleRequest(_message.Message):
    __slots__ = ("device",)
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    device: _common_pb2.Device
    def __init__(self, device: _Optional[_Union[_common_pb2.Device, _Mapping]] = ...) -> None: ...

class RuleVerdict(_message.Message):
    __slots__ = ("rule", "matched", "reason")
    RULE_FIELD_NUMBER: _ClassVar[int]
    MATCHED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    rule: str
    matched: bool
    reason: str
    def __init__(self, rule: _Optional[str] = ..., matched: _Optional[bool] = ..., reason: _Optional[str] = ...) -> None: ...

class ExplainRuleResponse(_message.Message):
    __slots__ = ("rule", "verdicts", "target_type")
    RULE_FIELD_NUMBER: _ClassVar[int]
    VERDICTS_FIELD_NUMBER: _ClassVar[int]
    TARGET_TYPE_FIELD_NUMBER: _ClassVar[int]
    rule: Rule
    verdicts: _containers.RepeatedCompositeFieldContainer[RuleVerdict]
    target_type: str
    def __init__(self, rule: _Optional[_Union[Rule, _Mapping]] = ..., verdicts: _Optional[_Iterable[_Union[RuleVerdict, _Mapping]]] = ..., target_type: _Optional[str] = ...) -> None: ...

class CompileRequest(_message.Message):
    __slots__ = ("program", "version", "inputs", "targets", "batch_sizes", "layers")
    PROGRAM_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    TARGETS_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZES_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    program: str
    version: str
    inputs: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    targets: _containers.RepeatedCompositeFieldContainer[_common_pb2.Device]
    batch_sizes: _containers.RepeatedScalarFieldContainer[int]
    layers: LayerRange
    def __init__(self, program: _Optional[str] = ..., version: _Optional[str] = ..., inputs: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., targets: _Optional[_Iterable[_Union[_common_pb2.Device, _Mapping]]] = ..., batch_sizes: _Optional[_Iterable[int]] = ..., layers: _Optional[_Union[LayerRange, _Mapping]] = ...) -> None: ...

class LayerRange(_message.Message):
    __slots__ = ("first", "count")
    FIRST_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    first: int
    count: int
    def __init__(self, first: _Optional[int] = ..., count: _Optional[int] = ...) -> None: ...

class Artifact(_message.Message):
    __slots__ = ("key", "format", "batch_size", "size_bytes", "digest", "platform", "cache_hit", "build_seconds")
    KEY_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    PLATFORM_FIELD_NUMBER: _ClassVar[int]
    CACHE_HIT_FIELD_NUMBER: _ClassVar[int]
    BUILD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    key: str
    format: ArtifactFormat
    batch_size: int
    size_bytes: int
    digest: str
    platform: str
    cache_hit: bool
    build_seconds: float
    def __init__(self, key: _Optional[str] = ..., format: _Optional[_Union[ArtifactFormat, str]] = ..., batch_size: _Optional[int] = ..., size_bytes: _Optional[int] = ..., digest: _Optional[str] = ..., platform: _Optional[str] = ..., cache_hit: _Optional[bool] = ..., build_seconds: _Optional[float] = ...) -> None: ...

class TargetBuild(_message.Message):
    __slots__ = ("target_type", "rule", "device_ids", "portable", "executables")
    TARGET_TYPE_FIELD_NUMBER: _ClassVar[int]
    RULE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_IDS_FIELD_NUMBER: _ClassVar[int]
    PORTABLE_FIELD_NUMBER: _ClassVar[int]
    EXECUTABLES_FIELD_NUMBER: _ClassVar[int]
    target_type: str
    rule: Rule
    device_ids: _containers.RepeatedScalarFieldContainer[str]
    portable: Artifact
    executables: _containers.RepeatedCompositeFieldContainer[Artifact]
    def __init__(self, target_type: _Optional[str] = ..., rule: _Optional[_Union[Rule, _Mapping]] = ..., device_ids: _Optional[_Iterable[str]] = ..., portable: _Optional[_Union[Artifact, _Mapping]] = ..., executables: _Optional[_Iterable[_Union[Artifact, _Mapping]]] = ...) -> None: ...

class CompileResponse(_message.Message):
    __slots__ = ("program", "version", "builds", "stage")
    PROGRAM_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    BUILDS_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    program: str
    version: str
    builds: _containers.RepeatedCompositeFieldContainer[TargetBuild]
    stage: Program
    def __init__(self, program: _Optional[str] = ..., version: _Optional[str] = ..., builds: _Optional[_Iterable[_Union[TargetBuild, _Mapping]]] = ..., stage: _Optional[_Union[Program, _Mapping]] = ...) -> None: ...

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
