"""What the engine hands back for a request: cumulative text/tokens plus this step's delta."""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.kv_transfer import KVPayload


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top_logprobs: dict[int, float]


@dataclass
class RequestOutput:
    req_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop", "length" or "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    logprobs: list[TokenLogprob] | None = None
    num_cached_tokens: int = 0
    # this step's increment, for streaming
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    arrival_time: float = 0.0
    first_scheduled_time: float | None = None  # admitted into a step; minus arrival = queue time
    first_token_time: float | None = None
    finished_time: float | None = None
    kv_export: KVPayload | None = None  # prefill mode: the prompt's KV, on the final output
    # why the engine ended the request itself (finish_reason "abort"), naming the field:
    # e.g. its structured_outputs spec did not compile
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
