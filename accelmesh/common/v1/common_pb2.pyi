import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Platform(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PLATFORM_UNSPECIFIED: _ClassVar[Platform]
    PLATFORM_CPU: _ClassVar[Platform]
    PLATFORM_CUDA: _ClassVar[Platform]
    PLATFORM_ROCM: _ClassVar[Platform]
    PLATFORM_TPU: _ClassVar[Platform]

class DeviceHealth(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DEVICE_HEALTH_UNSPECIFIED: _ClassVar[DeviceHealth]
    DEVICE_HEALTH_HEALTHY: _ClassVar[DeviceHealth]
    DEVICE_HEALTH_LOST: _ClassVar[DeviceHealth]

class DataType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DATA_TYPE_UNSPECIFIED: _ClassVar[DataType]
    DATA_TYPE_FLOAT32: _ClassVar[DataType]
    DATA_TYPE_FLOAT16: _ClassVar[DataType]
    DATA_TYPE_BFLOAT16: _ClassVar[DataType]
    DATA_TYPE_FLOAT64: _ClassVar[DataType]
    DATA_TYPE_INT8: _ClassVar[DataType]
    DATA_TYPE_INT16: _ClassVar[DataType]
    DATA_TYPE_INT32: _ClassVar[DataType]
    DATA_TYPE_INT64: _ClassVar[DataType]
    DATA_TYPE_UINT8: _ClassVar[DataType]
    DATA_TYPE_UINT32: _ClassVar[DataType]
    DATA_TYPE_BOOL: _ClassVar[DataType]

class Precision(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PRECISION_UNSPECIFIED: _ClassVar[Precision]
    PRECISION_FP32: _ClassVar[Precision]
    PRECISION_BF16_ALLOWED: _ClassVar[Precision]
    PRECISION_FP16_ALLOWED: _ClassVar[Precision]
PLATFORM_UNSPECIFIED: Platform
PLATFORM_CPU: Platform
PLATFORM_CUDA: Platform
PLATFORM_ROCM: Platform
PLATFORM_TPU: Platform
DEVICE_HEALTH_UNSPECIFIED: DeviceHealth
DEVICE_HEALTH_HEALTHY: DeviceHealth
DEVICE_HEALTH_LOST: DeviceHealth
DATA_TYPE_UNSPECIFIED: DataType
DATA_TYPE_FLOAT32: DataType
DATA_TYPE_FLOAT16: DataType
DATA_TYPE_BFLOAT16: DataType
DATA_TYPE_FLOAT64: DataType
DATA_TYPE_INT8: DataType
DATA_TYPE_INT16: DataType
DATA_TYPE_INT32: DataType
DATA_TYPE_INT64: DataType
DATA_TYPE_UINT8: DataType
DATA_TYPE_UINT32: DataType
DATA_TYPE_BOOL: DataType
PRECISION_UNSPECIFIED: Precision
PRECISION_FP32: Precision
PRECISION_BF16_ALLOWED: Precision
PRECISION_FP16_ALLOWED: Precision

class Performance(_message.Message):
    __slots__ = ("peak_tflops", "memory_bytes", "memory_bandwidth_gbps", "interconnect", "interconnect_bandwidth_gbps", "estimated")
    class PeakTflopsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    PEAK_TFLOPS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BANDWIDTH_GBPS_FIELD_NUMBER: _ClassVar[int]
    INTERCONNECT_FIELD_NUMBER: _ClassVar[int]
    INTERCONNECT_BANDWIDTH_GBPS_FIELD_NUMBER: _ClassVar[int]
    ESTIMATED_FIELD_NUMBER: _ClassVar[int]
    peak_tflops: _containers.ScalarMap[str, float]
    memory_bytes: int
    memory_bandwidth_gbps: float
    interconnect: str
    interconnect_bandwidth_gbps: float
    estimated: bool
    def __init__(self, peak_tflops: _Optional[_Mapping[str, float]] = ..., memory_bytes: _Optional[int] = ..., memory_bandwidth_gbps: _Optional[float] = ..., interconnect: _Optional[str] = ..., interconnect_bandwidth_gbps: _Optional[float] = ..., estimated: _Optional[bool] = ...) -> None: ...

class DeviceStatus(_message.Message):
    __slots__ = ("sample_time", "memory_total_bytes", "memory_used_bytes", "memory_reserved_bytes", "memory_free_bytes", "utilization", "reserved_compute_fraction", "temperature_c", "power_w")
    SAMPLE_TIME_FIELD_NUMBER: _ClassVar[int]
    MEMORY_TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_RESERVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FREE_BYTES_FIELD_NUMBER: _ClassVar[int]
    UTILIZATION_FIELD_NUMBER: _ClassVar[int]
    RESERVED_COMPUTE_FRACTION_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_C_FIELD_NUMBER: _ClassVar[int]
    POWER_W_FIELD_NUMBER: _ClassVar[int]
    sample_time: _timestamp_pb2.Timestamp
    memory_total_bytes: int
    memory_used_bytes: int
    memory_reserved_bytes: int
    memory_free_bytes: int
    utilization: float
    reserved_compute_fraction: float
    temperature_c: float
    power_w: float
    def __init__(self, sample_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., memory_total_bytes: _Optional[int] = ..., memory_used_bytes: _Optional[int] = ..., memory_reserved_bytes: _Optional[int] = ..., memory_free_bytes: _Optional[int] = ..., utilization: _Optional[float] = ..., reserved_compute_fraction: _Optional[float] = ..., temperature_c: _Optional[float] = ..., power_w: _Optional[float] = ...) -> None: ...

class Device(_message.Message):
    __slots__ = ("id", "node_ip", "local_index", "platform", "kind", "type", "capabilities", "compute_capability", "performance", "emulated", "execution_device", "health", "status", "node_address")
    ID_FIELD_NUMBER: _ClassVar[int]
    NODE_IP_FIELD_NUMBER: _ClassVar[int]
    LOCAL_INDEX_FIELD_NUMBER: _ClassVar[int]
    PLATFORM_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    CAPABILITIES_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_CAPABILITY_FIELD_NUMBER: _ClassVar[int]
    PERFORMANCE_FIELD_NUMBER: _ClassVar[int]
    EMULATED_FIELD_NUMBER: _ClassVar[int]
    EXECUTION_DEVICE_FIELD_NUMBER: _ClassVar[int]
    HEALTH_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    NODE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    id: str
    node_ip: str
    local_index: int
    platform: Platform
    kind: str
    type: str
    capabilities: _containers.RepeatedScalarFieldContainer[str]
    compute_capability: str
    performance: Performance
    emulated: bool
    execution_device: str
    health: DeviceHealth
    status: DeviceStatus
    node_address: str
    def __init__(self, id: _Optional[str] = ..., node_ip: _Optional[str] = ..., local_index: _Optional[int] = ..., platform: _Optional[_Union[Platform, str]] = ..., kind: _Optional[str] = ..., type: _Optional[str] = ..., capabilities: _Optional[_Iterable[str]] = ..., compute_capability: _Optional[str] = ..., performance: _Optional[_Union[Performance, _Mapping]] = ..., emulated: _Optional[bool] = ..., execution_device: _Optional[str] = ..., health: _Optional[_Union[DeviceHealth, str]] = ..., status: _Optional[_Union[DeviceStatus, _Mapping]] = ..., node_address: _Optional[str] = ...) -> None: ...

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "data")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    dtype: DataType
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, dtype: _Optional[_Union[DataType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class TensorHeader(_message.Message):
    __slots__ = ("name", "dtype", "shape", "total_bytes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: DataType
    shape: _containers.RepeatedScalarFieldContainer[int]
    total_bytes: int
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[_Union[DataType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., total_bytes: _Optional[int] = ...) -> None: ...

class TensorChunk(_message.Message):
    __slots__ = ("name", "offset", "data")
    NAME_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    name: str
    offset: int
    data: bytes
    def __init__(self, name: _Optional[str] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...
