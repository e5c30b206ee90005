from accelmesh.common.v1 import common_pb2 as _common_pb2
from accelmesh.dispatch.v1 import job_pb2 as _job_pb2
from accelmesh.dispatch.v1 import plan_pb2 as _plan_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

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
    spec: _job_pb2.JobSpec
    parameter: _common_pb2.TensorHeader
    parameter_chunk: _common_pb2.TensorChunk
    block: InputBlock
    def __init__(self, spec: _Optional[_Union[_job_pb2.JobSpec, _Mapping]] = ..., parameter: _Optional[_Union[_common_pb2.TensorHeader, _Mapping]] = ..., parameter_chunk: _Optional[_Union[_common_pb2.TensorChunk, _Mapping]] = ..., block: _Optional[_Union[InputBlock, _Mapping]] = ...) -> None: ...

class SubmitJobResponse(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class RunJobRequest(_message.Message):
    __slots__ = ("spec", "parameter", "parameter_chunk", "block", "stored", "accept_batches")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    PARAMETER_FIELD_NUMBER: _ClassVar[int]
    PARAMETER_CHUNK_FIELD_NUMBER: _ClassVar[int]
    BLOCK_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    ACCEPT_BATCHES_FIELD_NUMBER: _ClassVar[int]
    spec: _job_pb2.JobSpec
    parameter: _common_pb2.TensorHeader
    parameter_chunk: _common_pb2.TensorChunk
    block: InputBlock
    stored: InputsStored
    accept_batches: bool
    def __init__(self, spec: _Optional[_Union[_job_pb2.JobSpec, _Mapping]] = ..., parameter: _Optional[_Union[_common_pb2.TensorHeader, _Mapping]] = ..., parameter_chunk: _Optional[_Union[_common_pb2.TensorChunk, _Mapping]] = ..., block: _Optional[_Union[InputBlock, _Mapping]] = ..., stored: _Optional[_Union[InputsStored, _Mapping]] = ..., accept_batches: _Optional[bool] = ...) -> None: ...

class RunJobResponse(_message.Message):
    __slots__ = ("event", "tensor", "chunk", "job", "batch", "put_inputs", "outputs")
    EVENT_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    PUT_INPUTS_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    event: _job_pb2.JobEvent
    tensor: _common_pb2.TensorHeader
    chunk: _common_pb2.TensorChunk
    job: _job_pb2.Job
    batch: RunJobResponseBatch
    put_inputs: InputsWanted
    outputs: OutputsReady
    def __init__(self, event: _Optional[_Union[_job_pb2.JobEvent, _Mapping]] = ..., tensor: _Optional[_Union[_common_pb2.TensorHeader, _Mapping]] = ..., chunk: _Optional[_Union[_common_pb2.TensorChunk, _Mapping]] = ..., job: _Optional[_Union[_job_pb2.Job, _Mapping]] = ..., batch: _Optional[_Union[RunJobResponseBatch, _Mapping]] = ..., put_inputs: _Optional[_Union[InputsWanted, _Mapping]] = ..., outputs: _Optional[_Union[OutputsReady, _Mapping]] = ...) -> None: ...

class ShardObjects(_message.Message):
    __slots__ = ("shard_index", "first_row", "rows", "worker_address", "object_ids", "names", "ticket")
    SHARD_INDEX_FIELD_NUMBER: _ClassVar[int]
    FIRST_ROW_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    WORKER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    OBJECT_IDS_FIELD_NUMBER: _ClassVar[int]
    NAMES_FIELD_NUMBER: _ClassVar[int]
    TICKET_FIELD_NUMBER: _ClassVar[int]
    shard_index: int
    first_row: int
    rows: int
    worker_address: str
    object_ids: _containers.RepeatedScalarFieldContainer[str]
    names: _containers.RepeatedScalarFieldContainer[str]
    ticket: bytes
    def __init__(self, shard_index: _Optional[int] = ..., first_row: _Optional[int] = ..., rows: _Optional[int] = ..., worker_address: _Optional[str] = ..., object_ids: _Optional[_Iterable[str]] = ..., names: _Optional[_Iterable[str]] = ..., ticket: _Optional[bytes] = ...) -> None: ...

class InputsWanted(_message.Message):
    __slots__ = ("shards", "tickets")
    class TicketsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: bytes
        def __init__(self, key: _Optional[str] = ..., value: _Optional[bytes] = ...) -> None: ...
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    TICKETS_FIELD_NUMBER: _ClassVar[int]
    shards: _containers.RepeatedCompositeFieldContainer[ShardObjects]
    tickets: _containers.ScalarMap[str, bytes]
    def __init__(self, shards: _Optional[_Iterable[_Union[ShardObjects, _Mapping]]] = ..., tickets: _Optional[_Mapping[str, bytes]] = ...) -> None: ...

class OutputsReady(_message.Message):
    __slots__ = ("shards", "tickets")
    class TicketsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: bytes
        def __init__(self, key: _Optional[str] = ..., value: _Optional[bytes] = ...) -> None: ...
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    TICKETS_FIELD_NUMBER: _ClassVar[int]
    shards: _containers.RepeatedCompositeFieldContainer[ShardObjects]
    tickets: _containers.ScalarMap[str, bytes]
    def __init__(self, shards: _Optional[_Iterable[_Union[ShardObjects, _Mapping]]] = ..., tickets: _Optional[_Mapping[str, bytes]] = ...) -> None: ...

class InputsStored(_message.Message):
    __slots__ = ("shard_indexes",)
    SHARD_INDEXES_FIELD_NUMBER: _ClassVar[int]
    shard_indexes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, shard_indexes: _Optional[_Iterable[int]] = ...) -> None: ...

