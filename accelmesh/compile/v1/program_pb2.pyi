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
COMBINE_RULE_UNSPECIFIED: CombineRule
COMBINE_RULE_CONCAT: CombineRule
COMBINE_RULE_SUM: CombineRule
COMBINE_RULE_MEAN: CombineRule
PROGRAM_KIND_UNSPECIFIED: ProgramKind
PROGRAM_KIND_FUNCTION: ProgramKind
PROGRAM_KIND_MODEL: ProgramKind
PROGRAM_KIND_TRAINING_STEP: ProgramKind
PROGRAM_KIND_UPLOADED: ProgramKind

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
    __slots__ = ("name", "kind", "order", "parameters", "parameter_count", "parameter_bytes", "flops_per_sample", "bytes_accessed_per_sample", "activation_bytes_per_sample", "shared_from", "shared_parameter_bytes", "buffer_bytes")
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
    BUFFER_BYTES_FIELD_NUMBER: _ClassVar[int]
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
    buffer_bytes: int
    def __init__(self, name: _Optional[str] = ..., kind: _Optional[str] = ..., order: _Optional[int] = ..., parameters: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., parameter_count: _Optional[int] = ..., parameter_bytes: _Optional[int] = ..., flops_per_sample: _Optional[float] = ..., bytes_accessed_per_sample: _Optional[float] = ..., activation_bytes_per_sample: _Optional[int] = ..., shared_from: _Optional[str] = ..., shared_parameter_bytes: _Optional[int] = ..., buffer_bytes: _Optional[int] = ...) -> None: ...

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
