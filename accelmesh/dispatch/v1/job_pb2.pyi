import datetime

from accelmesh.common.v1 import common_pb2 as _common_pb2
from accelmesh.dispatch.v1 import plan_pb2 as _plan_pb2
from google.protobuf import duration_pb2 as _duration_pb2
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

class DataPath(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DATA_PATH_UNSPECIFIED: _ClassVar[DataPath]
    DATA_PATH_RELAY: _ClassVar[DataPath]
    DATA_PATH_DIRECT: _ClassVar[DataPath]

class JobState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    JOB_STATE_UNSPECIFIED: _ClassVar[JobState]
    JOB_STATE_PLANNING: _ClassVar[JobState]
    JOB_STATE_COMPILING: _ClassVar[JobState]
    JOB_STATE_RUNNING: _ClassVar[JobState]
    JOB_STATE_SUCCEEDED: _ClassVar[JobState]
    JOB_STATE_FAILED: _ClassVar[JobState]
    JOB_STATE_CANCELLED: _ClassVar[JobState]
    JOB_STATE_QUEUED: _ClassVar[JobState]

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
    JOB_EVENT_TYPE_TAKEN_OVER: _ClassVar[JobEventType]
    JOB_EVENT_TYPE_QUEUED: _ClassVar[JobEventType]
    JOB_EVENT_TYPE_SHARD_VERIFIED: _ClassVar[JobEventType]
    JOB_EVENT_TYPE_INPUTS_WANTED: _ClassVar[JobEventType]

class VerificationOutcome(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    VERIFICATION_OUTCOME_UNSPECIFIED: _ClassVar[VerificationOutcome]
    VERIFICATION_OUTCOME_MATCHED: _ClassVar[VerificationOutcome]
    VERIFICATION_OUTCOME_NOT_VERIFIABLE: _ClassVar[VerificationOutcome]
JOB_KIND_UNSPECIFIED: JobKind
JOB_KIND_INFERENCE: JobKind
JOB_KIND_TRAINING: JobKind
DATA_PATH_UNSPECIFIED: DataPath
DATA_PATH_RELAY: DataPath
DATA_PATH_DIRECT: DataPath
JOB_STATE_UNSPECIFIED: JobState
JOB_STATE_PLANNING: JobState
JOB_STATE_COMPILING: JobState
JOB_STATE_RUNNING: JobState
JOB_STATE_SUCCEEDED: JobState
JOB_STATE_FAILED: JobState
JOB_STATE_CANCELLED: JobState
JOB_STATE_QUEUED: JobState
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
JOB_EVENT_TYPE_TAKEN_OVER: JobEventType
JOB_EVENT_TYPE_QUEUED: JobEventType
JOB_EVENT_TYPE_SHARD_VERIFIED: JobEventType
JOB_EVENT_TYPE_INPUTS_WANTED: JobEventType
VERIFICATION_OUTCOME_UNSPECIFIED: VerificationOutcome
VERIFICATION_OUTCOME_MATCHED: VerificationOutcome
VERIFICATION_OUTCOME_NOT_VERIFIABLE: VerificationOutcome

class JobConstraints(_message.Message):
    __slots__ = ("platforms", "required_capabilities", "max_devices", "filter", "precision")
    PLATFORMS_FIELD_NUMBER: _ClassVar[int]
    REQUIRED_CAPABILITIES_FIELD_NUMBER: _ClassVar[int]
    MAX_DEVICES_FIELD_NUMBER: _ClassVar[int]
    FILTER_FIELD_NUMBER: _ClassVar[int]
    PRECISION_FIELD_NUMBER: _ClassVar[int]
    platforms: _containers.RepeatedScalarFieldContainer[_common_pb2.Platform]
    required_capabilities: _containers.RepeatedScalarFieldContainer[str]
    max_devices: int
    filter: str
    precision: _common_pb2.Precision
    def __init__(self, platforms: _Optional[_Iterable[_Union[_common_pb2.Platform, str]]] = ..., required_capabilities: _Optional[_Iterable[str]] = ..., max_devices: _Optional[int] = ..., filter: _Optional[str] = ..., precision: _Optional[_Union[_common_pb2.Precision, str]] = ...) -> None: ...

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
    __slots__ = ("program", "version", "kind", "constraints", "inputs", "client_parameters", "parameter_seed", "training", "name", "placement", "request_id", "priority", "queue_timeout", "verify_fraction", "data_path")
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
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    QUEUE_TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    VERIFY_FRACTION_FIELD_NUMBER: _ClassVar[int]
    DATA_PATH_FIELD_NUMBER: _ClassVar[int]
    program: str
    version: str
    kind: JobKind
    constraints: JobConstraints
    inputs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TensorHeader]
    client_parameters: bool
    parameter_seed: int
    training: TrainingOptions
    name: str
    placement: _plan_pb2.PlacementOptions
    request_id: str
    priority: int
    queue_timeout: _duration_pb2.Duration
    verify_fraction: float
    data_path: DataPath
    def __init__(self, program: _Optional[str] = ..., version: _Optional[str] = ..., kind: _Optional[_Union[JobKind, str]] = ..., constraints: _Optional[_Union[JobConstraints, _Mapping]] = ..., inputs: _Optional[_Iterable[_Union[_common_pb2.TensorHeader, _Mapping]]] = ..., client_parameters: _Optional[bool] = ..., parameter_seed: _Optional[int] = ..., training: _Optional[_Union[TrainingOptions, _Mapping]] = ..., name: _Optional[str] = ..., placement: _Optional[_Union[_plan_pb2.PlacementOptions, _Mapping]] = ..., request_id: _Optional[str] = ..., priority: _Optional[int] = ..., queue_timeout: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., verify_fraction: _Optional[float] = ..., data_path: _Optional[_Union[DataPath, str]] = ...) -> None: ...

class JobEvent(_message.Message):
    __slots__ = ("index", "type", "time", "progress", "message", "plan", "shard", "step", "loss", "queue", "job_id")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    PLAN_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    index: int
    type: JobEventType
    time: _timestamp_pb2.Timestamp
    progress: float
    message: str
    plan: _plan_pb2.Plan
    shard: ShardRecord
    step: int
    loss: float
    queue: QueueStatus
    job_id: str
    def __init__(self, index: _Optional[int] = ..., type: _Optional[_Union[JobEventType, str]] = ..., time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., progress: _Optional[float] = ..., message: _Optional[str] = ..., plan: _Optional[_Union[_plan_pb2.Plan, _Mapping]] = ..., shard: _Optional[_Union[ShardRecord, _Mapping]] = ..., step: _Optional[int] = ..., loss: _Optional[float] = ..., queue: _Optional[_Union[QueueStatus, _Mapping]] = ..., job_id: _Optional[str] = ...) -> None: ...

class QueueStatus(_message.Message):
    __slots__ = ("position", "reason", "enqueue_time", "deadline")
    POSITION_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    ENQUEUE_TIME_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_FIELD_NUMBER: _ClassVar[int]
    position: int
    reason: str
    enqueue_time: _timestamp_pb2.Timestamp
    deadline: _timestamp_pb2.Timestamp
    def __init__(self, position: _Optional[int] = ..., reason: _Optional[str] = ..., enqueue_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., deadline: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class ShardRecord(_message.Message):
    __slots__ = ("index", "device_id", "target_type", "rule", "first_row", "rows", "attempts", "failures", "queue_seconds", "load_seconds", "execute_seconds", "total_seconds", "done", "predicted_seconds", "verification")
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
    PREDICTED_SECONDS_FIELD_NUMBER: _ClassVar[int]
    VERIFICATION_FIELD_NUMBER: _ClassVar[int]
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
    predicted_seconds: float
    verification: ShardVerification
    def __init__(self, index: _Optional[int] = ..., device_id: _Optional[str] = ..., target_type: _Optional[str] = ..., rule: _Optional[str] = ..., first_row: _Optional[int] = ..., rows: _Optional[int] = ..., attempts: _Optional[int] = ..., failures: _Optional[_Iterable[str]] = ..., queue_seconds: _Optional[float] = ..., load_seconds: _Optional[float] = ..., execute_seconds: _Optional[float] = ..., total_seconds: _Optional[float] = ..., done: _Optional[bool] = ..., predicted_seconds: _Optional[float] = ..., verification: _Optional[_Union[ShardVerification, _Mapping]] = ...) -> None: ...

class ShardVerification(_message.Message):
    __slots__ = ("outcome", "node_address", "verifier_device_id", "verifier_node_address", "error_ratio", "tolerance")
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    NODE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    VERIFIER_DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    VERIFIER_NODE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ERROR_RATIO_FIELD_NUMBER: _ClassVar[int]
    TOLERANCE_FIELD_NUMBER: _ClassVar[int]
    outcome: VerificationOutcome
    node_address: str
    verifier_device_id: str
    verifier_node_address: str
    error_ratio: float
    tolerance: str
    def __init__(self, outcome: _Optional[_Union[VerificationOutcome, str]] = ..., node_address: _Optional[str] = ..., verifier_device_id: _Optional[str] = ..., verifier_node_address: _Optional[str] = ..., error_ratio: _Optional[float] = ..., tolerance: _Optional[str] = ...) -> None: ...

class Job(_message.Message):
    __slots__ = ("job_id", "spec", "state", "plan", "shards", "error", "progress", "create_time", "end_time", "losses", "expire_time", "owner", "measured_seconds", "queue", "verify_fraction")
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
    OWNER_FIELD_NUMBER: _ClassVar[int]
    MEASURED_SECONDS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_FIELD_NUMBER: _ClassVar[int]
    VERIFY_FRACTION_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    spec: JobSpec
    state: JobState
    plan: _plan_pb2.Plan
    shards: _containers.RepeatedCompositeFieldContainer[ShardRecord]
    error: str
    progress: float
    create_time: _timestamp_pb2.Timestamp
    end_time: _timestamp_pb2.Timestamp
    losses: _containers.RepeatedScalarFieldContainer[float]
    expire_time: _timestamp_pb2.Timestamp
    owner: str
    measured_seconds: float
    queue: QueueStatus
    verify_fraction: float
    def __init__(self, job_id: _Optional[str] = ..., spec: _Optional[_Union[JobSpec, _Mapping]] = ..., state: _Optional[_Union[JobState, str]] = ..., plan: _Optional[_Union[_plan_pb2.Plan, _Mapping]] = ..., shards: _Optional[_Iterable[_Union[ShardRecord, _Mapping]]] = ..., error: _Optional[str] = ..., progress: _Optional[float] = ..., create_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., end_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., losses: _Optional[_Iterable[float]] = ..., expire_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., owner: _Optional[str] = ..., measured_seconds: _Optional[float] = ..., queue: _Optional[_Union[QueueStatus, _Mapping]] = ..., verify_fraction: _Optional[float] = ...) -> None: ...
