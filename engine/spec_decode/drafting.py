"""Each step's drafts for the running requests, and what became of them (the counts in
EngineStats.spec, and the pause of a request whose drafts keep failing)."""
from __future__ import annotations

from pdserve.engine.request import Request, RequestMode
from pdserve.engine.spec_decode.config import SpeculativeConfig
from pdserve.engine.spec_decode.proposer import DraftRequest, NoProposer, Proposer
from pdserve.engine.stats import SpecDecodeStats
from pdserve.engine.structured.manager import StructuredOutputManager


class Drafting:
    def __init__(self, proposer: Proposer, num_speculative_tokens: int, disable_by_batch_size: int,
                 max_model_len: int):
        self.proposer = proposer
        self.num_speculative_tokens = num_speculative_tokens
        self.disable_by_batch_size = disable_by_batch_size
        self.max_model_len = max_model_len
        self.stats = SpecDecodeStats()

    @classmethod
    def of(cls, spec: SpeculativeConfig, proposer: Proposer, max_model_len: int) -> Drafting:
        return cls(proposer, spec.num_speculative_tokens, spec.disable_by_batch_size, max_model_len)

    def propose(self, running: list[Request]) -> None:
        """Draft tokens for the running requests that decode this step (none for a prefill-
        only request, or when the batch is past disable_by_batch_size). Drafts never take a
        request past max_tokens or the context, nor a guided one outside its grammar."""
        if self.disable_by_batch_size and len(running) > self.disable_by_batch_size:
            return
        wanted = [(request, want) for request in running if (want := self._wanted(request)) is not None]
        if wanted:
            drafts = self.proposer.propose([want for _, want in wanted])
            for request, want in wanted:
                # a guided request keeps the drafts its grammar allows (structured outputs)
                request.draft.token_ids = StructuredOutputManager.check_drafts(
                    request, list(drafts.get(want.req_id, ()))[:want.max_drafts])

    def _wanted(self, request: Request) -> DraftRequest | None:
        if request.draft.pause > 0:
            request.draft.pause -= 1
            return None
        room = min(self.num_speculative_tokens, request.sampling_params.max_tokens - request.num_output_tokens - 1,
                   self.max_model_len - request.num_tokens - 1)
        if (room >= 1 and request.num_tokens - request.num_computed_tokens == 1
                and request.mode != RequestMode.PREFILL_ONLY):
            return DraftRequest(request.req_id, request.all_token_ids, room)
        return None

    def count(self, spec_token_ids: dict[str, list[int]], sampled_token_ids: dict[str, list[int]],
              requests: dict[str, Request]) -> None:
        """Counts drafts proposed and kept. A request whose drafts all fail pauses its
        proposals for 2, 4, ... 16 steps (reset by the next kept draft): on text the
        proposer cannot guess (n-gram lookup on fresh prose), verifying k wrong drafts
        costs more than the plain step it replaces, and exactness does not depend on it."""
        for req_id, drafts in spec_token_ids.items():
            if req_id in sampled_token_ids:
                accepted = len(sampled_token_ids[req_id]) - 1
                self.stats = self.stats.plus(len(drafts), accepted)
                request = requests.get(req_id)
                if request is not None:
                    request.draft.misses = 0 if accepted else request.draft.misses + 1
                    request.draft.pause = min(2 ** request.draft.misses, 16) if request.draft.misses else 0

    def finish(self, req_id: str) -> None:
        self.proposer.finish(req_id)


class NoDrafting(Drafting):
    """An engine without speculative decoding: no drafts, so nothing to count."""

    def __init__(self):
        super().__init__(NoProposer(), 0, 0, 0)

    def propose(self, running: list[Request]) -> None:
        pass
