from . import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DecodeRequest(_message.Message):
    __slots__ = ("req_id", "prompt_token_ids", "sampling", "first_token_id", "kv_handle", "priority", "prefill_chunk_tokens", "cache_salt", "output_token_ids", "n", "shared_lease", "slo")
    REQ_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    KV_HANDLE_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    PREFILL_CHUNK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    SHARED_LEASE_FIELD_NUMBER: _ClassVar[int]
    SLO_FIELD_NUMBER: _ClassVar[int]
    req_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    first_token_id: int
    kv_handle: _common_pb2.KVHandle
    priority: int
    prefill_chunk_tokens: int
    cache_salt: str
    output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    n: int
    shared_lease: bool
    slo: _common_pb2.SLOTargets
    def __init__(self, req_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., first_token_id: _Optional[int] = ..., kv_handle: _Optional[_Union[_common_pb2.KVHandle, _Mapping]] = ..., priority: _Optional[int] = ..., prefill_chunk_tokens: _Optional[int] = ..., cache_salt: _Optional[str] = ..., output_token_ids: _Optional[_Iterable[int]] = ..., n: _Optional[int] = ..., shared_lease: _Optional[bool] = ..., slo: _Optional[_Union[_common_pb2.SLOTargets, _Mapping]] = ...) -> None: ...
