from accelmesh.common.v1 import common_pb2 as _common_pb2
from accelmesh.compile.v1 import build_pb2 as _build_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ShardStage(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SHARD_STAGE_UNSPECIFIED: _ClassVar[ShardStage]
    SHARD_STAGE_QUEUED: _ClassVar[ShardStage]
    SHARD_STAGE_LOADING: _ClassVar[ShardStage]
    SHARD_STAGE_RUNNING: _ClassVar[ShardStage]
    SHARD_STAGE_DONE: _ClassVar[ShardStage]
SHARD_STAGE_UNSPECIFIED: ShardStage
SHARD_STAGE_QUEUED: ShardStage
SHARD_STAGE_LOADING: ShardStage
SHARD_STAGE_RUNNING: ShardStage
SHARD_STAGE_DONE: ShardStage

class ShardHeader(_message.Message):
    __slots__ = ("job_id", "shard_index", "attempt", "device_id", "target_type", "artifact_key", "artifact_digest", "artifact_format", "rule", "input_count", "batch_size", "report_stages", "keep_tensors", "traceparent", "accept_batches", "object_scope", "stored_inputs", "output_prefix")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    SHARD_INDEX_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    TARGET_TYPE_FIELD_NUMBER: _ClassVar[int]
    ARTIFACT_KEY_FIELD_NUMBER: _ClassVar[int]
    ARTIFACT_DIGEST_FIELD_NUMBER: _ClassVar[int]
    ARTIFACT_FORMAT_FIELD_NUMBER: _ClassVar[int]
    RULE_FIELD_NUMBER: _ClassVar[int]
    INPUT_COUNT_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    REPORT_STAGES_FIELD_NUMBER: _ClassVar[int]
    KEEP_TENSORS_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    ACCEPT_BATCHES_FIELD_NUMBER: _ClassVar[int]
    OBJECT_SCOPE_FIELD_NUMBER: _ClassVar[int]
    STORED_INPUTS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_PREFIX_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    shard_index: int
    attempt: int
    device_id: str
    target_type: str
    artifact_key: str
    artifact_digest: str
    artifact_format: _build_pb2.ArtifactFormat
    rule: _build_pb2.Rule
    input_count: int
    batch_size: int
    report_stages: bool
    keep_tensors: _containers.RepeatedCompositeFieldContainer[TensorRef]
    traceparent: str
    accept_batches: bool
    object_scope: str
    stored_inputs: _containers.RepeatedCompositeFieldContainer[StoredInput]
    output_prefix: str
    def __init__(self, job_id: _Optional[str] = ..., shard_index: _Optional[int] = ..., attempt: _Optional[int] = ..., device_id: _Optional[str] = ..., target_type: _Optional[str] = ..., artifact_key: _Optional[str] = ..., artifact_digest: _Optional[str] = ..., artifact_format: _Optional[_Union[_build_pb2.ArtifactFormat, str]] = ..., rule: _Optional[_Union[_build_pb2.Rule, _Mapping]] = ..., input_count: _Optional[int] = ..., batch_size: _Optional[int] = ..., report_stages: _Optional[bool] = ..., keep_tensors: _Optional[_Iterable[_Union[TensorRef, _Mapping]]] = ..., traceparent: _Optional[str] = ..., accept_batches: _Optional[bool] = ..., object_scope: _Optional[str] = ..., stored_inputs: _Optional[_Iterable[_Union[StoredInput, _Mapping]]] = ..., output_prefix: _Optional[str] = ...) -> None: ...

class StoredInput(_message.Message):
    __slots__ = ("name", "object_id")
    NAME_FIELD_NUMBER: _ClassVar[int]
    OBJECT_ID_FIELD_NUMBER: _ClassVar[int]
    name: str
    object_id: str
    def __init__(self, name: _Optional[str] = ..., object_id: _Optional[str] = ...) -> None: ...

class TensorRef(_message.Message):
    __slots__ = ("name", "key")
    NAME_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    name: str
    key: str
    def __init__(self, name: _Optional[str] = ..., key: _Optional[str] = ...) -> None: ...

class ExecuteRequest(_message.Message):
    __slots__ = ("header", "tensor", "chunk", "held")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    header: ShardHeader
    tensor: _common_pb2.TensorHeader
    chunk: _common_pb2.TensorChunk
    held: TensorRef
    def __init__(self, header: _Optional[_Union[ShardHeader, _Mapping]] = ..., tensor: _Optional[_Union[_common_pb2.TensorHeader, _Mapping]] = ..., chunk: _Optional[_Union[_common_pb2.TensorChunk, _Mapping]] = ..., held: _Optional[_Union[TensorRef, _Mapping]] = ...) -> None: ...

class ShardTimings(_message.Message):
    __slots__ = ("receive_seconds", "queue_seconds", "load_seconds", "execute_seconds", "artifact_cached", "load_kind")
    RECEIVE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LOAD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    EXECUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ARTIFACT_CACHED_FIELD_NUMBER: _ClassVar[int]
    LOAD_KIND_FIELD_NUMBER: _ClassVar[int]
    receive_seconds: float
    queue_seconds: float
    load_seconds: float
    execute_seconds: float
    artifact_cached: bool
    load_kind: str
    def __init__(self, receive_seconds: _Optional[float] = ..., queue_seconds: _Optional[float] = ..., load_seconds: _Optional[float] = ..., execute_seconds: _Optional[float] = ..., artifact_cached: _Optional[bool] = ..., load_kind: _Optional[str] = ...) -> None: ...

class ExecuteResponse(_message.Message):
    __slots__ = ("stage", "tensor", "chunk", "timings")
    STAGE_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    stage: ShardStage
    tensor: _common_pb2.TensorHeader
    chunk: _common_pb2.TensorChunk
    timings: ShardTimings
    def __init__(self, stage: _Optional[_Union[ShardStage, str]] = ..., tensor: _Optional[_Union[_common_pb2.TensorHeader, _Mapping]] = ..., chunk: _Optional[_Union[_common_pb2.TensorChunk, _Mapping]] = ..., timings: _Optional[_Union[ShardTimings, _Mapping]] = ...) -> None: ...

class ExecuteManyRequest(_message.Message):
    __slots__ = ("header", "tensor", "chunk", "held", "batch")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    header: ShardHeader
    tensor: _common_pb2.TensorHeader
    chunk: _common_pb2.TensorChunk
    held: TensorRef
    batch: ExecuteManyRequestBatch
    def __init__(self, header: _Optional[_Union[ShardHeader, _Mapping]] = ..., tensor: _Optional[_Union[_common_pb2.TensorHeader, _Mapping]] = ..., chunk: _Optional[_Union[_common_pb2.TensorChunk, _Mapping]] = ..., held: _Optional[_Union[TensorRef, _Mapping]] = ..., batch: _Optional[_Union[ExecuteManyRequestBatch, _Mapping]] = ...) -> None: ...

class ExecuteManyRequestBatch(_message.Message):
    __slots__ = ("parts",)
    PARTS_FIELD_NUMBER: _ClassVar[int]
    parts: _containers.RepeatedCompositeFieldContainer[ExecuteManyRequest]
    def __init__(self, parts: _Optional[_Iterable[_Union[ExecuteManyRequest, _Mapping]]] = ...) -> None: ...

class ExecuteManyResponse(_message.Message):
    __slots__ = ("tensor", "chunk", "timings", "failure", "batch")
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    FAILURE_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    tensor: _common_pb2.TensorHeader
    chunk: _common_pb2.TensorChunk
    timings: ShardTimings
    failure: ShardFailure
    batch: ExecuteManyResponseBatch
    def __init__(self, tensor: _Optional[_Union[_common_pb2.TensorHeader, _Mapping]] = ..., chunk: _Optional[_Union[_common_pb2.TensorChunk, _Mapping]] = ..., timings: _Optional[_Union[ShardTimings, _Mapping]] = ..., failure: _Optional[_Union[ShardFailure, _Mapping]] = ..., batch: _Optional[_Union[ExecuteManyResponseBatch, _Mapping]] = ...) -> None: ...

class ExecuteManyResponseBatch(_message.Message):
    __slots__ = ("parts",)
    PARTS_FIELD_NUMBER: _ClassVar[int]
    parts: _containers.RepeatedCompositeFieldContainer[ExecuteManyResponse]
    def __init__(self, parts: _Optional[_Iterable[_Union[ExecuteManyResponse, _Mapping]]] = ...) -> None: ...

class ShardFailure(_message.Message):
    __slots__ = ("code", "message", "reason")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    reason: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class ReleaseJobRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class ReleaseJobResponse(_message.Message):
    __slots__ = ("released_tensors", "released_bytes")
    RELEASED_TENSORS_FIELD_NUMBER: _ClassVar[int]
    RELEASED_BYTES_FIELD_NUMBER: _ClassVar[int]
    released_tensors: int
    released_bytes: int
    def __init__(self, released_tensors: _Optional[int] = ..., released_bytes: _Optional[int] = ...) -> None: ...

class PutObjectsRequest(_message.Message):
    __slots__ = ("ticket", "object", "chunk")
    TICKET_FIELD_NUMBER: _ClassVar[int]
    OBJECT_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    ticket: bytes
    object: _common_pb2.TensorHeader
    chunk: _common_pb2.TensorChunk
    def __init__(self, ticket: _Optional[bytes] = ..., object: _Optional[_Union[_common_pb2.TensorHeader, _Mapping]] = ..., chunk: _Optional[_Union[_common_pb2.TensorChunk, _Mapping]] = ...) -> None: ...

class PutObjectsResponse(_message.Message):
    __slots__ = ("objects", "bytes")
    OBJECTS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    objects: int
    bytes: int
    def __init__(self, objects: _Optional[int] = ..., bytes: _Optional[int] = ...) -> None: ...

class FetchObjectsRequest(_message.Message):
    __slots__ = ("ticket", "object_ids")
    TICKET_FIELD_NUMBER: _ClassVar[int]
    OBJECT_IDS_FIELD_NUMBER: _ClassVar[int]
    ticket: bytes
    object_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, ticket: _Optional[bytes] = ..., object_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class FetchObjectsResponse(_message.Message):
    __slots__ = ("object", "chunk")
    OBJECT_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    object: _common_pb2.TensorHeader
    chunk: _common_pb2.TensorChunk
    def __init__(self, object: _Optional[_Union[_common_pb2.TensorHeader, _Mapping]] = ..., chunk: _Optional[_Union[_common_pb2.TensorChunk, _Mapping]] = ...) -> None: ...

class MapObjectsRequest(_message.Message):
    __slots__ = ("ticket", "create", "open")
    TICKET_FIELD_NUMBER: _ClassVar[int]
    CREATE_FIELD_NUMBER: _ClassVar[int]
    OPEN_FIELD_NUMBER: _ClassVar[int]
    ticket: bytes
    create: _containers.RepeatedCompositeFieldContainer[_common_pb2.TensorHeader]
    open: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, ticket: _Optional[bytes] = ..., create: _Optional[_Iterable[_Union[_common_pb2.TensorHeader, _Mapping]]] = ..., open: _Optional[_Iterable[str]] = ...) -> None: ...

