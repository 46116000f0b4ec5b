"""What the scheduler tells the model runner for one step.

Full data for a request is sent once (NewRequestData, also when a preempted request
resumes); after that only diffs (CachedRequestData). The runner keeps its own copy of each
request's tokens and block table.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.engine.kv_transfer import KVLoad
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.structured.bitmask import GrammarBitmask


@dataclass
class NewRequestData:
    req_id: str
    token_ids: list[int]  # prompt plus any output produced before a preemption
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    kv_load: KVLoad | None = None  # imported KV to write before this step's forward
    # the first this many of token_ids are the prompt, the rest output (penalties count it); None: all
    num_prompt_tokens: int | None = None


@dataclass
class CachedRequestData:
    req_id: str
    new_block_ids: list[int]
    num_computed_tokens: int
    # the runner keeps this many of the request's block ids before appending the new ones
    # (fewer than it has after rejected drafts gave blocks back); None: all
    num_kept_blocks: int | None = None


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)
    scheduled_cached_reqs: list[CachedRequestData] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    total_num_scheduled_tokens: int = 0
    # requests the runner must forget before this step (finished, aborted or preempted)
    finished_req_ids: set[str] = field(default_factory=set)
    preempted_req_ids: set[str] = field(default_factory=set)
    # structured outputs: the next-token bitmask of the guided requests that sample this step
    grammar_bitmask: GrammarBitmask | None = None
    # speculative decoding: draft tokens scored after each such request's last token
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # the host tier (engine/core/host_tier.py): blocks to copy before this step's forward,
    # first (device block id, host slot) out of the device, then (host slot, device block id) in
    kv_offloads: list[tuple[int, int]] = field(default_factory=list)
    kv_onloads: list[tuple[int, int]] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0

    @property
    def has_host_copies(self) -> bool:
        return bool(self.kv_offloads or self.kv_onloads)


@dataclass
class PromptLogprobRows:
    """One step's prompt logprobs of a request (SamplingParams.prompt_logprobs): entry i is
    prompt token `first + i` given the tokens before it (first >= 1: the first has none)."""
    first: int
    token_ids: list[int]
    logprobs: list[float]
    ranks: list[int]                      # in its position's distribution; 1: the most likely
    top_logprobs: list[dict[int, float]]  # the N most likely there, N = prompt_logprobs


@dataclass
class ModelRunnerOutput:
    # the tokens of each request that reached the end of its known tokens: one, or with
    # drafts the accepted ones plus the target's own
    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # per sampled request, per token: (its logprob, {token_id: logprob} of the top N)
    logprobs: dict[str, list[tuple[float, dict[int, float]]]] = field(default_factory=dict)
    # the requests with prompt_logprobs whose prompt this step computed a chunk of
    prompt_logprobs: dict[str, PromptLogprobRows] = field(default_factory=dict)
