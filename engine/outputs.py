"""What the engine hands back for a request: cumulative text/tokens plus this step's delta."""
from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.engine.kv_transfer import KVPayload


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top_logprobs: dict[int, float]


@dataclass
class Logprob:
    """vLLM's: one token's logprob in a distribution, its rank there (1: the most likely)
    and its text, the token decoded alone."""
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# vLLM's prompt_logprobs: per prompt token, {token id: Logprob} holding the prompt token and
# the top N of its position; the first prompt token has nothing before it: None
PromptLogprobs = list[dict[int, Logprob] | None]


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
    # SamplingParams.prompt_logprobs: set once the prompt is computed (with the first token);
    # None on a decode-only request (its prefill worker computed them)
    prompt_logprobs: PromptLogprobs | None = None
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
    # SamplingParams.n > 1: which of the request's n completions this is; the engine's outputs
    # of all n carry the request's req_id (engine/parallel_sampling.py)
    index: int = 0
    # LLM.generate / LLM.chat with n > 1: the prompt's other completions, index 1..n-1
    # (`outputs` has all n); empty on the engine's own outputs
    other_outputs: list[RequestOutput] = field(default_factory=list, repr=False, compare=False)

    @property
    def outputs(self) -> list[RequestOutput]:
        """The prompt's n completions in index order, this one first (vLLM's
        RequestOutput.outputs; each a RequestOutput with text, token_ids, finish_reason,
        logprobs and index): [self] for n = 1."""
        return [self, *self.other_outputs]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
