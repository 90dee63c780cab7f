from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    BF16: _ClassVar[DType]
    F16: _ClassVar[DType]
    F32: _ClassVar[DType]
DTYPE_UNSPECIFIED: DType
BF16: DType
F16: DType
F32: DType

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "data", "ref")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    REF_FIELD_NUMBER: _ClassVar[int]
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    ref: TensorRef
    def __init__(self, dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ..., ref: _Optional[_Union[TensorRef, _Mapping]] = ...) -> None: ...

class TensorRef(_message.Message):
    __slots__ = ("region", "offset")
    REGION_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    region: str
    offset: int
    def __init__(self, region: _Optional[str] = ..., offset: _Optional[int] = ...) -> None: ...

class GetModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("num_layers", "num_q_heads", "num_v_heads", "head_dim_k", "head_dim_v", "max_tokens_per_step", "max_sessions", "sessions_in_use", "backend", "state_dtype", "scale", "max_speculative_tokens", "devices", "process_ports", "process_index", "shared_memory")
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_Q_HEADS_FIELD_NUMBER: _ClassVar[int]
    NUM_V_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_K_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_V_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_PER_STEP_FIELD_NUMBER: _ClassVar[int]
    MAX_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_IN_USE_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    STATE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    SCALE_FIELD_NUMBER: _ClassVar[int]
    MAX_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    PROCESS_PORTS_FIELD_NUMBER: _ClassVar[int]
    PROCESS_INDEX_FIELD_NUMBER: _ClassVar[int]
    SHARED_MEMORY_FIELD_NUMBER: _ClassVar[int]
    num_layers: int
    num_q_heads: int
    num_v_heads: int
    head_dim_k: int
    head_dim_v: int
    max_tokens_per_step: int
    max_sessions: int
    sessions_in_use: int
    backend: str
    state_dtype: str
    scale: float
    max_speculative_tokens: int
    devices: _containers.RepeatedCompositeFieldContainer[DeviceInfo]
    process_ports: _containers.RepeatedScalarFieldContainer[int]
    process_index: int
    shared_memory: bool
    def __init__(self, num_layers: _Optional[int] = ..., num_q_heads: _Optional[int] = ..., num_v_heads: _Optional[int] = ..., head_dim_k: _Optional[int] = ..., head_dim_v: _Optional[int] = ..., max_tokens_per_step: _Optional[int] = ..., max_sessions: _Optional[int] = ..., sessions_in_use: _Optional[int] = ..., backend: _Optional[str] = ..., state_dtype: _Optional[str] = ..., scale: _Optional[float] = ..., max_speculative_tokens: _Optional[int] = ..., devices: _Optional[_Iterable[_Union[DeviceInfo, _Mapping]]] = ..., process_ports: _Optional[_Iterable[int]] = ..., process_index: _Optional[int] = ..., shared_memory: _Optional[bool] = ...) -> None: ...

class DeviceInfo(_message.Message):
    __slots__ = ("index", "name", "max_sessions", "sessions_in_use")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    MAX_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_IN_USE_FIELD_NUMBER: _ClassVar[int]
    index: int
    name: str
    max_sessions: int
    sessions_in_use: int
    def __init__(self, index: _Optional[int] = ..., name: _Optional[str] = ..., max_sessions: _Optional[int] = ..., sessions_in_use: _Optional[int] = ...) -> None: ...

class CreateSessionRequest(_message.Message):
    __slots__ = ("colocate_with",)
    COLOCATE_WITH_FIELD_NUMBER: _ClassVar[int]
    colocate_with: str
    def __init__(self, colocate_with: _Optional[str] = ...) -> None: ...

