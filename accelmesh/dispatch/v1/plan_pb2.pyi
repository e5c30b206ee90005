from accelmesh.inventory.v1 import inventory_service_pb2 as _inventory_service_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PlacementStrategy(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PLACEMENT_STRATEGY_UNSPECIFIED: _ClassVar[PlacementStrategy]
    PLACEMENT_STRATEGY_RANKED: _ClassVar[PlacementStrategy]
    PLACEMENT_STRATEGY_BALANCED: _ClassVar[PlacementStrategy]
    PLACEMENT_STRATEGY_AUTO: _ClassVar[PlacementStrategy]
PLACEMENT_STRATEGY_UNSPECIFIED: PlacementStrategy
PLACEMENT_STRATEGY_RANKED: PlacementStrategy
PLACEMENT_STRATEGY_BALANCED: PlacementStrategy
PLACEMENT_STRATEGY_AUTO: PlacementStrategy

class LayerCost(_message.Message):
    __slots__ = ("name", "order", "parameter_count", "parameter_bytes", "flops_per_sample", "bytes_accessed_per_sample", "activation_bytes_per_sample", "shared_from", "shared_parameter_bytes", "buffer_bytes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ORDER_FIELD_NUMBER: _ClassVar[int]
    PARAMETER_COUNT_FIELD_NUMBER: _ClassVar[int]
    PARAMETER_BYTES_FIELD_NUMBER: _ClassVar[int]
    FLOPS_PER_SAMPLE_FIELD_NUMBER: _ClassVar[int]
    BYTES_ACCESSED_PER_SAMPLE_FIELD_NUMBER: _ClassVar[int]
    ACTIVATION_BYTES_PER_SAMPLE_FIELD_NUMBER: _ClassVar[int]
    SHARED_FROM_FIELD_NUMBER: _ClassVar[int]
    SHARED_PARAMETER_BYTES_FIELD_NUMBER: _ClassVar[int]
    BUFFER_BYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    order: int
    parameter_count: int
    parameter_bytes: int
    flops_per_sample: float
    bytes_accessed_per_sample: float
    activation_bytes_per_sample: int
    shared_from: str
    shared_parameter_bytes: int
    buffer_bytes: int
    def __init__(self, name: _Optional[str] = ..., order: _Optional[int] = ..., parameter_count: _Optional[int] = ..., parameter_bytes: _Optional[int] = ..., flops_per_sample: _Optional[float] = ..., bytes_accessed_per_sample: _Optional[float] = ..., activation_bytes_per_sample: _Optional[int] = ..., shared_from: _Optional[str] = ..., shared_parameter_bytes: _Optional[int] = ..., buffer_bytes: _Optional[int] = ...) -> None: ...

class PlacementOptions(_message.Message):
    __slots__ = ("strategy", "device_count", "memory_headroom", "weights", "micro_batch_rows", "layers")
    STRATEGY_FIELD_NUMBER: _ClassVar[int]
    DEVICE_COUNT_FIELD_NUMBER: _ClassVar[int]
    MEMORY_HEADROOM_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    MICRO_BATCH_ROWS_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    strategy: PlacementStrategy
    device_count: int
    memory_headroom: float
    weights: _inventory_service_pb2.TaskWeights
    micro_batch_rows: int
    layers: _containers.RepeatedCompositeFieldContainer[LayerCost]
    def __init__(self, strategy: _Optional[_Union[PlacementStrategy, str]] = ..., device_count: _Optional[int] = ..., memory_headroom: _Optional[float] = ..., weights: _Optional[_Union[_inventory_service_pb2.TaskWeights, _Mapping]] = ..., micro_batch_rows: _Optional[int] = ..., layers: _Optional[_Iterable[_Union[LayerCost, _Mapping]]] = ...) -> None: ...

class TargetPlan(_message.Message):
    __slots__ = ("target_type", "rule", "compute_dtype", "artifact_key", "device_ids", "rows_per_second", "rate_source", "fixed_seconds", "rate_samples", "residual_seconds")
    TARGET_TYPE_FIELD_NUMBER: _ClassVar[int]
    RULE_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    ARTIFACT_KEY_FIELD_NUMBER: _ClassVar[int]
    DEVICE_IDS_FIELD_NUMBER: _ClassVar[int]
    ROWS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    RATE_SOURCE_FIELD_NUMBER: _ClassVar[int]
    FIXED_SECONDS_FIELD_NUMBER: _ClassVar[int]
    RATE_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    RESIDUAL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    target_type: str
    rule: str
    compute_dtype: str
    artifact_key: str
    device_ids: _containers.RepeatedScalarFieldContainer[str]
    rows_per_second: float
    rate_source: str
    fixed_seconds: float
    rate_samples: int
    residual_seconds: float
    def __init__(self, target_type: _Optional[str] = ..., rule: _Optional[str] = ..., compute_dtype: _Optional[str] = ..., artifact_key: _Optional[str] = ..., device_ids: _Optional[_Iterable[str]] = ..., rows_per_second: _Optional[float] = ..., rate_source: _Optional[str] = ..., fixed_seconds: _Optional[float] = ..., rate_samples: _Optional[int] = ..., residual_seconds: _Optional[float] = ...) -> None: ...

class ShardPlan(_message.Message):
    __slots__ = ("index", "device_id", "target_type", "first_row", "rows", "predicted_seconds")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    TARGET_TYPE_FIELD_NUMBER: _ClassVar[int]
    FIRST_ROW_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_SECONDS_FIELD_NUMBER: _ClassVar[int]
    index: int
    device_id: str
    target_type: str
    first_row: int
    rows: int
    predicted_seconds: float
    def __init__(self, index: _Optional[int] = ..., device_id: _Optional[str] = ..., target_type: _Optional[str] = ..., first_row: _Optional[int] = ..., rows: _Optional[int] = ..., predicted_seconds: _Optional[float] = ...) -> None: ...

class Plan(_message.Message):
    __slots__ = ("targets", "shards", "predicted_seconds", "equal_split_predicted_seconds", "placement")
    TARGETS_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_SECONDS_FIELD_NUMBER: _ClassVar[int]
    EQUAL_SPLIT_PREDICTED_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_FIELD_NUMBER: _ClassVar[int]
    targets: _containers.RepeatedCompositeFieldContainer[TargetPlan]
    shards: _containers.RepeatedCompositeFieldContainer[ShardPlan]
    predicted_seconds: float
    equal_split_predicted_seconds: float
    placement: Placement
    def __init__(self, targets: _Optional[_Iterable[_Union[TargetPlan, _Mapping]]] = ..., shards: _Optional[_Iterable[_Union[ShardPlan, _Mapping]]] = ..., predicted_seconds: _Optional[float] = ..., equal_split_predicted_seconds: _Optional[float] = ..., placement: _Optional[_Union[Placement, _Mapping]] = ...) -> None: ...

class LayerPlacement(_message.Message):
    __slots__ = ("layer", "order", "device_id", "target_type", "parameter_count", "memory_bytes", "compute_seconds", "stage")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    ORDER_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    TARGET_TYPE_FIELD_NUMBER: _ClassVar[int]
    PARAMETER_COUNT_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    layer: str
    order: int
    device_id: str
    target_type: str
    parameter_count: int
    memory_bytes: int
    compute_seconds: float
    stage: int
    def __init__(self, layer: _Optional[str] = ..., order: _Optional[int] = ..., device_id: _Optional[str] = ..., target_type: _Optional[str] = ..., parameter_count: _Optional[int] = ..., memory_bytes: _Optional[int] = ..., compute_seconds: _Optional[float] = ..., stage: _Optional[int] = ...) -> None: ...

class StagePlan(_message.Message):
    __slots__ = ("index", "device_id", "target_type", "first_layer", "layer_count", "compute_seconds", "transfer_seconds", "artifact_key", "rule", "replica_device_ids", "micro_batch_shares")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    TARGET_TYPE_FIELD_NUMBER: _ClassVar[int]
    FIRST_LAYER_FIELD_NUMBER: _ClassVar[int]
    LAYER_COUNT_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ARTIFACT_KEY_FIELD_NUMBER: _ClassVar[int]
    RULE_FIELD_NUMBER: _ClassVar[int]
    REPLICA_DEVICE_IDS_FIELD_NUMBER: _ClassVar[int]
    MICRO_BATCH_SHARES_FIELD_NUMBER: _ClassVar[int]
    index: int
    device_id: str
    target_type: str
    first_layer: int
    layer_count: int
    compute_seconds: float
    transfer_seconds: float
    artifact_key: str
    rule: str
    replica_device_ids: _containers.RepeatedScalarFieldContainer[str]
    micro_batch_shares: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, index: _Optional[int] = ..., device_id: _Optional[str] = ..., target_type: _Optional[str] = ..., first_layer: _Optional[int] = ..., layer_count: _Optional[int] = ..., compute_seconds: _Optional[float] = ..., transfer_seconds: _Optional[float] = ..., artifact_key: _Optional[str] = ..., rule: _Optional[str] = ..., replica_device_ids: _Optional[_Iterable[str]] = ..., micro_batch_shares: _Optional[_Iterable[float]] = ...) -> None: ...

class DeviceLoad(_message.Message):
    __slots__ = ("device_id", "target_type", "memory_bytes", "memory_capacity_bytes", "compute_seconds", "transfer_seconds", "layers", "score")
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    TARGET_TYPE_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    device_id: str
    target_type: str
    memory_bytes: int
    memory_capacity_bytes: int
    compute_seconds: float
    transfer_seconds: float
    layers: _containers.RepeatedScalarFieldContainer[str]
    score: float
    def __init__(self, device_id: _Optional[str] = ..., target_type: _Optional[str] = ..., memory_bytes: _Optional[int] = ..., memory_capacity_bytes: _Optional[int] = ..., compute_seconds: _Optional[float] = ..., transfer_seconds: _Optional[float] = ..., layers: _Optional[_Iterable[str]] = ..., score: _Optional[float] = ...) -> None: ...

class PlacementSummary(_message.Message):
    __slots__ = ("strategy", "feasible", "predicted_step_seconds", "cross_device_transfers", "device_count", "error", "devices")
    STRATEGY_FIELD_NUMBER: _ClassVar[int]
    FEASIBLE_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_STEP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    CROSS_DEVICE_TRANSFERS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_COUNT_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    strategy: PlacementStrategy
    feasible: bool
    predicted_step_seconds: float
    cross_device_transfers: int
    device_count: int
    error: str
    devices: _containers.RepeatedCompositeFieldContainer[DeviceLoad]
    def __init__(self, strategy: _Optional[_Union[PlacementStrategy, str]] = ..., feasible: _Optional[bool] = ..., predicted_step_seconds: _Optional[float] = ..., cross_device_transfers: _Optional[int] = ..., device_count: _Optional[int] = ..., error: _Optional[str] = ..., devices: _Optional[_Iterable[_Union[DeviceLoad, _Mapping]]] = ...) -> None: ...

class Placement(_message.Message):
    __slots__ = ("strategy", "layers", "stages", "devices", "predicted_step_seconds", "cross_device_transfers", "device_count", "micro_batch_rows", "micro_batches", "predicted_seconds", "lower_bound_step_seconds", "weights", "weights_rule", "candidates", "explain", "lower_bound_offered_step_seconds")
    STRATEGY_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    STAGES_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_STEP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    CROSS_DEVICE_TRANSFERS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_COUNT_FIELD_NUMBER: _ClassVar[int]
    MICRO_BATCH_ROWS_FIELD_NUMBER: _ClassVar[int]
    MICRO_BATCHES_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LOWER_BOUND_STEP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_RULE_FIELD_NUMBER: _ClassVar[int]
    CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    EXPLAIN_FIELD_NUMBER: _ClassVar[int]
    LOWER_BOUND_OFFERED_STEP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    strategy: PlacementStrategy
    layers: _containers.RepeatedCompositeFieldContainer[LayerPlacement]
    stages: _containers.RepeatedCompositeFieldContainer[StagePlan]
    devices: _containers.RepeatedCompositeFieldContainer[DeviceLoad]
    predicted_step_seconds: float
    cross_device_transfers: int
    device_count: int
    micro_batch_rows: int
    micro_batches: int
    predicted_seconds: float
    lower_bound_step_seconds: float
    weights: _inventory_service_pb2.TaskWeights
    weights_rule: str
    candidates: _containers.RepeatedCompositeFieldContainer[PlacementSummary]
    explain: _containers.RepeatedScalarFieldContainer[str]
    lower_bound_offered_step_seconds: float
    def __init__(self, strategy: _Optional[_Union[PlacementStrategy, str]] = ..., layers: _Optional[_Iterable[_Union[LayerPlacement, _Mapping]]] = ..., stages: _Optional[_Iterable[_Union[StagePlan, _Mapping]]] = ..., devices: _Optional[_Iterable[_Union[DeviceLoad, _Mapping]]] = ..., predicted_step_seconds: _Optional[float] = ..., cross_device_transfers: _Optional[int] = ..., device_count: _Optional[int] = ..., micro_batch_rows: _Optional[int] = ..., micro_batches: _Optional[int] = ..., predicted_seconds: _Optional[float] = ..., lower_bound_step_seconds: _Optional[float] = ..., weights: _Optional[_Union[_inventory_service_pb2.TaskWeights, _Mapping]] = ..., weights_rule: _Optional[str] = ..., candidates: _Optional[_Iterable[_Union[PlacementSummary, _Mapping]]] = ..., explain: _Optional[_Iterable[str]] = ..., lower_bound_offered_step_seconds: _Optional[float] = ...) -> None: ...
