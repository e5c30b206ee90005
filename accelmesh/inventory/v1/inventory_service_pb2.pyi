import datetime

from accelmesh.common.v1 import common_pb2 as _common_pb2
from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class NodeState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    NODE_STATE_UNSPECIFIED: _ClassVar[NodeState]
    NODE_STATE_ACTIVE: _ClassVar[NodeState]
    NODE_STATE_LOST: _ClassVar[NodeState]

class DeviceEventType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DEVICE_EVENT_TYPE_UNSPECIFIED: _ClassVar[DeviceEventType]
    DEVICE_EVENT_TYPE_EXISTING: _ClassVar[DeviceEventType]
    DEVICE_EVENT_TYPE_ADDED: _ClassVar[DeviceEventType]
    DEVICE_EVENT_TYPE_UPDATED: _ClassVar[DeviceEventType]
    DEVICE_EVENT_TYPE_LOST: _ClassVar[DeviceEventType]
    DEVICE_EVENT_TYPE_RECOVERED: _ClassVar[DeviceEventType]
    DEVICE_EVENT_TYPE_REMOVED: _ClassVar[DeviceEventType]

class TaskKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TASK_KIND_UNSPECIFIED: _ClassVar[TaskKind]
    TASK_KIND_TRAINING: _ClassVar[TaskKind]
    TASK_KIND_INFERENCE: _ClassVar[TaskKind]
NODE_STATE_UNSPECIFIED: NodeState
NODE_STATE_ACTIVE: NodeState
NODE_STATE_LOST: NodeState
DEVICE_EVENT_TYPE_UNSPECIFIED: DeviceEventType
DEVICE_EVENT_TYPE_EXISTING: DeviceEventType
DEVICE_EVENT_TYPE_ADDED: DeviceEventType
DEVICE_EVENT_TYPE_UPDATED: DeviceEventType
DEVICE_EVENT_TYPE_LOST: DeviceEventType
DEVICE_EVENT_TYPE_RECOVERED: DeviceEventType
DEVICE_EVENT_TYPE_REMOVED: DeviceEventType
TASK_KIND_UNSPECIFIED: TaskKind
TASK_KIND_TRAINING: TaskKind
TASK_KIND_INFERENCE: TaskKind