class ObjectSegment(_message.Message):
    __slots__ = ("object_id", "path", "bytes", "header")
    OBJECT_ID_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    HEADER_FIELD_NUMBER: _ClassVar[int]
    object_id: str
    path: str
    bytes: int
    header: _common_pb2.TensorHeader
    def __init__(self, object_id: _Optional[str] = ..., path: _Optional[str] = ..., bytes: _Optional[int] = ..., header: _Optional[_Union[_common_pb2.TensorHeader, _Mapping]] = ...) -> None: ...

class MapObjectsResponse(_message.Message):
    __slots__ = ("segments",)
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    segments: _containers.RepeatedCompositeFieldContainer[ObjectSegment]
    def __init__(self, segments: _Optional[_Iterable[_Union[ObjectSegment, _Mapping]]] = ...) -> None: ...

class SealObjectsRequest(_message.Message):
    __slots__ = ("ticket", "object_ids")
    TICKET_FIELD_NUMBER: _ClassVar[int]
    OBJECT_IDS_FIELD_NUMBER: _ClassVar[int]
    ticket: bytes
    object_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, ticket: _Optional[bytes] = ..., object_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class SealObjectsResponse(_message.Message):
    __slots__ = ("sealed",)
    SEALED_FIELD_NUMBER: _ClassVar[int]
    sealed: int
    def __init__(self, sealed: _Optional[int] = ...) -> None: ...

