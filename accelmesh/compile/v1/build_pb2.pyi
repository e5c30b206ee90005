from accelmesh.common.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ArtifactFormat(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ARTIFACT_FORMAT_UNSPECIFIED: _ClassVar[ArtifactFormat]
    ARTIFACT_FORMAT_STABLEHLO: _ClassVar[ArtifactFormat]
    ARTIFACT_FORMAT_EXECUTABLE: _ClassVar[ArtifactFormat]
ARTIFACT_FORMAT_UNSPECIFIED: ArtifactFormat
ARTIFACT_FORMAT_STABLEHLO: ArtifactFormat
ARTIFACT_FORMAT_EXECUTABLE: ArtifactFormat

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

class RuleVerdict(_message.Message):
    __slots__ = ("rule", "matched", "reason")
    RULE_FIELD_NUMBER: _ClassVar[int]
    MATCHED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    rule: str
    matched: bool
    reason: str
    def __init__(self, rule: _Optional[str] = ..., matched: _Optional[bool] = ..., reason: _Optional[str] = ...) -> None: ...

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