class CreateSessionResponse(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class CloseSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class CloseSessionResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("layer", "session_ids", "q", "k", "v", "a", "b", "positions", "request_id", "speculative", "o_ref")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    SESSION_IDS_FIELD_NUMBER: _ClassVar[int]
    Q_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    V_FIELD_NUMBER: _ClassVar[int]
    A_FIELD_NUMBER: _ClassVar[int]
    B_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_FIELD_NUMBER: _ClassVar[int]
    O_REF_FIELD_NUMBER: _ClassVar[int]
    layer: int
    session_ids: _containers.RepeatedScalarFieldContainer[str]
    q: Tensor
    k: Tensor
    v: Tensor
    a: Tensor
    b: Tensor
    positions: _containers.RepeatedScalarFieldContainer[int]
    request_id: str
    speculative: bool
    o_ref: TensorRef
    def __init__(self, layer: _Optional[int] = ..., session_ids: _Optional[_Iterable[str]] = ..., q: _Optional[_Union[Tensor, _Mapping]] = ..., k: _Optional[_Union[Tensor, _Mapping]] = ..., v: _Optional[_Union[Tensor, _Mapping]] = ..., a: _Optional[_Union[Tensor, _Mapping]] = ..., b: _Optional[_Union[Tensor, _Mapping]] = ..., positions: _Optional[_Iterable[int]] = ..., request_id: _Optional[str] = ..., speculative: _Optional[bool] = ..., o_ref: _Optional[_Union[TensorRef, _Mapping]] = ...) -> None: ...

class DecodeResponse(_message.Message):
    __slots__ = ("o", "positions", "request_id", "error_code", "error_message")
    O_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    o: Tensor
    positions: _containers.RepeatedScalarFieldContainer[int]
    request_id: str
    error_code: int
    error_message: str
    def __init__(self, o: _Optional[_Union[Tensor, _Mapping]] = ..., positions: _Optional[_Iterable[int]] = ..., request_id: _Optional[str] = ..., error_code: _Optional[int] = ..., error_message: _Optional[str] = ...) -> None: ...

class ForkSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class ExportStateRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class StateHeader(_message.Message):
    __slots__ = ("num_layers", "num_v_heads", "head_dim_k", "head_dim_v", "dtype", "positions", "total_bytes", "checksum", "convert_dtype")
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_V_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_K_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_V_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    CONVERT_DTYPE_FIELD_NUMBER: _ClassVar[int]
    num_layers: int
    num_v_heads: int
    head_dim_k: int
    head_dim_v: int
    dtype: str
    positions: _containers.RepeatedScalarFieldContainer[int]
    total_bytes: int
    checksum: str
    convert_dtype: bool
    def __init__(self, num_layers: _Optional[int] = ..., num_v_heads: _Optional[int] = ..., head_dim_k: _Optional[int] = ..., head_dim_v: _Optional[int] = ..., dtype: _Optional[str] = ..., positions: _Optional[_Iterable[int]] = ..., total_bytes: _Optional[int] = ..., checksum: _Optional[str] = ..., convert_dtype: _Optional[bool] = ...) -> None: ...

class StateChunk(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: StateHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[StateHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Stats(_message.Message):
    __slots__ = ("launches", "rows_launched", "requests", "batches", "mean_rows_per_launch", "sessions_in_use", "max_sessions", "backend", "device_seconds", "queue_wait_seconds")
    LAUNCHES_FIELD_NUMBER: _ClassVar[int]
    ROWS_LAUNCHED_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    BATCHES_FIELD_NUMBER: _ClassVar[int]
    MEAN_ROWS_PER_LAUNCH_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_IN_USE_FIELD_NUMBER: _ClassVar[int]
    MAX_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    DEVICE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    launches: int
    rows_launched: int
    requests: int
    batches: int
    mean_rows_per_launch: float
    sessions_in_use: int
    max_sessions: int
    backend: str
    device_seconds: float
    queue_wait_seconds: float
    def __init__(self, launches: _Optional[int] = ..., rows_launched: _Optional[int] = ..., requests: _Optional[int] = ..., batches: _Optional[int] = ..., mean_rows_per_launch: _Optional[float] = ..., sessions_in_use: _Optional[int] = ..., max_sessions: _Optional[int] = ..., backend: _Optional[str] = ..., device_seconds: _Optional[float] = ..., queue_wait_seconds: _Optional[float] = ...) -> None: ...

class CommitRequest(_message.Message):
    __slots__ = ("session_id", "accepted")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    accepted: int
    def __init__(self, session_id: _Optional[str] = ..., accepted: _Optional[int] = ...) -> None: ...

class CommitResponse(_message.Message):
    __slots__ = ("positions", "committed_layers")
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_LAYERS_FIELD_NUMBER: _ClassVar[int]
    positions: _containers.RepeatedScalarFieldContainer[int]
    committed_layers: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, positions: _Optional[_Iterable[int]] = ..., committed_layers: _Optional[_Iterable[int]] = ...) -> None: ...

class RegisterSharedMemoryRequest(_message.Message):
    __slots__ = ("name", "system", "cuda", "byte_size")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SYSTEM_FIELD_NUMBER: _ClassVar[int]
    CUDA_FIELD_NUMBER: _ClassVar[int]
    BYTE_SIZE_FIELD_NUMBER: _ClassVar[int]
    name: str
    system: SystemSharedMemory
    cuda: CudaSharedMemory
    byte_size: int
    def __init__(self, name: _Optional[str] = ..., system: _Optional[_Union[SystemSharedMemory, _Mapping]] = ..., cuda: _Optional[_Union[CudaSharedMemory, _Mapping]] = ..., byte_size: _Optional[int] = ...) -> None: ...

class SystemSharedMemory(_message.Message):
    __slots__ = ("key", "offset")
    KEY_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    key: str
    offset: int
    def __init__(self, key: _Optional[str] = ..., offset: _Optional[int] = ...) -> None: ...

class CudaSharedMemory(_message.Message):
    __slots__ = ("ipc_handle", "device")
    IPC_HANDLE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    ipc_handle: bytes
    device: int
    def __init__(self, ipc_handle: _Optional[bytes] = ..., device: _Optional[int] = ...) -> None: ...

class RegisterSharedMemoryResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class UnregisterSharedMemoryRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class UnregisterSharedMemoryResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