class RunJobResponseBatch(_message.Message):
    __slots__ = ("parts",)
    PARTS_FIELD_NUMBER: _ClassVar[int]
    parts: _containers.RepeatedCompositeFieldContainer[RunJobResponse]
    def __init__(self, parts: _Optional[_Iterable[_Union[RunJobResponse, _Mapping]]] = ...) -> None: ...

class PlanJobRequest(_message.Message):
    __slots__ = ("spec",)
    SPEC_FIELD_NUMBER: _ClassVar[int]
    spec: _job_pb2.JobSpec
    def __init__(self, spec: _Optional[_Union[_job_pb2.JobSpec, _Mapping]] = ...) -> None: ...

class PlanJobResponse(_message.Message):
    __slots__ = ("plan",)
    PLAN_FIELD_NUMBER: _ClassVar[int]
    plan: _plan_pb2.Plan
    def __init__(self, plan: _Optional[_Union[_plan_pb2.Plan, _Mapping]] = ...) -> None: ...

class WatchJobRequest(_message.Message):
    __slots__ = ("job_id", "from_index", "log_so_far")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    FROM_INDEX_FIELD_NUMBER: _ClassVar[int]
    LOG_SO_FAR_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    from_index: int
    log_so_far: bool
    def __init__(self, job_id: _Optional[str] = ..., from_index: _Optional[int] = ..., log_so_far: _Optional[bool] = ...) -> None: ...

class WatchJobResponse(_message.Message):
    __slots__ = ("event",)
    EVENT_FIELD_NUMBER: _ClassVar[int]
    event: _job_pb2.JobEvent
    def __init__(self, event: _Optional[_Union[_job_pb2.JobEvent, _Mapping]] = ...) -> None: ...

class GetJobRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class GetJobResponse(_message.Message):
    __slots__ = ("job",)
    JOB_FIELD_NUMBER: _ClassVar[int]
    job: _job_pb2.Job
    def __init__(self, job: _Optional[_Union[_job_pb2.Job, _Mapping]] = ...) -> None: ...

class ListJobsRequest(_message.Message):
    __slots__ = ("page_size", "page_token", "states")
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    STATES_FIELD_NUMBER: _ClassVar[int]
    page_size: int
    page_token: str
    states: _containers.RepeatedScalarFieldContainer[_job_pb2.JobState]
    def __init__(self, page_size: _Optional[int] = ..., page_token: _Optional[str] = ..., states: _Optional[_Iterable[_Union[_job_pb2.JobState, str]]] = ...) -> None: ...

class ListJobsResponse(_message.Message):
    __slots__ = ("jobs", "next_page_token")
    JOBS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    jobs: _containers.RepeatedCompositeFieldContainer[_job_pb2.Job]
    next_page_token: str
    def __init__(self, jobs: _Optional[_Iterable[_Union[_job_pb2.Job, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class CancelJobRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class CancelJobResponse(_message.Message):
    __slots__ = ("job",)
    JOB_FIELD_NUMBER: _ClassVar[int]
    job: _job_pb2.Job
    def __init__(self, job: _Optional[_Union[_job_pb2.Job, _Mapping]] = ...) -> None: ...

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

class Quota(_message.Message):
    __slots__ = ("tenant", "max_jobs", "max_devices", "max_memory_bytes", "max_priority")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    MAX_JOBS_FIELD_NUMBER: _ClassVar[int]
    MAX_DEVICES_FIELD_NUMBER: _ClassVar[int]
    MAX_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_PRIORITY_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    max_jobs: int
    max_devices: int
    max_memory_bytes: int
    max_priority: int
    def __init__(self, tenant: _Optional[str] = ..., max_jobs: _Optional[int] = ..., max_devices: _Optional[int] = ..., max_memory_bytes: _Optional[int] = ..., max_priority: _Optional[int] = ...) -> None: ...

class SetQuotaRequest(_message.Message):
    __slots__ = ("quota", "remove")
    QUOTA_FIELD_NUMBER: _ClassVar[int]
    REMOVE_FIELD_NUMBER: _ClassVar[int]
    quota: Quota
    remove: bool
    def __init__(self, quota: _Optional[_Union[Quota, _Mapping]] = ..., remove: _Optional[bool] = ...) -> None: ...

class SetQuotaResponse(_message.Message):
    __slots__ = ("quota",)
    QUOTA_FIELD_NUMBER: _ClassVar[int]
    quota: Quota
    def __init__(self, quota: _Optional[_Union[Quota, _Mapping]] = ...) -> None: ...

class ListQuotasRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class QuotaUse(_message.Message):
    __slots__ = ("quota", "tenant", "jobs", "devices", "memory_bytes", "queued")
    QUOTA_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    JOBS_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    quota: Quota
    tenant: str
    jobs: int
    devices: int
    memory_bytes: int
    queued: int
    def __init__(self, quota: _Optional[_Union[Quota, _Mapping]] = ..., tenant: _Optional[str] = ..., jobs: _Optional[int] = ..., devices: _Optional[int] = ..., memory_bytes: _Optional[int] = ..., queued: _Optional[int] = ...) -> None: ...

class ListQuotasResponse(_message.Message):
    __slots__ = ("quotas",)
    QUOTAS_FIELD_NUMBER: _ClassVar[int]
    quotas: _containers.RepeatedCompositeFieldContainer[QuotaUse]
    def __init__(self, quotas: _Optional[_Iterable[_Union[QuotaUse, _Mapping]]] = ...) -> None: ...
