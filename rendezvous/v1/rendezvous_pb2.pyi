import datetime

from google.protobuf import duration_pb2 as _duration_pb2
from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.rpc import status_pb2 as _status_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class EngineRole(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ENGINE_ROLE_UNSPECIFIED: _ClassVar[EngineRole]
    ENGINE_ROLE_PRODUCER: _ClassVar[EngineRole]
    ENGINE_ROLE_CONSUMER: _ClassVar[EngineRole]

class MemoryKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MEMORY_KIND_UNSPECIFIED: _ClassVar[MemoryKind]
    MEMORY_KIND_DRAM: _ClassVar[MemoryKind]
    MEMORY_KIND_VRAM: _ClassVar[MemoryKind]

class EngineView(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ENGINE_VIEW_UNSPECIFIED: _ClassVar[EngineView]
    ENGINE_VIEW_BASIC: _ClassVar[EngineView]
    ENGINE_VIEW_PLACEMENT: _ClassVar[EngineView]
    ENGINE_VIEW_FULL: _ClassVar[EngineView]

class TransferState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TRANSFER_STATE_UNSPECIFIED: _ClassVar[TransferState]
    TRANSFER_STATE_TARGETED: _ClassVar[TransferState]
    TRANSFER_STATE_CLAIMED: _ClassVar[TransferState]
    TRANSFER_STATE_MATCHED: _ClassVar[TransferState]
    TRANSFER_STATE_COMMITTED: _ClassVar[TransferState]
    TRANSFER_STATE_RELEASED: _ClassVar[TransferState]
    TRANSFER_STATE_ABORTED: _ClassVar[TransferState]

class TransferMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TRANSFER_MODE_UNSPECIFIED: _ClassVar[TransferMode]
    TRANSFER_MODE_PUSH: _ClassVar[TransferMode]
    TRANSFER_MODE_PULL: _ClassVar[TransferMode]

class AbortReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ABORT_REASON_UNSPECIFIED: _ClassVar[AbortReason]
    ABORT_REASON_REQUESTED: _ClassVar[AbortReason]
    ABORT_REASON_DEADLINE_EXCEEDED: _ClassVar[AbortReason]
    ABORT_REASON_PEER_LOST: _ClassVar[AbortReason]
    ABORT_REASON_LAYOUT_MISMATCH: _ClassVar[AbortReason]
    ABORT_REASON_TRANSFER_FAILED: _ClassVar[AbortReason]
    ABORT_REASON_BLOCK_MISMATCH: _ClassVar[AbortReason]
    ABORT_REASON_DATA_PLANE_MISMATCH: _ClassVar[AbortReason]

class CompletionOutcome(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    COMPLETION_OUTCOME_UNSPECIFIED: _ClassVar[CompletionOutcome]
    COMPLETION_OUTCOME_SUCCEEDED: _ClassVar[CompletionOutcome]
    COMPLETION_OUTCOME_FAILED: _ClassVar[CompletionOutcome]

class EventType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    EVENT_TYPE_UNSPECIFIED: _ClassVar[EventType]
    EVENT_TYPE_TRANSFER_ASSIGNED: _ClassVar[EventType]
    EVENT_TYPE_TRANSFER_REVOKED: _ClassVar[EventType]
    EVENT_TYPE_SOURCE_READY: _ClassVar[EventType]
    EVENT_TYPE_TRANSFER_COMMITTED: _ClassVar[EventType]
    EVENT_TYPE_TRANSFER_ABORTED: _ClassVar[EventType]
    EVENT_TYPE_PEER_LOST: _ClassVar[EventType]
    EVENT_TYPE_REVOCATION_CONFIRMED: _ClassVar[EventType]
ENGINE_ROLE_UNSPECIFIED: EngineRole
ENGINE_ROLE_PRODUCER: EngineRole
ENGINE_ROLE_CONSUMER: EngineRole
MEMORY_KIND_UNSPECIFIED: MemoryKind
MEMORY_KIND_DRAM: MemoryKind
MEMORY_KIND_VRAM: MemoryKind
ENGINE_VIEW_UNSPECIFIED: EngineView
ENGINE_VIEW_BASIC: EngineView
ENGINE_VIEW_PLACEMENT: EngineView
ENGINE_VIEW_FULL: EngineView
TRANSFER_STATE_UNSPECIFIED: TransferState
TRANSFER_STATE_TARGETED: TransferState
TRANSFER_STATE_CLAIMED: TransferState
TRANSFER_STATE_MATCHED: TransferState
TRANSFER_STATE_COMMITTED: TransferState
TRANSFER_STATE_RELEASED: TransferState
TRANSFER_STATE_ABORTED: TransferState
TRANSFER_MODE_UNSPECIFIED: TransferMode
TRANSFER_MODE_PUSH: TransferMode
TRANSFER_MODE_PULL: TransferMode
ABORT_REASON_UNSPECIFIED: AbortReason
ABORT_REASON_REQUESTED: AbortReason
ABORT_REASON_DEADLINE_EXCEEDED: AbortReason
ABORT_REASON_PEER_LOST: AbortReason
ABORT_REASON_LAYOUT_MISMATCH: AbortReason
ABORT_REASON_TRANSFER_FAILED: AbortReason
ABORT_REASON_BLOCK_MISMATCH: AbortReason
ABORT_REASON_DATA_PLANE_MISMATCH: AbortReason
COMPLETION_OUTCOME_UNSPECIFIED: CompletionOutcome
COMPLETION_OUTCOME_SUCCEEDED: CompletionOutcome
COMPLETION_OUTCOME_FAILED: CompletionOutcome
EVENT_TYPE_UNSPECIFIED: EventType
EVENT_TYPE_TRANSFER_ASSIGNED: EventType
EVENT_TYPE_TRANSFER_REVOKED: EventType
EVENT_TYPE_SOURCE_READY: EventType
EVENT_TYPE_TRANSFER_COMMITTED: EventType
EVENT_TYPE_TRANSFER_ABORTED: EventType
EVENT_TYPE_PEER_LOST: EventType
EVENT_TYPE_REVOCATION_CONFIRMED: EventType

class EngineCapacity(_message.Message):
    __slots__ = ("max_transfers", "max_blocks")
    MAX_TRANSFERS_FIELD_NUMBER: _ClassVar[int]
    MAX_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    max_transfers: int
    max_blocks: int
    def __init__(self, max_transfers: _Optional[int] = ..., max_blocks: _Optional[int] = ...) -> None: ...

class EngineCredits(_message.Message):
    __slots__ = ("transfers_in_use", "blocks_in_use", "transfers_reserved", "blocks_reserved")
    TRANSFERS_IN_USE_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_IN_USE_FIELD_NUMBER: _ClassVar[int]
    TRANSFERS_RESERVED_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_RESERVED_FIELD_NUMBER: _ClassVar[int]
    transfers_in_use: int
    blocks_in_use: int
    transfers_reserved: int
    blocks_reserved: int
    def __init__(self, transfers_in_use: _Optional[int] = ..., blocks_in_use: _Optional[int] = ..., transfers_reserved: _Optional[int] = ..., blocks_reserved: _Optional[int] = ...) -> None: ...

class CreditSpec(_message.Message):
    __slots__ = ("transfer_id", "engine_id", "blocks")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    engine_id: str
    blocks: int
    def __init__(self, transfer_id: _Optional[str] = ..., engine_id: _Optional[str] = ..., blocks: _Optional[int] = ...) -> None: ...

class CreditResult(_message.Message):
    __slots__ = ("transfer_id", "status", "engine_id", "expire_time")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    EXPIRE_TIME_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    status: _status_pb2.Status
    engine_id: str
    expire_time: _timestamp_pb2.Timestamp
    def __init__(self, transfer_id: _Optional[str] = ..., status: _Optional[_Union[_status_pb2.Status, _Mapping]] = ..., engine_id: _Optional[str] = ..., expire_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class ReserveCreditsRequest(_message.Message):
    __slots__ = ("request_id", "reservations", "ttl")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    RESERVATIONS_FIELD_NUMBER: _ClassVar[int]
    TTL_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    reservations: _containers.RepeatedCompositeFieldContainer[CreditSpec]
    ttl: _duration_pb2.Duration
    def __init__(self, request_id: _Optional[str] = ..., reservations: _Optional[_Iterable[_Union[CreditSpec, _Mapping]]] = ..., ttl: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ...) -> None: ...

class ReserveCreditsResponse(_message.Message):
    __slots__ = ("header", "results")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    header: ResponseHeader
    results: _containers.RepeatedCompositeFieldContainer[CreditResult]
    def __init__(self, header: _Optional[_Union[ResponseHeader, _Mapping]] = ..., results: _Optional[_Iterable[_Union[CreditResult, _Mapping]]] = ...) -> None: ...

class ReleaseCreditsRequest(_message.Message):
    __slots__ = ("request_id", "transfer_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    transfer_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_id: _Optional[str] = ..., transfer_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class ReleaseCreditsResponse(_message.Message):
    __slots__ = ("header", "results")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    header: ResponseHeader
    results: _containers.RepeatedCompositeFieldContainer[CreditResult]
    def __init__(self, header: _Optional[_Union[ResponseHeader, _Mapping]] = ..., results: _Optional[_Iterable[_Union[CreditResult, _Mapping]]] = ...) -> None: ...

class ResponseHeader(_message.Message):
    __slots__ = ("epoch", "revision", "server_id")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    SERVER_ID_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    revision: int
    server_id: str
    def __init__(self, epoch: _Optional[int] = ..., revision: _Optional[int] = ..., server_id: _Optional[str] = ...) -> None: ...

class KvLayout(_message.Message):
    __slots__ = ("model_fingerprint", "dtype", "block_size", "num_layers", "tp_size", "pp_size", "kv_layout", "num_kv_heads", "data_plane_version")
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    PP_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    DATA_PLANE_VERSION_FIELD_NUMBER: _ClassVar[int]
    model_fingerprint: str
    dtype: str
    block_size: int
    num_layers: int
    tp_size: int
    pp_size: int
    kv_layout: str
    num_kv_heads: int
    data_plane_version: int
    def __init__(self, model_fingerprint: _Optional[str] = ..., dtype: _Optional[str] = ..., block_size: _Optional[int] = ..., num_layers: _Optional[int] = ..., tp_size: _Optional[int] = ..., pp_size: _Optional[int] = ..., kv_layout: _Optional[str] = ..., num_kv_heads: _Optional[int] = ..., data_plane_version: _Optional[int] = ...) -> None: ...

class KvRegion(_message.Message):
    __slots__ = ("base_address", "block_stride_bytes", "block_length_bytes", "num_blocks", "device_id")
    BASE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_STRIDE_BYTES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_LENGTH_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    base_address: int
    block_stride_bytes: int
    block_length_bytes: int
    num_blocks: int
    device_id: int
    def __init__(self, base_address: _Optional[int] = ..., block_stride_bytes: _Optional[int] = ..., block_length_bytes: _Optional[int] = ..., num_blocks: _Optional[int] = ..., device_id: _Optional[int] = ...) -> None: ...

class NixlAgent(_message.Message):
    __slots__ = ("name", "metadata", "rank", "memory_kind", "regions", "first_layer", "num_layers")
    NAME_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    MEMORY_KIND_FIELD_NUMBER: _ClassVar[int]
    REGIONS_FIELD_NUMBER: _ClassVar[int]
    FIRST_LAYER_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    name: str
    metadata: bytes
    rank: int
    memory_kind: MemoryKind
    regions: _containers.RepeatedCompositeFieldContainer[KvRegion]
    first_layer: int
    num_layers: int
    def __init__(self, name: _Optional[str] = ..., metadata: _Optional[bytes] = ..., rank: _Optional[int] = ..., memory_kind: _Optional[_Union[MemoryKind, str]] = ..., regions: _Optional[_Iterable[_Union[KvRegion, _Mapping]]] = ..., first_layer: _Optional[int] = ..., num_layers: _Optional[int] = ...) -> None: ...

class Engine(_message.Message):
    __slots__ = ("engine_id", "pool", "role", "layout", "agents", "labels", "incarnation", "lease_ttl", "lease_expire_time", "live_transfers", "register_time", "watch_start_sequence", "capacity", "credits", "lease_remaining")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    AGENTS_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRE_TIME_FIELD_NUMBER: _ClassVar[int]
    LIVE_TRANSFERS_FIELD_NUMBER: _ClassVar[int]
    REGISTER_TIME_FIELD_NUMBER: _ClassVar[int]
    WATCH_START_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    CREDITS_FIELD_NUMBER: _ClassVar[int]
    LEASE_REMAINING_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    pool: str
    role: EngineRole
    layout: KvLayout
    agents: _containers.RepeatedCompositeFieldContainer[NixlAgent]
    labels: _containers.ScalarMap[str, str]
    incarnation: int
    lease_ttl: _duration_pb2.Duration
    lease_expire_time: _timestamp_pb2.Timestamp
    live_transfers: int
    register_time: _timestamp_pb2.Timestamp
    watch_start_sequence: int
    capacity: EngineCapacity
    credits: EngineCredits
    lease_remaining: _duration_pb2.Duration
    def __init__(self, engine_id: _Optional[str] = ..., pool: _Optional[str] = ..., role: _Optional[_Union[EngineRole, str]] = ..., layout: _Optional[_Union[KvLayout, _Mapping]] = ..., agents: _Optional[_Iterable[_Union[NixlAgent, _Mapping]]] = ..., labels: _Optional[_Mapping[str, str]] = ..., incarnation: _Optional[int] = ..., lease_ttl: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., lease_expire_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., live_transfers: _Optional[int] = ..., register_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., watch_start_sequence: _Optional[int] = ..., capacity: _Optional[_Union[EngineCapacity, _Mapping]] = ..., credits: _Optional[_Union[EngineCredits, _Mapping]] = ..., lease_remaining: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ...) -> None: ...

class RegisterEngineRequest(_message.Message):
    __slots__ = ("request_id", "engine_id", "pool", "role", "layout", "agents", "labels", "lease_ttl", "capacity")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    AGENTS_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    engine_id: str
    pool: str
    role: EngineRole
    layout: KvLayout
    agents: _containers.RepeatedCompositeFieldContainer[NixlAgent]
    labels: _containers.ScalarMap[str, str]
    lease_ttl: _duration_pb2.Duration
    capacity: EngineCapacity
    def __init__(self, request_id: _Optional[str] = ..., engine_id: _Optional[str] = ..., pool: _Optional[str] = ..., role: _Optional[_Union[EngineRole, str]] = ..., layout: _Optional[_Union[KvLayout, _Mapping]] = ..., agents: _Optional[_Iterable[_Union[NixlAgent, _Mapping]]] = ..., labels: _Optional[_Mapping[str, str]] = ..., lease_ttl: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., capacity: _Optional[_Union[EngineCapacity, _Mapping]] = ...) -> None: ...

class RegisterEngineResponse(_message.Message):
    __slots__ = ("header", "engine", "watch_start_sequence")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    WATCH_START_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    header: ResponseHeader
    engine: Engine
    watch_start_sequence: int
    def __init__(self, header: _Optional[_Union[ResponseHeader, _Mapping]] = ..., engine: _Optional[_Union[Engine, _Mapping]] = ..., watch_start_sequence: _Optional[int] = ...) -> None: ...

class KeepAliveRequest(_message.Message):
    __slots__ = ("engine_id", "incarnation")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    incarnation: int
    def __init__(self, engine_id: _Optional[str] = ..., incarnation: _Optional[int] = ...) -> None: ...

class KeepAliveResponse(_message.Message):
    __slots__ = ("header", "engine_id", "lease_ttl")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_FIELD_NUMBER: _ClassVar[int]
    header: ResponseHeader
    engine_id: str
    lease_ttl: _duration_pb2.Duration
    def __init__(self, header: _Optional[_Union[ResponseHeader, _Mapping]] = ..., engine_id: _Optional[str] = ..., lease_ttl: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ...) -> None: ...

class DeregisterEngineRequest(_message.Message):
    __slots__ = ("request_id", "engine_id", "incarnation")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    engine_id: str
    incarnation: int
    def __init__(self, request_id: _Optional[str] = ..., engine_id: _Optional[str] = ..., incarnation: _Optional[int] = ...) -> None: ...

class DeregisterEngineResponse(_message.Message):
    __slots__ = ("header", "aborted_transfers")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    ABORTED_TRANSFERS_FIELD_NUMBER: _ClassVar[int]
    header: ResponseHeader
    aborted_transfers: int
    def __init__(self, header: _Optional[_Union[ResponseHeader, _Mapping]] = ..., aborted_transfers: _Optional[int] = ...) -> None: ...

class GetEngineRequest(_message.Message):
    __slots__ = ("engine_id", "view", "transfer_id")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    VIEW_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    view: EngineView
    transfer_id: str
    def __init__(self, engine_id: _Optional[str] = ..., view: _Optional[_Union[EngineView, str]] = ..., transfer_id: _Optional[str] = ...) -> None: ...

class GetEngineResponse(_message.Message):
    __slots__ = ("header", "engine")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    header: ResponseHeader
    engine: Engine
    def __init__(self, header: _Optional[_Union[ResponseHeader, _Mapping]] = ..., engine: _Optional[_Union[Engine, _Mapping]] = ...) -> None: ...

class ListEnginesRequest(_message.Message):
    __slots__ = ("pool", "role", "page_size", "page_token", "view")
    POOL_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    VIEW_FIELD_NUMBER: _ClassVar[int]
    pool: str
    role: EngineRole
    page_size: int
    page_token: str
    view: EngineView
    def __init__(self, pool: _Optional[str] = ..., role: _Optional[_Union[EngineRole, str]] = ..., page_size: _Optional[int] = ..., page_token: _Optional[str] = ..., view: _Optional[_Union[EngineView, str]] = ...) -> None: ...

class ListEnginesResponse(_message.Message):
    __slots__ = ("header", "engines", "next_page_token")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    ENGINES_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    header: ResponseHeader
    engines: _containers.RepeatedCompositeFieldContainer[Engine]
    next_page_token: str
    def __init__(self, header: _Optional[_Union[ResponseHeader, _Mapping]] = ..., engines: _Optional[_Iterable[_Union[Engine, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class Transfer(_message.Message):
    __slots__ = ("transfer_id", "state", "mode", "generation", "consumer_engine_id", "consumer_incarnation", "producer_engine_id", "producer_incarnation", "target_block_ids", "source_block_ids", "num_tokens", "abort_reason", "abort_message", "revoking_generation", "deadline_time", "times", "reported_ranks", "progressive")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    CONSUMER_ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    CONSUMER_INCARNATION_FIELD_NUMBER: _ClassVar[int]
    PRODUCER_ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    PRODUCER_INCARNATION_FIELD_NUMBER: _ClassVar[int]
    TARGET_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    SOURCE_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ABORT_REASON_FIELD_NUMBER: _ClassVar[int]
    ABORT_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    REVOKING_GENERATION_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_TIME_FIELD_NUMBER: _ClassVar[int]
    TIMES_FIELD_NUMBER: _ClassVar[int]
    REPORTED_RANKS_FIELD_NUMBER: _ClassVar[int]
    PROGRESSIVE_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    state: TransferState
    mode: TransferMode
    generation: int
    consumer_engine_id: str
    consumer_incarnation: int
    producer_engine_id: str
    producer_incarnation: int
    target_block_ids: _containers.RepeatedScalarFieldContainer[int]
    source_block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_tokens: int
    abort_reason: AbortReason
    abort_message: str
    revoking_generation: int
    deadline_time: _timestamp_pb2.Timestamp
    times: TransferTimes
    reported_ranks: _containers.RepeatedScalarFieldContainer[int]
    progressive: bool
    def __init__(self, transfer_id: _Optional[str] = ..., state: _Optional[_Union[TransferState, str]] = ..., mode: _Optional[_Union[TransferMode, str]] = ..., generation: _Optional[int] = ..., consumer_engine_id: _Optional[str] = ..., consumer_incarnation: _Optional[int] = ..., producer_engine_id: _Optional[str] = ..., producer_incarnation: _Optional[int] = ..., target_block_ids: _Optional[_Iterable[int]] = ..., source_block_ids: _Optional[_Iterable[int]] = ..., num_tokens: _Optional[int] = ..., abort_reason: _Optional[_Union[AbortReason, str]] = ..., abort_message: _Optional[str] = ..., revoking_generation: _Optional[int] = ..., deadline_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., times: _Optional[_Union[TransferTimes, _Mapping]] = ..., reported_ranks: _Optional[_Iterable[int]] = ..., progressive: _Optional[bool] = ...) -> None: ...

class TransferTimes(_message.Message):
    __slots__ = ("target_time", "claim_time", "match_time", "source_ready_time", "commit_time", "end_time")
    TARGET_TIME_FIELD_NUMBER: _ClassVar[int]
    CLAIM_TIME_FIELD_NUMBER: _ClassVar[int]
    MATCH_TIME_FIELD_NUMBER: _ClassVar[int]
    SOURCE_READY_TIME_FIELD_NUMBER: _ClassVar[int]
    COMMIT_TIME_FIELD_NUMBER: _ClassVar[int]
    END_TIME_FIELD_NUMBER: _ClassVar[int]
    target_time: _timestamp_pb2.Timestamp
    claim_time: _timestamp_pb2.Timestamp
    match_time: _timestamp_pb2.Timestamp
    source_ready_time: _timestamp_pb2.Timestamp
    commit_time: _timestamp_pb2.Timestamp
    end_time: _timestamp_pb2.Timestamp
    def __init__(self, target_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., claim_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., match_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., source_ready_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., commit_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., end_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class ItemResult(_message.Message):
    __slots__ = ("transfer_id", "status", "state", "revoking_generation")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    REVOKING_GENERATION_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    status: _status_pb2.Status
    state: TransferState
    revoking_generation: int
    def __init__(self, transfer_id: _Optional[str] = ..., status: _Optional[_Union[_status_pb2.Status, _Mapping]] = ..., state: _Optional[_Union[TransferState, str]] = ..., revoking_generation: _Optional[int] = ...) -> None: ...

class TransferBinding(_message.Message):
    __slots__ = ("consumer_engine_id", "producer_engine_id", "expire_time", "mac")
    CONSUMER_ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    PRODUCER_ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    EXPIRE_TIME_FIELD_NUMBER: _ClassVar[int]
    MAC_FIELD_NUMBER: _ClassVar[int]
    consumer_engine_id: str
    producer_engine_id: str
    expire_time: _timestamp_pb2.Timestamp
    mac: bytes
    def __init__(self, consumer_engine_id: _Optional[str] = ..., producer_engine_id: _Optional[str] = ..., expire_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., mac: _Optional[bytes] = ...) -> None: ...

class TargetSpec(_message.Message):
    __slots__ = ("transfer_id", "block_ids", "num_tokens", "generation", "timeout", "mode", "binding", "progressive")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    BINDING_FIELD_NUMBER: _ClassVar[int]
    PROGRESSIVE_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_tokens: int
    generation: int
    timeout: _duration_pb2.Duration
    mode: TransferMode
    binding: TransferBinding
    progressive: bool
    def __init__(self, transfer_id: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ..., num_tokens: _Optional[int] = ..., generation: _Optional[int] = ..., timeout: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., mode: _Optional[_Union[TransferMode, str]] = ..., binding: _Optional[_Union[TransferBinding, _Mapping]] = ..., progressive: _Optional[bool] = ...) -> None: ...

class RegisterTargetsRequest(_message.Message):
    __slots__ = ("request_id", "engine_id", "incarnation", "targets")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    TARGETS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    engine_id: str
    incarnation: int
    targets: _containers.RepeatedCompositeFieldContainer[TargetSpec]
    def __init__(self, request_id: _Optional[str] = ..., engine_id: _Optional[str] = ..., incarnation: _Optional[int] = ..., targets: _Optional[_Iterable[_Union[TargetSpec, _Mapping]]] = ...) -> None: ...

class RegisterTargetsResponse(_message.Message):
    __slots__ = ("header", "results")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    header: ResponseHeader
    results: _containers.RepeatedCompositeFieldContainer[ItemResult]
    def __init__(self, header: _Optional[_Union[ResponseHeader, _Mapping]] = ..., results: _Optional[_Iterable[_Union[ItemResult, _Mapping]]] = ...) -> None: ...

class ClaimSpec(_message.Message):
    __slots__ = ("transfer_id", "timeout", "binding")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    BINDING_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    timeout: _duration_pb2.Duration
    binding: TransferBinding
    def __init__(self, transfer_id: _Optional[str] = ..., timeout: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., binding: _Optional[_Union[TransferBinding, _Mapping]] = ...) -> None: ...

class ClaimTransfersRequest(_message.Message):
    __slots__ = ("request_id", "engine_id", "incarnation", "claims")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    CLAIMS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    engine_id: str
    incarnation: int
    claims: _containers.RepeatedCompositeFieldContainer[ClaimSpec]
    def __init__(self, request_id: _Optional[str] = ..., engine_id: _Optional[str] = ..., incarnation: _Optional[int] = ..., claims: _Optional[_Iterable[_Union[ClaimSpec, _Mapping]]] = ...) -> None: ...

class ClaimTransfersResponse(_message.Message):
    __slots__ = ("header", "results")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    header: ResponseHeader
    results: _containers.RepeatedCompositeFieldContainer[ItemResult]
    def __init__(self, header: _Optional[_Union[ResponseHeader, _Mapping]] = ..., results: _Optional[_Iterable[_Union[ItemResult, _Mapping]]] = ...) -> None: ...

class SourceReadySpec(_message.Message):
    __slots__ = ("transfer_id", "block_ids", "binding")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    BINDING_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    binding: TransferBinding
    def __init__(self, transfer_id: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ..., binding: _Optional[_Union[TransferBinding, _Mapping]] = ...) -> None: ...

class MarkSourcesReadyRequest(_message.Message):
    __slots__ = ("request_id", "engine_id", "incarnation", "sources")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    SOURCES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    engine_id: str
    incarnation: int
    sources: _containers.RepeatedCompositeFieldContainer[SourceReadySpec]
    def __init__(self, request_id: _Optional[str] = ..., engine_id: _Optional[str] = ..., incarnation: _Optional[int] = ..., sources: _Optional[_Iterable[_Union[SourceReadySpec, _Mapping]]] = ...) -> None: ...

class MarkSourcesReadyResponse(_message.Message):
    __slots__ = ("header", "results")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    header: ResponseHeader
    results: _containers.RepeatedCompositeFieldContainer[ItemResult]
    def __init__(self, header: _Optional[_Union[ResponseHeader, _Mapping]] = ..., results: _Optional[_Iterable[_Union[ItemResult, _Mapping]]] = ...) -> None: ...

class WrittenPart(_message.Message):
    __slots__ = ("first_token", "num_tokens", "first_layer", "num_layers")
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FIRST_LAYER_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    first_token: int
    num_tokens: int
    first_layer: int
    num_layers: int
    def __init__(self, first_token: _Optional[int] = ..., num_tokens: _Optional[int] = ..., first_layer: _Optional[int] = ..., num_layers: _Optional[int] = ...) -> None: ...

class CompletionSpec(_message.Message):
    __slots__ = ("transfer_id", "generation", "outcome", "message", "ranks", "parts")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    PARTS_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    generation: int
    outcome: CompletionOutcome
    message: str
    ranks: _containers.RepeatedScalarFieldContainer[int]
    parts: _containers.RepeatedCompositeFieldContainer[WrittenPart]
    def __init__(self, transfer_id: _Optional[str] = ..., generation: _Optional[int] = ..., outcome: _Optional[_Union[CompletionOutcome, str]] = ..., message: _Optional[str] = ..., ranks: _Optional[_Iterable[int]] = ..., parts: _Optional[_Iterable[_Union[WrittenPart, _Mapping]]] = ...) -> None: ...

class CompleteTransfersRequest(_message.Message):
    __slots__ = ("request_id", "engine_id", "incarnation", "completions")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    COMPLETIONS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    engine_id: str
    incarnation: int
    completions: _containers.RepeatedCompositeFieldContainer[CompletionSpec]
    def __init__(self, request_id: _Optional[str] = ..., engine_id: _Optional[str] = ..., incarnation: _Optional[int] = ..., completions: _Optional[_Iterable[_Union[CompletionSpec, _Mapping]]] = ...) -> None: ...

class CompleteTransfersResponse(_message.Message):
    __slots__ = ("header", "results")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    header: ResponseHeader
    results: _containers.RepeatedCompositeFieldContainer[ItemResult]
    def __init__(self, header: _Optional[_Union[ResponseHeader, _Mapping]] = ..., results: _Optional[_Iterable[_Union[ItemResult, _Mapping]]] = ...) -> None: ...

class RevocationAck(_message.Message):
    __slots__ = ("transfer_id", "generation", "ranks")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    generation: int
    ranks: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, transfer_id: _Optional[str] = ..., generation: _Optional[int] = ..., ranks: _Optional[_Iterable[int]] = ...) -> None: ...

class AcknowledgeRevocationsRequest(_message.Message):
    __slots__ = ("request_id", "engine_id", "incarnation", "acks")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    ACKS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    engine_id: str
    incarnation: int
    acks: _containers.RepeatedCompositeFieldContainer[RevocationAck]
    def __init__(self, request_id: _Optional[str] = ..., engine_id: _Optional[str] = ..., incarnation: _Optional[int] = ..., acks: _Optional[_Iterable[_Union[RevocationAck, _Mapping]]] = ...) -> None: ...

class AcknowledgeRevocationsResponse(_message.Message):
    __slots__ = ("header", "results")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    header: ResponseHeader
    results: _containers.RepeatedCompositeFieldContainer[ItemResult]
    def __init__(self, header: _Optional[_Union[ResponseHeader, _Mapping]] = ..., results: _Optional[_Iterable[_Union[ItemResult, _Mapping]]] = ...) -> None: ...

class ReleaseSpec(_message.Message):
    __slots__ = ("transfer_id", "generation")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    generation: int
    def __init__(self, transfer_id: _Optional[str] = ..., generation: _Optional[int] = ...) -> None: ...

class ReleaseTargetsRequest(_message.Message):
    __slots__ = ("request_id", "engine_id", "incarnation", "releases")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    RELEASES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    engine_id: str
    incarnation: int
    releases: _containers.RepeatedCompositeFieldContainer[ReleaseSpec]
    def __init__(self, request_id: _Optional[str] = ..., engine_id: _Optional[str] = ..., incarnation: _Optional[int] = ..., releases: _Optional[_Iterable[_Union[ReleaseSpec, _Mapping]]] = ...) -> None: ...

class ReleaseTargetsResponse(_message.Message):
    __slots__ = ("header", "results")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    header: ResponseHeader
    results: _containers.RepeatedCompositeFieldContainer[ItemResult]
    def __init__(self, header: _Optional[_Union[ResponseHeader, _Mapping]] = ..., results: _Optional[_Iterable[_Union[ItemResult, _Mapping]]] = ...) -> None: ...

class AbortSpec(_message.Message):
    __slots__ = ("transfer_id", "message")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    message: str
    def __init__(self, transfer_id: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

class AbortTransfersRequest(_message.Message):
    __slots__ = ("request_id", "engine_id", "incarnation", "aborts")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    ABORTS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    engine_id: str
    incarnation: int
    aborts: _containers.RepeatedCompositeFieldContainer[AbortSpec]
    def __init__(self, request_id: _Optional[str] = ..., engine_id: _Optional[str] = ..., incarnation: _Optional[int] = ..., aborts: _Optional[_Iterable[_Union[AbortSpec, _Mapping]]] = ...) -> None: ...

class AbortTransfersResponse(_message.Message):
    __slots__ = ("header", "results")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    header: ResponseHeader
    results: _containers.RepeatedCompositeFieldContainer[ItemResult]
    def __init__(self, header: _Optional[_Union[ResponseHeader, _Mapping]] = ..., results: _Optional[_Iterable[_Union[ItemResult, _Mapping]]] = ...) -> None: ...

class GetTransferRequest(_message.Message):
    __slots__ = ("transfer_id",)
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    def __init__(self, transfer_id: _Optional[str] = ...) -> None: ...

class GetTransferResponse(_message.Message):
    __slots__ = ("header", "transfer")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_FIELD_NUMBER: _ClassVar[int]
    header: ResponseHeader
    transfer: Transfer
    def __init__(self, header: _Optional[_Union[ResponseHeader, _Mapping]] = ..., transfer: _Optional[_Union[Transfer, _Mapping]] = ...) -> None: ...

class ListTransfersRequest(_message.Message):
    __slots__ = ("engine_id", "states", "page_size", "page_token")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    STATES_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    states: _containers.RepeatedScalarFieldContainer[TransferState]
    page_size: int
    page_token: str
    def __init__(self, engine_id: _Optional[str] = ..., states: _Optional[_Iterable[_Union[TransferState, str]]] = ..., page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class ListTransfersResponse(_message.Message):
    __slots__ = ("header", "transfers", "next_page_token")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    TRANSFERS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    header: ResponseHeader
    transfers: _containers.RepeatedCompositeFieldContainer[Transfer]
    next_page_token: str
    def __init__(self, header: _Optional[_Union[ResponseHeader, _Mapping]] = ..., transfers: _Optional[_Iterable[_Union[Transfer, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class Event(_message.Message):
    __slots__ = ("sequence", "type", "transfer", "generation", "peer", "event_time")
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    PEER_FIELD_NUMBER: _ClassVar[int]
    EVENT_TIME_FIELD_NUMBER: _ClassVar[int]
    sequence: int
    type: EventType
    transfer: Transfer
    generation: int
    peer: Engine
    event_time: _timestamp_pb2.Timestamp
    def __init__(self, sequence: _Optional[int] = ..., type: _Optional[_Union[EventType, str]] = ..., transfer: _Optional[_Union[Transfer, _Mapping]] = ..., generation: _Optional[int] = ..., peer: _Optional[_Union[Engine, _Mapping]] = ..., event_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class WatchRequest(_message.Message):
    __slots__ = ("engine_id", "start_sequence", "max_batch")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    START_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    start_sequence: int
    max_batch: int
    def __init__(self, engine_id: _Optional[str] = ..., start_sequence: _Optional[int] = ..., max_batch: _Optional[int] = ...) -> None: ...

class WatchResponse(_message.Message):
    __slots__ = ("header", "events", "resync_required", "resync_sequence")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    RESYNC_REQUIRED_FIELD_NUMBER: _ClassVar[int]
    RESYNC_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    header: ResponseHeader
    events: _containers.RepeatedCompositeFieldContainer[Event]
    resync_required: bool
    resync_sequence: int
    def __init__(self, header: _Optional[_Union[ResponseHeader, _Mapping]] = ..., events: _Optional[_Iterable[_Union[Event, _Mapping]]] = ..., resync_required: _Optional[bool] = ..., resync_sequence: _Optional[int] = ...) -> None: ...

class GetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetStatusResponse(_message.Message):
    __slots__ = ("header", "version", "store", "live_engines", "transfers_by_state", "watchers", "start_time")
    class TransfersByStateEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    HEADER_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    STORE_FIELD_NUMBER: _ClassVar[int]
    LIVE_ENGINES_FIELD_NUMBER: _ClassVar[int]
    TRANSFERS_BY_STATE_FIELD_NUMBER: _ClassVar[int]
    WATCHERS_FIELD_NUMBER: _ClassVar[int]
    START_TIME_FIELD_NUMBER: _ClassVar[int]
    header: ResponseHeader
    version: str
    store: str
    live_engines: int
    transfers_by_state: _containers.ScalarMap[str, int]
    watchers: int
    start_time: _timestamp_pb2.Timestamp
    def __init__(self, header: _Optional[_Union[ResponseHeader, _Mapping]] = ..., version: _Optional[str] = ..., store: _Optional[str] = ..., live_engines: _Optional[int] = ..., transfers_by_state: _Optional[_Mapping[str, int]] = ..., watchers: _Optional[int] = ..., start_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...