class Node(_message.Message):
    __slots__ = ("address", "ip", "hostname", "state", "register_time", "last_seen_time", "missed_polls", "last_error", "device_count", "suspect", "suspect_reason", "suspect_time")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    IP_FIELD_NUMBER: _ClassVar[int]
    HOSTNAME_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    REGISTER_TIME_FIELD_NUMBER: _ClassVar[int]
    LAST_SEEN_TIME_FIELD_NUMBER: _ClassVar[int]
    MISSED_POLLS_FIELD_NUMBER: _ClassVar[int]
    LAST_ERROR_FIELD_NUMBER: _ClassVar[int]
    DEVICE_COUNT_FIELD_NUMBER: _ClassVar[int]
    SUSPECT_FIELD_NUMBER: _ClassVar[int]
    SUSPECT_REASON_FIELD_NUMBER: _ClassVar[int]
    SUSPECT_TIME_FIELD_NUMBER: _ClassVar[int]
    address: str
    ip: str
    hostname: str
    state: NodeState
    register_time: _timestamp_pb2.Timestamp
    last_seen_time: _timestamp_pb2.Timestamp
    missed_polls: int
    last_error: str
    device_count: int
    suspect: bool
    suspect_reason: str
    suspect_time: _timestamp_pb2.Timestamp
    def __init__(self, address: _Optional[str] = ..., ip: _Optional[str] = ..., hostname: _Optional[str] = ..., state: _Optional[_Union[NodeState, str]] = ..., register_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., last_seen_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., missed_polls: _Optional[int] = ..., last_error: _Optional[str] = ..., device_count: _Optional[int] = ..., suspect: _Optional[bool] = ..., suspect_reason: _Optional[str] = ..., suspect_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class RegisterNodeRequest(_message.Message):
    __slots__ = ("address",)
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    address: str
    def __init__(self, address: _Optional[str] = ...) -> None: ...

class RegisterNodeResponse(_message.Message):
    __slots__ = ("node", "devices")
    NODE_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    node: Node
    devices: _containers.RepeatedCompositeFieldContainer[_common_pb2.Device]
    def __init__(self, node: _Optional[_Union[Node, _Mapping]] = ..., devices: _Optional[_Iterable[_Union[_common_pb2.Device, _Mapping]]] = ...) -> None: ...

class ListNodesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListNodesResponse(_message.Message):
    __slots__ = ("nodes",)
    NODES_FIELD_NUMBER: _ClassVar[int]
    nodes: _containers.RepeatedCompositeFieldContainer[Node]
    def __init__(self, nodes: _Optional[_Iterable[_Union[Node, _Mapping]]] = ...) -> None: ...

class RemoveNodeRequest(_message.Message):
    __slots__ = ("address", "force")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    FORCE_FIELD_NUMBER: _ClassVar[int]
    address: str
    force: bool
    def __init__(self, address: _Optional[str] = ..., force: _Optional[bool] = ...) -> None: ...

class RemoveNodeResponse(_message.Message):
    __slots__ = ("node", "device_ids", "released_reservations")
    NODE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_IDS_FIELD_NUMBER: _ClassVar[int]
    RELEASED_RESERVATIONS_FIELD_NUMBER: _ClassVar[int]
    node: Node
    device_ids: _containers.RepeatedScalarFieldContainer[str]
    released_reservations: _containers.RepeatedCompositeFieldContainer[Reservation]
    def __init__(self, node: _Optional[_Union[Node, _Mapping]] = ..., device_ids: _Optional[_Iterable[str]] = ..., released_reservations: _Optional[_Iterable[_Union[Reservation, _Mapping]]] = ...) -> None: ...

class ListDevicesRequest(_message.Message):
    __slots__ = ("filter", "page_size", "page_token")
    FILTER_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    filter: str
    page_size: int
    page_token: str
    def __init__(self, filter: _Optional[str] = ..., page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class ListDevicesResponse(_message.Message):
    __slots__ = ("devices", "next_page_token")
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    devices: _containers.RepeatedCompositeFieldContainer[_common_pb2.Device]
    next_page_token: str
    def __init__(self, devices: _Optional[_Iterable[_Union[_common_pb2.Device, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class GetDeviceRequest(_message.Message):
    __slots__ = ("device_id", "history_limit")
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    HISTORY_LIMIT_FIELD_NUMBER: _ClassVar[int]
    device_id: str
    history_limit: int
    def __init__(self, device_id: _Optional[str] = ..., history_limit: _Optional[int] = ...) -> None: ...

class GetDeviceResponse(_message.Message):
    __slots__ = ("device", "history")
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    HISTORY_FIELD_NUMBER: _ClassVar[int]
    device: _common_pb2.Device
    history: _containers.RepeatedCompositeFieldContainer[_common_pb2.DeviceStatus]
    def __init__(self, device: _Optional[_Union[_common_pb2.Device, _Mapping]] = ..., history: _Optional[_Iterable[_Union[_common_pb2.DeviceStatus, _Mapping]]] = ...) -> None: ...

class RefreshDevicesRequest(_message.Message):
    __slots__ = ("device_ids",)
    DEVICE_IDS_FIELD_NUMBER: _ClassVar[int]
    device_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, device_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class RefreshDevicesResponse(_message.Message):
    __slots__ = ("devices",)
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    devices: _containers.RepeatedCompositeFieldContainer[_common_pb2.Device]
    def __init__(self, devices: _Optional[_Iterable[_Union[_common_pb2.Device, _Mapping]]] = ...) -> None: ...

class WatchDevicesRequest(_message.Message):
    __slots__ = ("filter", "include_existing")
    FILTER_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_EXISTING_FIELD_NUMBER: _ClassVar[int]
    filter: str
    include_existing: bool
    def __init__(self, filter: _Optional[str] = ..., include_existing: _Optional[bool] = ...) -> None: ...

class WatchDevicesResponse(_message.Message):
    __slots__ = ("type", "device", "event_time")
    TYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    EVENT_TIME_FIELD_NUMBER: _ClassVar[int]
    type: DeviceEventType
    device: _common_pb2.Device
    event_time: _timestamp_pb2.Timestamp
    def __init__(self, type: _Optional[_Union[DeviceEventType, str]] = ..., device: _Optional[_Union[_common_pb2.Device, _Mapping]] = ..., event_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class TaskWeights(_message.Message):
    __slots__ = ("compute", "memory", "bandwidth")
    COMPUTE_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    BANDWIDTH_FIELD_NUMBER: _ClassVar[int]
    compute: float
    memory: float
    bandwidth: float
    def __init__(self, compute: _Optional[float] = ..., memory: _Optional[float] = ..., bandwidth: _Optional[float] = ...) -> None: ...

class TaskProfile(_message.Message):
    __slots__ = ("kind", "precision", "arithmetic_intensity", "weights")
    KIND_FIELD_NUMBER: _ClassVar[int]
    PRECISION_FIELD_NUMBER: _ClassVar[int]
    ARITHMETIC_INTENSITY_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    kind: TaskKind
    precision: str
    arithmetic_intensity: float
    weights: TaskWeights
    def __init__(self, kind: _Optional[_Union[TaskKind, str]] = ..., precision: _Optional[str] = ..., arithmetic_intensity: _Optional[float] = ..., weights: _Optional[_Union[TaskWeights, _Mapping]] = ...) -> None: ...

class StatusComponents(_message.Message):
    __slots__ = ("compute", "memory", "bandwidth")
    COMPUTE_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    BANDWIDTH_FIELD_NUMBER: _ClassVar[int]
    compute: float
    memory: float
    bandwidth: float
    def __init__(self, compute: _Optional[float] = ..., memory: _Optional[float] = ..., bandwidth: _Optional[float] = ...) -> None: ...

class ScoredDevice(_message.Message):
    __slots__ = ("device", "score", "components", "free_compute_tflops")
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    COMPONENTS_FIELD_NUMBER: _ClassVar[int]
    FREE_COMPUTE_TFLOPS_FIELD_NUMBER: _ClassVar[int]
    device: _common_pb2.Device
    score: float
    components: StatusComponents
    free_compute_tflops: float
    def __init__(self, device: _Optional[_Union[_common_pb2.Device, _Mapping]] = ..., score: _Optional[float] = ..., components: _Optional[_Union[StatusComponents, _Mapping]] = ..., free_compute_tflops: _Optional[float] = ...) -> None: ...

class ScoreDevicesRequest(_message.Message):
    __slots__ = ("task", "filter", "limit", "device_ids")
    TASK_FIELD_NUMBER: _ClassVar[int]
    FILTER_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    DEVICE_IDS_FIELD_NUMBER: _ClassVar[int]
    task: TaskProfile
    filter: str
    limit: int
    device_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, task: _Optional[_Union[TaskProfile, _Mapping]] = ..., filter: _Optional[str] = ..., limit: _Optional[int] = ..., device_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class ScoreDevicesResponse(_message.Message):
    __slots__ = ("devices", "weights", "weights_rule")
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_RULE_FIELD_NUMBER: _ClassVar[int]
    devices: _containers.RepeatedCompositeFieldContainer[ScoredDevice]
    weights: TaskWeights
    weights_rule: str
    def __init__(self, devices: _Optional[_Iterable[_Union[ScoredDevice, _Mapping]]] = ..., weights: _Optional[_Union[TaskWeights, _Mapping]] = ..., weights_rule: _Optional[str] = ...) -> None: ...

class DeviceClaim(_message.Message):
    __slots__ = ("device_id", "memory_bytes", "compute_fraction")
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_FRACTION_FIELD_NUMBER: _ClassVar[int]
    device_id: str
    memory_bytes: int
    compute_fraction: float
    def __init__(self, device_id: _Optional[str] = ..., memory_bytes: _Optional[int] = ..., compute_fraction: _Optional[float] = ...) -> None: ...

class Reservation(_message.Message):
    __slots__ = ("job_id", "device_id", "memory_bytes", "compute_fraction", "expire_time")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_FRACTION_FIELD_NUMBER: _ClassVar[int]
    EXPIRE_TIME_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    device_id: str
    memory_bytes: int
    compute_fraction: float
    expire_time: _timestamp_pb2.Timestamp
    def __init__(self, job_id: _Optional[str] = ..., device_id: _Optional[str] = ..., memory_bytes: _Optional[int] = ..., compute_fraction: _Optional[float] = ..., expire_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class ReserveDevicesRequest(_message.Message):
    __slots__ = ("job_id", "claims", "ttl_seconds")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    CLAIMS_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    claims: _containers.RepeatedCompositeFieldContainer[DeviceClaim]
    ttl_seconds: int
    def __init__(self, job_id: _Optional[str] = ..., claims: _Optional[_Iterable[_Union[DeviceClaim, _Mapping]]] = ..., ttl_seconds: _Optional[int] = ...) -> None: ...

class ReserveDevicesResponse(_message.Message):
    __slots__ = ("reservations",)
    RESERVATIONS_FIELD_NUMBER: _ClassVar[int]
    reservations: _containers.RepeatedCompositeFieldContainer[Reservation]
    def __init__(self, reservations: _Optional[_Iterable[_Union[Reservation, _Mapping]]] = ...) -> None: ...

class RenewReservationsRequest(_message.Message):
    __slots__ = ("job_id", "ttl_seconds", "device_ids")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_IDS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    ttl_seconds: int
    device_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, job_id: _Optional[str] = ..., ttl_seconds: _Optional[int] = ..., device_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class RenewReservationsResponse(_message.Message):
    __slots__ = ("renewed_count", "expire_time")
    RENEWED_COUNT_FIELD_NUMBER: _ClassVar[int]
    EXPIRE_TIME_FIELD_NUMBER: _ClassVar[int]
    renewed_count: int
    expire_time: _timestamp_pb2.Timestamp
    def __init__(self, renewed_count: _Optional[int] = ..., expire_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class ReleaseDevicesRequest(_message.Message):
    __slots__ = ("job_id", "device_ids")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_IDS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    device_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, job_id: _Optional[str] = ..., device_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class ReleaseDevicesResponse(_message.Message):
    __slots__ = ("released_count",)
    RELEASED_COUNT_FIELD_NUMBER: _ClassVar[int]
    released_count: int
    def __init__(self, released_count: _Optional[int] = ...) -> None: ...

class ListReservationsRequest(_message.Message):
    __slots__ = ("job_id", "device_id")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    device_id: str
    def __init__(self, job_id: _Optional[str] = ..., device_id: _Optional[str] = ...) -> None: ...

class ListReservationsResponse(_message.Message):
    __slots__ = ("reservations",)
    RESERVATIONS_FIELD_NUMBER: _ClassVar[int]
    reservations: _containers.RepeatedCompositeFieldContainer[Reservation]
    def __init__(self, reservations: _Optional[_Iterable[_Union[Reservation, _Mapping]]] = ...) -> None: ...

class MarkNodeSuspectRequest(_message.Message):
    __slots__ = ("address", "reason")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    address: str
    reason: str
    def __init__(self, address: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class MarkNodeSuspectResponse(_message.Message):
    __slots__ = ("node",)
    NODE_FIELD_NUMBER: _ClassVar[int]
    node: Node
    def __init__(self, node: _Optional[_Union[Node, _Mapping]] = ...) -> None: ...

class TrustNodeRequest(_message.Message):
    __slots__ = ("address",)
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    address: str
    def __init__(self, address: _Optional[str] = ...) -> None: ...

class TrustNodeResponse(_message.Message):
    __slots__ = ("node",)
    NODE_FIELD_NUMBER: _ClassVar[int]
    node: Node
    def __init__(self, node: _Optional[_Union[Node, _Mapping]] = ...) -> None: ...