class ReleaseObjectsRequest(_message.Message):
    __slots__ = ("ticket", "object_ids")
    TICKET_FIELD_NUMBER: _ClassVar[int]
    OBJECT_IDS_FIELD_NUMBER: _ClassVar[int]
    ticket: bytes
    object_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, ticket: _Optional[bytes] = ..., object_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class ReleaseObjectsResponse(_message.Message):
    __slots__ = ("released_objects", "released_bytes")
    RELEASED_OBJECTS_FIELD_NUMBER: _ClassVar[int]
    RELEASED_BYTES_FIELD_NUMBER: _ClassVar[int]
    released_objects: int
    released_bytes: int
    def __init__(self, released_objects: _Optional[int] = ..., released_bytes: _Optional[int] = ...) -> None: ...

class DescribeNodeRequest(_message.Message):
    __slots__ = ("device_ids",)
    DEVICE_IDS_FIELD_NUMBER: _ClassVar[int]
    device_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, device_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class DescribeNodeResponse(_message.Message):
    __slots__ = ("node_ip", "hostname", "devices", "software_version")
    NODE_IP_FIELD_NUMBER: _ClassVar[int]
    HOSTNAME_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    SOFTWARE_VERSION_FIELD_NUMBER: _ClassVar[int]
    node_ip: str
    hostname: str
    devices: _containers.RepeatedCompositeFieldContainer[_common_pb2.Device]
    software_version: str
    def __init__(self, node_ip: _Optional[str] = ..., hostname: _Optional[str] = ..., devices: _Optional[_Iterable[_Union[_common_pb2.Device, _Mapping]]] = ..., software_version: _Optional[str] = ...) -> None: ...
