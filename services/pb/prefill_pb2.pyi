from . import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PrefillRequest(_message.Message):
    __slots__ = ("req_id", "prompt_token_ids", "sampling", "priority", "cache_salt", "n", "slo")
    REQ_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    SLO_FIELD_NUMBER: _ClassVar[int]
    req_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    priority: int
    cache_salt: str
    n: int
    slo: _common_pb2.SLOTargets
    def __init__(self, req_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., priority: _Optional[int] = ..., cache_salt: _Optional[str] = ..., n: _Optional[int] = ..., slo: _Optional[_Union[_common_pb2.SLOTargets, _Mapping]] = ...) -> None: ...

class FirstToken(_message.Message):
    __slots__ = ("token_id", "text", "finish_reason", "logprob", "handoff")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    text: str
    finish_reason: str
    logprob: _common_pb2.TokenLogprob
    handoff: bool
    def __init__(self, token_id: _Optional[int] = ..., text: _Optional[str] = ..., finish_reason: _Optional[str] = ..., logprob: _Optional[_Union[_common_pb2.TokenLogprob, _Mapping]] = ..., handoff: _Optional[bool] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("req_id", "kv_handle", "num_cached_tokens", "timings", "prompt_logprobs", "choices")
    REQ_ID_FIELD_NUMBER: _ClassVar[int]
    KV_HANDLE_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    req_id: str
    kv_handle: _common_pb2.KVHandle
    num_cached_tokens: int
    timings: _common_pb2.Timings
    prompt_logprobs: _common_pb2.PromptLogprobs
    choices: _containers.RepeatedCompositeFieldContainer[FirstToken]
    def __init__(self, req_id: _Optional[str] = ..., kv_handle: _Optional[_Union[_common_pb2.KVHandle, _Mapping]] = ..., num_cached_tokens: _Optional[int] = ..., timings: _Optional[_Union[_common_pb2.Timings, _Mapping]] = ..., prompt_logprobs: _Optional[_Union[_common_pb2.PromptLogprobs, _Mapping]] = ..., choices: _Optional[_Iterable[_Union[FirstToken, _Mapping]]] = ...) -> None: ...
