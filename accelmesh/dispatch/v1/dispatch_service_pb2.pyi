import datetime

from accelmesh.common.v1 import common_pb2 as _common_pb2
from accelmesh.inventory.v1 import inventory_service_pb2 as _inventory_service_pb2
from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class JobKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    JOB_KIND_UNSPECIFIED: _ClassVar[JobKind]
    JOB_KIND_INFERENCE: _ClassVar[JobKind]
    JOB_KIND_TRAINING: _ClassVar[JobKind]

class PlacementStrategy(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PLACEMENT_STRATEGY_UNSPECIFIED: _ClassVar[PlacementStrategy]
    PLACEMENT_STRATEGY_RANKED: _ClassVar[PlacementStrategy]
    PLACEMENT_STRATEGY_BALANCED: _ClassVar[PlacementStrategy]
    PLACEMENT_STRATEGY_AUTO: _ClassVar[PlacementStrategy]

class JobState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    JOB_STATE_UNSPECIFIED: _ClassVar[JobState]
    JOB_STATE_PLANNING: _ClassVar[JobState]
    JOB_STATE_COMPILING: _ClassVar[JobState]
    JOB_STATE_RUNNING: _ClassVar[JobState]
    JOB_STATE_SUCCEEDED: _ClassVar[JobState]
    JOB_STATE_FAILED: _ClassVar[JobState]
    JOB_STATE_CANCELLED: _ClassVar[JobState]

class JobEventType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    JOB_EVENT_TYPE_UNSPECIFIED: _ClassVar[JobEventType]
    JOB_EVENT_TYPE_PLANNED: _ClassVar[JobEventType]
    JOB_EVENT_TYPE_COMPILED: _ClassVar[JobEventType]
    JOB_EVENT_TYPE_SHARD_STARTED: _ClassVar[JobEventType]
    JOB_EVENT_TYPE_SHARD_FINISHED: _ClassVar[JobEventType]
    JOB_EVENT_TYPE_SHARD_RETRIED: _ClassVar[JobEventType]
    JOB_EVENT_TYPE_TRAINING_STEP: _ClassVar[JobEventType]
    JOB_EVENT_TYPE_SUCCEEDED: _ClassVar[JobEventType]
    JOB_EVENT_TYPE_FAILED: _ClassVar[JobEventType]
    JOB_EVENT_TYPE_CANCELLED: _ClassVar[JobEventType]
JOB_KIND_UNSPECIFIED: JobKind
JOB_KIND_INFERENCE: JobKind
JOB_KIND_TRAINING: JobKind
PLACEMENT_STRATEGY_UNSPECIFIED: PlacementStrategy
PLACEMENT_STRATEGY_RANKED: PlacementStrategy
PLACEMENT_STRATEGY_BALANCED: PlacementStrategy
PLACEMENT_STRATEGY_AUTO: PlacementStrategy
JOB_STATE_UNSPECIFIED: JobState
JOB_STATE_PLANNING: JobState
JOB_STATE_COMPILING: JobState
JOB_STATE_RUNNING: JobState
JOB_STATE_SUCCEEDED: JobState
JOB_STATE_FAILED: JobState
JOB_STATE_CANCELLED: JobState
JOB_EVENT_TYPE_UNSPECIFIED: JobEventType
JOB_EVENT_TYPE_PLANNED: JobEventType
JOB_EVENT_TYPE_COMPILED: JobEventType
JOB_EVENT_TYPE_SHARD_STARTED: JobEventType
JOB_EVENT_TYPE_SHARD_FINISHED: JobEventType
JOB_EVENT_TYPE_SHARD_RETRIED: JobEventType
JOB_EVENT_TYPE_TRAINING_STEP: JobEventType
JOB_EVENT_TYPE_SUCCEEDED: JobEventType
JOB_EVENT_TYPE_FAILED: JobEventType
JOB_EVENT_TYPE_CANCELLED: JobEventType

class JobConstraints(_message.Message):
    __slots__ = ("platforms", "required_capabilities", "max_devices", "filter")
    PLATFORMS_FIELD_NUMBER: _ClassVar[int]
    REQUIRED_CAPABILITIES_FIELD_NUMBER: _ClassVar[int]
    MAX_DEVICES_FIELD_NUMBER: _ClassVar[int]
    FILTER_FIELD_NUMBER: _ClassVar[int]
    platforms: _containers.RepeatedScalarFieldContainer[_common_pb2.Platform]
    required_capabilities: _containers.RepeatedScalarFieldContainer[str]
    max_devices: int
    filter: str
    def __init__(self, platforms: _Optional[_Iterable[_Union[_common_pb2.Platform, str]]] = ..., required_capabilities: _Optional[_Iterable[str]] = ..., max_devices: _Optional[int] = ..., filter: _Optional[str] = ...) -> None: ...

class TrainingOptions(_message.Message):
    __slots__ = ("epochs", "batch_size", "learning_rate", "momentum", "shuffle_seed")
    EPOCHS_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    LEARNING_RATE_FIELD_NUMBER: _ClassVar[int]
    MOMENTUM_FIELD_NUMBER: _ClassVar[int]
    SHUFFLE_SEED_FIELD_NUMBER: _ClassVar[int]
    epochs: int
    batch_size: int
    learning_rate: float
    momentum: float
    shuffle_seed: int
    def __init__(self, epochs: _Optional[int] = ..., batch_size: _Optional[int] = ..., learning_rate: _Optional[float] = ..., momentum: _Optional[float] = ..., shuffle_seed: _Optional[int] = ...) -> None: ...

class JobSpec(_message.Message):
    __slots__ = ("program", "version", "kind", "constraints", "inputs", "client_parameters", "parameter_seed", "training", "name", "placement")
    PROGRAM_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINTS_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    CLIENT_PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    PARAMETER_SEED_FIELD_NUMBER: _ClassVar[int]
    TRAINING_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_FIELD_NUMBER: _ClassVar[int]
    program: str
    version: str
    kind: JobKind
    constraints: JobConstraints
    inputs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TensorHeader]
    client_parameters: bool
    parameter_seed: int
    training: TrainingOptions
    name: str
    placement: PlacementOptions
    def __init__(self, program: _Optional[str] = ..., version: _Optional[str] = ..., kind: _Optional[_Union[JobKind, str]] = ..., constraints: _Optional[_Union[JobConstraints, _Mapping]] = ..., inputs: _Optional[_Iterable[_Union[_common_pb2.TensorHeader, _Mapping]]] = ..., client_parameters: _Optional[bool] = ..., parameter_seed: _Optional[int] = ..., training: _Optional[_Union[TrainingOptions, _Mapping]] = ..., name: _Optional[str] = ..., placement: _Optional[_Union[PlacementOptions, _Mapping]] = ...) -> None: ...

