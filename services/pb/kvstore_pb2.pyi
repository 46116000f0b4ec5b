from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KVBlockHeader(_message.Message):
    __slots__ = ("block_hash", "tail_key", "dtype", "shape", "layer_start", "layer_end", "num_tokens", "model_fingerprint", "model_id", "checksum", "seal")
    BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    TAIL_KEY_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    SEAL_FIELD_NUMBER: _ClassVar[int]
    block_hash: bytes
    tail_key: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    layer_start: int
    layer_end: int
    num_tokens: int
    model_fingerprint: bytes
    model_id: str
    checksum: int
    seal: bytes
    def __init__(self, block_hash: _Optional[bytes] = ..., tail_key: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., layer_start: _Optional[int] = ..., layer_end: _Optional[int] = ..., num_tokens: _Optional[int] = ..., model_fingerprint: _Optional[bytes] = ..., model_id: _Optional[str] = ..., checksum: _Optional[int] = ..., seal: _Optional[bytes] = ...) -> None: ...

class KVBlock(_message.Message):
    __slots__ = ("header", "data", "found")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    FOUND_FIELD_NUMBER: _ClassVar[int]
    header: KVBlockHeader
    data: bytes
    found: bool
    def __init__(self, header: _Optional[_Union[KVBlockHeader, _Mapping]] = ..., data: _Optional[bytes] = ..., found: _Optional[bool] = ...) -> None: ...

class PutBlocksRequest(_message.Message):
    __slots__ = ("lease_id", "headers", "data", "bytes_in_data_plane")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    HEADERS_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    BYTES_IN_DATA_PLANE_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    headers: _containers.RepeatedCompositeFieldContainer[KVBlockHeader]
    data: bytes
    bytes_in_data_plane: bool
    def __init__(self, lease_id: _Optional[str] = ..., headers: _Optional[_Iterable[_Union[KVBlockHeader, _Mapping]]] = ..., data: _Optional[bytes] = ..., bytes_in_data_plane: _Optional[bool] = ...) -> None: ...

class KVBlockBatch(_message.Message):
    __slots__ = ("headers", "found", "data")
    HEADERS_FIELD_NUMBER: _ClassVar[int]
    FOUND_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    headers: _containers.RepeatedCompositeFieldContainer[KVBlockHeader]
    found: _containers.RepeatedScalarFieldContainer[bool]
    data: bytes
    def __init__(self, headers: _Optional[_Iterable[_Union[KVBlockHeader, _Mapping]]] = ..., found: _Optional[_Iterable[bool]] = ..., data: _Optional[bytes] = ...) -> None: ...

class PutRequest(_message.Message):
    __slots__ = ("lease_id", "block")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    block: KVBlock
    def __init__(self, lease_id: _Optional[str] = ..., block: _Optional[_Union[KVBlock, _Mapping]] = ...) -> None: ...

class PutResponse(_message.Message):
    __slots__ = ("num_stored", "num_bytes")
    NUM_STORED_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    num_stored: int
    num_bytes: int
    def __init__(self, num_stored: _Optional[int] = ..., num_bytes: _Optional[int] = ...) -> None: ...

class GetRequest(_message.Message):
    __slots__ = ("block_hashes", "tail_keys", "lease_id", "wait_ms", "headers_only")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    TAIL_KEYS_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    HEADERS_ONLY_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    tail_keys: _containers.RepeatedScalarFieldContainer[str]
    lease_id: str
    wait_ms: int
    headers_only: bool
    def __init__(self, block_hashes: _Optional[_Iterable[bytes]] = ..., tail_keys: _Optional[_Iterable[str]] = ..., lease_id: _Optional[str] = ..., wait_ms: _Optional[int] = ..., headers_only: _Optional[bool] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("block_hashes", "lease_id")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    lease_id: str
    def __init__(self, block_hashes: _Optional[_Iterable[bytes]] = ..., lease_id: _Optional[str] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("num_prefix_found",)
    NUM_PREFIX_FOUND_FIELD_NUMBER: _ClassVar[int]
    num_prefix_found: int
    def __init__(self, num_prefix_found: _Optional[int] = ...) -> None: ...

class CreateLeaseRequest(_message.Message):
    __slots__ = ("ttl_ms", "req_id", "write_pending")
    TTL_MS_FIELD_NUMBER: _ClassVar[int]
    REQ_ID_FIELD_NUMBER: _ClassVar[int]
    WRITE_PENDING_FIELD_NUMBER: _ClassVar[int]
    ttl_ms: int
    req_id: str
    write_pending: bool
    def __init__(self, ttl_ms: _Optional[int] = ..., req_id: _Optional[str] = ..., write_pending: _Optional[bool] = ...) -> None: ...

class EndWriteRequest(_message.Message):
    __slots__ = ("lease_id", "failed")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    failed: bool
    def __init__(self, lease_id: _Optional[str] = ..., failed: _Optional[bool] = ...) -> None: ...

class EndWriteResponse(_message.Message):
    __slots__ = ("ended",)
    ENDED_FIELD_NUMBER: _ClassVar[int]
    ended: bool
    def __init__(self, ended: _Optional[bool] = ...) -> None: ...

class Lease(_message.Message):
    __slots__ = ("lease_id", "ttl_ms")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    TTL_MS_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    ttl_ms: int
    def __init__(self, lease_id: _Optional[str] = ..., ttl_ms: _Optional[int] = ...) -> None: ...

class ReleaseLeaseRequest(_message.Message):
    __slots__ = ("lease_id", "drop_tail")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    DROP_TAIL_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    drop_tail: bool
    def __init__(self, lease_id: _Optional[str] = ..., drop_tail: _Optional[bool] = ...) -> None: ...

class ReleaseLeaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KVStoreStats(_message.Message):
    __slots__ = ("capacity_bytes", "used_bytes", "num_blocks", "num_pinned_blocks", "num_active_leases", "num_hits", "num_misses", "num_evictions")
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_PINNED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_ACTIVE_LEASES_FIELD_NUMBER: _ClassVar[int]
    NUM_HITS_FIELD_NUMBER: _ClassVar[int]
    NUM_MISSES_FIELD_NUMBER: _ClassVar[int]
    NUM_EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    capacity_bytes: int
    used_bytes: int
    num_blocks: int
    num_pinned_blocks: int
    num_active_leases: int
    num_hits: int
    num_misses: int
    num_evictions: int
    def __init__(self, capacity_bytes: _Optional[int] = ..., used_bytes: _Optional[int] = ..., num_blocks: _Optional[int] = ..., num_pinned_blocks: _Optional[int] = ..., num_active_leases: _Optional[int] = ..., num_hits: _Optional[int] = ..., num_misses: _Optional[int] = ..., num_evictions: _Optional[int] = ...) -> None: ...
