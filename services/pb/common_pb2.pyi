from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos", "logprobs", "structured_outputs", "repetition_penalty", "presence_penalty", "frequency_penalty", "logit_bias", "min_tokens", "bad_words", "allowed_token_ids", "prompt_logprobs", "include_stop_str_in_output", "skip_special_tokens")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BAD_WORDS_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    logprobs: int
    structured_outputs: StructuredOutputs
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    min_tokens: int
    bad_words: _containers.RepeatedScalarFieldContainer[str]
    allowed_token_ids: TokenIds
    prompt_logprobs: int
    include_stop_str_in_output: bool
    skip_special_tokens: bool
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[int] = ..., structured_outputs: _Optional[_Union[StructuredOutputs, _Mapping]] = ..., repetition_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., min_tokens: _Optional[int] = ..., bad_words: _Optional[_Iterable[str]] = ..., allowed_token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., prompt_logprobs: _Optional[int] = ..., include_stop_str_in_output: _Optional[bool] = ..., skip_special_tokens: _Optional[bool] = ...) -> None: ...

class StructuredOutputs(_message.Message):
    __slots__ = ("json", "regex", "choice", "grammar", "json_object", "disable_any_whitespace")
    JSON_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    DISABLE_ANY_WHITESPACE_FIELD_NUMBER: _ClassVar[int]
    json: str
    regex: str
    choice: ChoiceList
    grammar: str
    json_object: bool
    disable_any_whitespace: bool
    def __init__(self, json: _Optional[str] = ..., regex: _Optional[str] = ..., choice: _Optional[_Union[ChoiceList, _Mapping]] = ..., grammar: _Optional[str] = ..., json_object: _Optional[bool] = ..., disable_any_whitespace: _Optional[bool] = ...) -> None: ...

class ChoiceList(_message.Message):
    __slots__ = ("choices",)
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    choices: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, choices: _Optional[_Iterable[str]] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "top_logprobs")
    class TopLogprobsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top_logprobs: _containers.ScalarMap[int, float]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top_logprobs: _Optional[_Mapping[int, float]] = ...) -> None: ...

class PromptLogprobs(_message.Message):
    __slots__ = ("tokens", "ranks")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    ranks: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, tokens: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., ranks: _Optional[_Iterable[int]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_prompt_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_prompt_tokens: _Optional[int] = ...) -> None: ...

class Timings(_message.Message):
    __slots__ = ("router_queue_s", "prefill_queue_s", "prefill_s", "kv_write_s", "kv_read_s", "decode_join_s", "ttft_s")
    ROUTER_QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_S_FIELD_NUMBER: _ClassVar[int]
    KV_WRITE_S_FIELD_NUMBER: _ClassVar[int]
    KV_READ_S_FIELD_NUMBER: _ClassVar[int]
    DECODE_JOIN_S_FIELD_NUMBER: _ClassVar[int]
    TTFT_S_FIELD_NUMBER: _ClassVar[int]
    router_queue_s: float
    prefill_queue_s: float
    prefill_s: float
    kv_write_s: float
    kv_read_s: float
    decode_join_s: float
    ttft_s: float
    def __init__(self, router_queue_s: _Optional[float] = ..., prefill_queue_s: _Optional[float] = ..., prefill_s: _Optional[float] = ..., kv_write_s: _Optional[float] = ..., kv_read_s: _Optional[float] = ..., decode_join_s: _Optional[float] = ..., ttft_s: _Optional[float] = ...) -> None: ...

class KVHandle(_message.Message):
    __slots__ = ("block_hashes", "tail_key", "num_tokens", "lease_id", "kvstore_address")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    TAIL_KEY_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    KVSTORE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    tail_key: str
    num_tokens: int
    lease_id: str
    kvstore_address: str
    def __init__(self, block_hashes: _Optional[_Iterable[bytes]] = ..., tail_key: _Optional[str] = ..., num_tokens: _Optional[int] = ..., lease_id: _Optional[str] = ..., kvstore_address: _Optional[str] = ...) -> None: ...

class WorkerLoad(_message.Message):
    __slots__ = ("num_running", "num_waiting", "num_queued_prefill_tokens", "num_free_kv_blocks", "num_total_kv_blocks", "max_num_seqs", "draining", "prefill_tokens_per_s", "decode_step_ms", "queued_prefill", "max_step_ms", "tpot_stall_room_ms")
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_QUEUED_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOTAL_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    DECODE_STEP_MS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_PREFILL_FIELD_NUMBER: _ClassVar[int]
    MAX_STEP_MS_FIELD_NUMBER: _ClassVar[int]
    TPOT_STALL_ROOM_MS_FIELD_NUMBER: _ClassVar[int]
    num_running: int
    num_waiting: int
    num_queued_prefill_tokens: int
    num_free_kv_blocks: int
    num_total_kv_blocks: int
    max_num_seqs: int
    draining: bool
    prefill_tokens_per_s: float
    decode_step_ms: float
    queued_prefill: _containers.RepeatedCompositeFieldContainer[QueuedPrefill]
    max_step_ms: float
    tpot_stall_room_ms: float
    def __init__(self, num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., num_queued_prefill_tokens: _Optional[int] = ..., num_free_kv_blocks: _Optional[int] = ..., num_total_kv_blocks: _Optional[int] = ..., max_num_seqs: _Optional[int] = ..., draining: _Optional[bool] = ..., prefill_tokens_per_s: _Optional[float] = ..., decode_step_ms: _Optional[float] = ..., queued_prefill: _Optional[_Iterable[_Union[QueuedPrefill, _Mapping]]] = ..., max_step_ms: _Optional[float] = ..., tpot_stall_room_ms: _Optional[float] = ...) -> None: ...

class QueuedPrefill(_message.Message):
    __slots__ = ("priority", "min_rank_tokens", "max_rank_tokens", "num_requests", "num_tokens")
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    MIN_RANK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_RANK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    priority: int
    min_rank_tokens: int
    max_rank_tokens: int
    num_requests: int
    num_tokens: int
    def __init__(self, priority: _Optional[int] = ..., min_rank_tokens: _Optional[int] = ..., max_rank_tokens: _Optional[int] = ..., num_requests: _Optional[int] = ..., num_tokens: _Optional[int] = ...) -> None: ...

class SLOTargets(_message.Message):
    __slots__ = ("ttft_budget_ms", "min_class_ttft_ms", "itl_target_ms")
    TTFT_BUDGET_MS_FIELD_NUMBER: _ClassVar[int]
    MIN_CLASS_TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    ITL_TARGET_MS_FIELD_NUMBER: _ClassVar[int]
    ttft_budget_ms: float
    min_class_ttft_ms: float
    itl_target_ms: float
    def __init__(self, ttft_budget_ms: _Optional[float] = ..., min_class_ttft_ms: _Optional[float] = ..., itl_target_ms: _Optional[float] = ...) -> None: ...

class GetLoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("req_id", "token_ids", "text", "finish_reason", "logprobs", "usage", "timings", "path", "prompt_logprobs", "index")
    REQ_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    req_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: str
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    usage: Usage
    timings: Timings
    path: str
    prompt_logprobs: PromptLogprobs
    index: int
    def __init__(self, req_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., timings: _Optional[_Union[Timings, _Mapping]] = ..., path: _Optional[str] = ..., prompt_logprobs: _Optional[_Union[PromptLogprobs, _Mapping]] = ..., index: _Optional[int] = ...) -> None: ...