class LayerCost(_message.Message):
    __slots__ = ("name", "order", "parameter_count", "parameter_bytes", "flops_per_sample", "bytes_accessed_per_sample", "activation_bytes_per_sample", "shared_from", "shared_parameter_bytes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ORDER_FIELD_NUMBER: _ClassVar[int]
    PARAMETER_COUNT_FIELD_NUMBER: _ClassVar[int]
    PARAMETER_BYTES_FIELD_NUMBER: _ClassVar[int]
    FLOPS_PER_SAMPLE_FIELD_NUMBER: _ClassVar[int]
    BYTES_ACCESSED_PER_SAMPLE_FIELD_NUMBER: _ClassVar[int]
    ACTIVATION_BYTES_PER_SAMPLE_FIELD_NUMBER: _ClassVar[int]
    SHARED_FROM_FIELD_NUMBER: _ClassVar[int]
    SHARED_PARAMETER_BYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    order: int
    parameter_count: int
    parameter_bytes: int
    flops_per_sample: float
    bytes_accessed_per_sample: float
    activation_bytes_per_sample: int
    shared_from: str
    shared_parameter_bytes: int
    def __init__(self, name: _Optional[str] = ..., order: _Optional[int] = ..., parameter_count: _Optional[int] = ..., parameter_bytes: _Optional[int] = ..., flops_per_sample: _Optional[float] = ..., bytes_accessed_per_sample: _Optional[float] = ..., activation_bytes_per_sample: _Optional[int] = ..., shared_from: _Optional[str] = ..., shared_parameter_bytes: _Optional[int] = ...) -> None: ...

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

class InputBlock(_message.Message):
    __slots__ = ("first_row", "tensors")
    FIRST_ROW_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    first_row: int
    tensors: _containers.RepeatedCompositeFieldContainer[_common_pb2.Tensor]
    def __init__(self, first_row: _Optional[int] = ..., tensors: _Optional[_Iterable[_Union[_common_pb2.Tensor, _Mapping]]] = ...) -> None: ...

class SubmitJobRequest(_message.Message):
    __slots__ = ("spec", "parameter", "parameter_chunk", "block")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    PARAMETER_FIELD_NUMBER: _ClassVar[int]
    PARAMETER_CHUNK_FIELD_NUMBER: _ClassVar[int]
    BLOCK_FIELD_NUMBER: _ClassVar[int]
    spec: JobSpec
    parameter: _common_pb2.TensorHeader
    parameter_chunk: _common_pb2.TensorChunk
    block: InputBlock
    def __init__(self, spec: _Optional[_Union[JobSpec, _Mapping]] = ..., parameter: _Optional[_Union[_common_pb2.TensorHeader, _Mapping]] = ..., parameter_chunk: _Optional[_Union[_common_pb2.TensorChunk, _Mapping]] = ..., block: _Optional[_Union[InputBlock, _Mapping]] = ...) -> None: ...

class SubmitJobResponse(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class RunJobRequest(_message.Message):
    __slots__ = ("spec", "parameter", "parameter_chunk", "block")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    PARAMETER_FIELD_NUMBER: _ClassVar[int]
    PARAMETER_CHUNK_FIELD_NUMBER: _ClassVar[int]
    BLOCK_FIELD_NUMBER: _ClassVar[int]
    spec: JobSpec
    parameter: _common_pb2.TensorHeader
    parameter_chunk: _common_pb2.TensorChunk
    block: InputBlock
    def __init__(self, spec: _Optional[_Union[JobSpec, _Mapping]] = ..., parameter: _Optional[_Union[_common_pb2.TensorHeader, _Mapping]] = ..., parameter_chunk: _Optional[_Union[_common_pb2.TensorChunk, _Mapping]] = ..., block: _Optional[_Union[InputBlock, _Mapping]] = ...) -> None: ...

class RunJobResponse(_message.Message):
    __slots__ = ("event", "tensor", "chunk", "job")
    EVENT_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    event: JobEvent
    tensor: _common_pb2.TensorHeader
    chunk: _common_pb2.TensorChunk
    job: Job
    def __init__(self, event: _Optional[_Union[JobEvent, _Mapping]] = ..., tensor: _Optional[_Union[_common_pb2.TensorHeader, _Mapping]] = ..., chunk: _Optional[_Union[_common_pb2.TensorChunk, _Mapping]] = ..., job: _Optional[_Union[Job, _Mapping]] = ...) -> None: ...

class JobEvent(_message.Message):
    __slots__ = ("index", "type", "time", "progress", "message", "plan", "shard", "step", "loss")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    PLAN_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    index: int
    type: JobEventType
    time: _timestamp_pb2.Timestamp
    progress: float
    message: str
    plan: Plan
    shard: ShardRecord
    step: int
    loss: float
    def __init__(self, index: _Optional[int] = ..., type: _Optional[_Union[JobEventType, str]] = ..., time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., progress: _Optional[float] = ..., message: _Optional[str] = ..., plan: _Optional[_Union[Plan, _Mapping]] = ..., shard: _Optional[_Union[ShardRecord, _Mapping]] = ..., step: _Optional[int] = ..., loss: _Optional[float] = ...) -> None: ...

class TargetPlan(_message.Message):
    __slots__ = ("target_type", "rule", "compute_dtype", "artifact_key", "device_ids", "rows_per_second", "rate_source")
    TARGET_TYPE_FIELD_NUMBER: _ClassVar[int]
    RULE_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    ARTIFACT_KEY_FIELD_NUMBER: _ClassVar[int]
    DEVICE_IDS_FIELD_NUMBER: _ClassVar[int]
    ROWS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    RATE_SOURCE_FIELD_NUMBER: _ClassVar[int]
    target_type: str
    rule: str
    compute_dtype: str
    artifact_key: str
    device_ids: _containers.RepeatedScalarFieldContainer[str]
    rows_per_second: float
    rate_source: str
    def __init__(self, target_type: _Optional[str] = ..., rule: _Optional[str] = ..., compute_dtype: _Optional[str] = ..., artifact_key: _Optional[str] = ..., device_ids: _Optional[_Iterable[str]] = ..., rows_per_second: _Optional[float] = ..., rate_source: _Optional[str] = ...) -> None: ...

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
    __slots__ = ("index", "device_id", "target_type", "first_layer", "layer_count", "compute_seconds", "transfer_seconds", "artifact_key", "rule")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    TARGET_TYPE_FIELD_NUMBER: _ClassVar[int]
    FIRST_LAYER_FIELD_NUMBER: _ClassVar[int]
    LAYER_COUNT_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ARTIFACT_KEY_FIELD_NUMBER: _ClassVar[int]
    RULE_FIELD_NUMBER: _ClassVar[int]
    index: int
    device_id: str
    target_type: str
    first_layer: int
    layer_count: int
    compute_seconds: float
    transfer_seconds: float
    artifact_key: str
    rule: str
    def __init__(self, index: _Optional[int] = ..., device_id: _Optional[str] = ..., target_type: _Optional[str] = ..., first_layer: _Optional[int] = ..., layer_count: _Optional[int] = ..., compute_seconds: _Optional[float] = ..., transfer_seconds: _Optional[float] = ..., artifact_key: _Optional[str] = ..., rule: _Optional[str] = ...) -> None: ...

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
    __slots__ = ("strategy", "layers", "stages", "devices", "predicted_step_seconds", "cross_device_transfers", "device_count", "micro_batch_rows", "micro_batches", "predicted_seconds", "lower_bound_step_seconds", "weights", "weights_rule", "candidates", "explain")
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
    def __init__(self, strategy: _Optional[_Union[PlacementStrategy, str]] = ..., layers: _Optional[_Iterable[_Union[LayerPlacement, _Mapping]]] = ..., stages: _Optional[_Iterable[_Union[StagePlan, _Mapping]]] = ..., devices: _Optional[_Iterable[_Union[DeviceLoad, _Mapping]]] = ..., predicted_step_seconds: _Optional[float] = ..., cross_device_transfers: _Optional[int] = ..., device_count: _Optional[int] = ..., micro_batch_rows: _Optional[int] = ..., micro_batches: _Optional[int] = ..., predicted_seconds: _Optional[float] = ..., lower_bound_step_seconds: _Optional[float] = ..., weights: _Optional[_Union[_inventory_service_pb2.TaskWeights, _Mapping]] = ..., weights_rule: _Optional[str] = ..., candidates: _Optional[_Iterable[_Union[PlacementSummary, _Mapping]]] = ..., explain: _Optional[_Iterable[str]] = ...) -> None: ...

class ShardRecord(_message.Message):
    __slots__ = ("index", "device_id", "target_type", "rule", "first_row", "rows", "attempts", "failures", "queue_seconds", "load_seconds", "execute_seconds", "total_seconds", "done")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    TARGET_TYPE_FIELD_NUMBER: _ClassVar[int]
    RULE_FIELD_NUMBER: _ClassVar[int]
    FIRST_ROW_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    ATTEMPTS_FIELD_NUMBER: _ClassVar[int]
    FAILURES_FIELD_NUMBER: _ClassVar[int]
    QUEUE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LOAD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    EXECUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    index: int
    device_id: str
    target_type: str
    rule: str
    first_row: int
    rows: int
    attempts: int
    failures: _containers.RepeatedScalarFieldContainer[str]
    queue_seconds: float
    load_seconds: float
    execute_seconds: float
    total_seconds: float
    done: bool
    def __init__(self, index: _Optional[int] = ..., device_id: _Optional[str] = ..., target_type: _Optional[str] = ..., rule: _Optional[str] = ..., first_row: _Optional[int] = ..., rows: _Optional[int] = ..., attempts: _Optional[int] = ..., failures: _Optional[_Iterable[str]] = ..., queue_seconds: _Optional[float] = ..., load_seconds: _Optional[float] = ..., execute_seconds: _Optional[float] = ..., total_seconds: _Optional[float] = ..., done: _Optional[bool] = ...) -> None: ...

class Job(_message.Message):
    __slots__ = ("job_id", "spec", "state", "plan", "shards", "error", "progress", "create_time", "end_time", "losses", "expire_time")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    PLAN_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    CREATE_TIME_FIELD_NUMBER: _ClassVar[int]
    END_TIME_FIELD_NUMBER: _ClassVar[int]
    LOSSES_FIELD_NUMBER: _ClassVar[int]
    EXPIRE_TIME_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    spec: JobSpec
    state: JobState
    plan: Plan
    shards: _containers.RepeatedCompositeFieldContainer[ShardRecord]
    error: str
    progress: float
    create_time: _timestamp_pb2.Timestamp
    end_time: _timestamp_pb2.Timestamp
    losses: _containers.RepeatedScalarFieldContainer[float]
    expire_time: _timestamp_pb2.Timestamp
    def __init__(self, job_id: _Optional[str] = ..., spec: _Optional[_Union[JobSpec, _Mapping]] = ..., state: _Optional[_Union[JobState, str]] = ..., plan: _Optional[_Union[Plan, _Mapping]] = ..., shards: _Optional[_Iterable[_Union[ShardRecord, _Mapping]]] = ..., error: _Optional[str] = ..., progress: _Optional[float] = ..., create_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., end_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., losses: _Optional[_Iterable[float]] = ..., expire_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class PlanJobRequest(_message.Message):
    __slots__ = ("spec",)
    SPEC_FIELD_NUMBER: _ClassVar[int]
    spec: JobSpec
    def __init__(self, spec: _Optional[_Union[JobSpec, _Mapping]] = ...) -> None: ...

class PlanJobResponse(_message.Message):
    __slots__ = ("plan",)
    PLAN_FIELD_NUMBER: _ClassVar[int]
    plan: Plan
    def __init__(self, plan: _Optional[_Union[Plan, _Mapping]] = ...) -> None: ...

class WatchJobRequest(_message.Message):
    __slots__ = ("job_id", "from_index")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    FROM_INDEX_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    from_index: int
    def __init__(self, job_id: _Optional[str] = ..., from_index: _Optional[int] = ...) -> None: ...

class WatchJobResponse(_message.Message):
    __slots__ = ("event",)
    EVENT_FIELD_NUMBER: _ClassVar[int]
    event: JobEvent
    def __init__(self, event: _Optional[_Union[JobEvent, _Mapping]] = ...) -> None: ...

class GetJobRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class GetJobResponse(_message.Message):
    __slots__ = ("job",)
    JOB_FIELD_NUMBER: _ClassVar[int]
    job: Job
    def __init__(self, job: _Optional[_Union[Job, _Mapping]] = ...) -> None: ...

class ListJobsRequest(_message.Message):
    __slots__ = ("page_size",)
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    page_size: int
    def __init__(self, page_size: _Optional[int] = ...) -> None: ...

class ListJobsResponse(_message.Message):
    __slots__ = ("jobs",)
    JOBS_FIELD_NUMBER: _ClassVar[int]
    jobs: _containers.RepeatedCompositeFieldContainer[Job]
    def __init__(self, jobs: _Optional[_Iterable[_Union[Job, _Mapping]]] = ...) -> None: ...

class CancelJobRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class CancelJobResponse(_message.Message):
    __slots__ = ("job",)
    JOB_FIELD_NUMBER: _ClassVar[int]
    job: Job
    def __init__(self, job: _Optional[_Union[Job, _Mapping]] = ...) -> None: ...

class FetchResultRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class FetchResultResponse(_message.Message):
    __slots__ = ("tensor", "chunk")
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    tensor: _common_pb2.TensorHeader
    chunk: _common_pb2.TensorChunk
    def __init__(self, tensor: _Optional[_Union[_common_pb2.TensorHeader, _Mapping]] = ..., chunk: _Optional[_Union[_common_pb2.TensorChunk, _Mapping]] = ...) -> None: ...
