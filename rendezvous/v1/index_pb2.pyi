from rendezvous.v1 import rendezvous_pb2 as _rendezvous_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class BlockHashing(_message.Message):
    __slots__ = ("algorithm", "seed", "block_size", "integer_hashes")
    ALGORITHM_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    INTEGER_HASHES_FIELD_NUMBER: _ClassVar[int]
    algorithm: str
    seed: str
    block_size: int
    integer_hashes: bool
    def __init__(self, algorithm: _Optional[str] = ..., seed: _Optional[str] = ..., block_size: _Optional[int] = ..., integer_hashes: _Optional[bool] = ...) -> None: ...

class BlocksStored(_message.Message):
    __slots__ = ("block_hashes", "parent_block_hash", "group_index", "token_count")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    PARENT_BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    GROUP_INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_COUNT_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    parent_block_hash: bytes
    group_index: int
    token_count: int
    def __init__(self, block_hashes: _Optional[_Iterable[bytes]] = ..., parent_block_hash: _Optional[bytes] = ..., group_index: _Optional[int] = ..., token_count: _Optional[int] = ...) -> None: ...

class BlocksRemoved(_message.Message):
    __slots__ = ("block_hashes", "group_index")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    GROUP_INDEX_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    group_index: int
    def __init__(self, block_hashes: _Optional[_Iterable[bytes]] = ..., group_index: _Optional[int] = ...) -> None: ...

class AllBlocksCleared(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CacheEvent(_message.Message):
    __slots__ = ("stored", "removed", "cleared")
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    CLEARED_FIELD_NUMBER: _ClassVar[int]
    stored: BlocksStored
    removed: BlocksRemoved
    cleared: AllBlocksCleared
    def __init__(self, stored: _Optional[_Union[BlocksStored, _Mapping]] = ..., removed: _Optional[_Union[BlocksRemoved, _Mapping]] = ..., cleared: _Optional[_Union[AllBlocksCleared, _Mapping]] = ...) -> None: ...

class ReportCacheEventsRequest(_message.Message):
    __slots__ = ("engine_id", "incarnation", "sequence", "hashing", "events")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    HASHING_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    incarnation: int
    sequence: int
    hashing: BlockHashing
    events: _containers.RepeatedCompositeFieldContainer[CacheEvent]
    def __init__(self, engine_id: _Optional[str] = ..., incarnation: _Optional[int] = ..., sequence: _Optional[int] = ..., hashing: _Optional[_Union[BlockHashing, _Mapping]] = ..., events: _Optional[_Iterable[_Union[CacheEvent, _Mapping]]] = ...) -> None: ...

class ReportCacheEventsResponse(_message.Message):
    __slots__ = ("header", "sequence", "duplicate", "block_count")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_COUNT_FIELD_NUMBER: _ClassVar[int]
    header: _rendezvous_pb2.ResponseHeader
    sequence: int
    duplicate: bool
    block_count: int
    def __init__(self, header: _Optional[_Union[_rendezvous_pb2.ResponseHeader, _Mapping]] = ..., sequence: _Optional[int] = ..., duplicate: _Optional[bool] = ..., block_count: _Optional[int] = ...) -> None: ...

class CachedBlocks(_message.Message):
    __slots__ = ("group_index", "block_hashes")
    GROUP_INDEX_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    group_index: int
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, group_index: _Optional[int] = ..., block_hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class ReplaceCachedBlocksRequest(_message.Message):
    __slots__ = ("engine_id", "incarnation", "sequence", "hashing", "groups")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    HASHING_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    incarnation: int
    sequence: int
    hashing: BlockHashing
    groups: _containers.RepeatedCompositeFieldContainer[CachedBlocks]
    def __init__(self, engine_id: _Optional[str] = ..., incarnation: _Optional[int] = ..., sequence: _Optional[int] = ..., hashing: _Optional[_Union[BlockHashing, _Mapping]] = ..., groups: _Optional[_Iterable[_Union[CachedBlocks, _Mapping]]] = ...) -> None: ...

class ReplaceCachedBlocksResponse(_message.Message):
    __slots__ = ("header", "sequence", "block_count", "left_out", "cut_by")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_COUNT_FIELD_NUMBER: _ClassVar[int]
    LEFT_OUT_FIELD_NUMBER: _ClassVar[int]
    CUT_BY_FIELD_NUMBER: _ClassVar[int]
    header: _rendezvous_pb2.ResponseHeader
    sequence: int
    block_count: int
    left_out: int
    cut_by: str
    def __init__(self, header: _Optional[_Union[_rendezvous_pb2.ResponseHeader, _Mapping]] = ..., sequence: _Optional[int] = ..., block_count: _Optional[int] = ..., left_out: _Optional[int] = ..., cut_by: _Optional[str] = ...) -> None: ...

class MatchPrefixesRequest(_message.Message):
    __slots__ = ("block_hashes", "group_index", "pools", "engine_ids", "role", "min_matched_blocks")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    GROUP_INDEX_FIELD_NUMBER: _ClassVar[int]
    POOLS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_IDS_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    MIN_MATCHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    group_index: int
    pools: _containers.RepeatedScalarFieldContainer[str]
    engine_ids: _containers.RepeatedScalarFieldContainer[str]
    role: _rendezvous_pb2.EngineRole
    min_matched_blocks: int
    def __init__(self, block_hashes: _Optional[_Iterable[bytes]] = ..., group_index: _Optional[int] = ..., pools: _Optional[_Iterable[str]] = ..., engine_ids: _Optional[_Iterable[str]] = ..., role: _Optional[_Union[_rendezvous_pb2.EngineRole, str]] = ..., min_matched_blocks: _Optional[int] = ...) -> None: ...

class PrefixMatch(_message.Message):
    __slots__ = ("engine_id", "pool", "role", "matched_blocks", "hashing", "sequence", "incarnation", "at_least")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    MATCHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HASHING_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    AT_LEAST_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    pool: str
    role: _rendezvous_pb2.EngineRole
    matched_blocks: int
    hashing: BlockHashing
    sequence: int
    incarnation: int
    at_least: bool
    def __init__(self, engine_id: _Optional[str] = ..., pool: _Optional[str] = ..., role: _Optional[_Union[_rendezvous_pb2.EngineRole, str]] = ..., matched_blocks: _Optional[int] = ..., hashing: _Optional[_Union[BlockHashing, _Mapping]] = ..., sequence: _Optional[int] = ..., incarnation: _Optional[int] = ..., at_least: _Optional[bool] = ...) -> None: ...

class MatchPrefixesResponse(_message.Message):
    __slots__ = ("header", "matches", "left_out")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    MATCHES_FIELD_NUMBER: _ClassVar[int]
    LEFT_OUT_FIELD_NUMBER: _ClassVar[int]
    header: _rendezvous_pb2.ResponseHeader
    matches: _containers.RepeatedCompositeFieldContainer[PrefixMatch]
    left_out: int
    def __init__(self, header: _Optional[_Union[_rendezvous_pb2.ResponseHeader, _Mapping]] = ..., matches: _Optional[_Iterable[_Union[PrefixMatch, _Mapping]]] = ..., left_out: _Optional[int] = ...) -> None: ...
