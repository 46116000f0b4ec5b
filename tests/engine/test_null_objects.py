"""The null objects that stand in for absent features: no `is None` at their call sites."""
from __future__ import annotations

from pdserve.engine.core.scheduler_output import SchedulerOutput
from pdserve.engine.request import Request, RequestMode
from pdserve.engine.engine_request import EngineRequest
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.spec_decode.drafting import Drafting, NoDrafting
from pdserve.engine.spec_decode.proposer import DraftRequest, NoProposer, Proposer
from pdserve.engine.stats import EngineStats, SpecDecodeStats
from pdserve.engine.structured.manager import NoStructuredOutputs
from pdserve.engine.worker.cuda_graphs import NoDecodeGraphs


def decoding(req_id: str, max_tokens: int = 50) -> Request:
    """A running request whose every token but the last sampled one is computed."""
    request = Request(EngineRequest(req_id, [1, 2, 3], SamplingParams(max_tokens=max_tokens), output_token_ids=[4]))
    request.num_computed_tokens = request.num_tokens - 1
    return request


class FixedProposer(Proposer):
    def __init__(self, drafts: list[int]):
        self.drafts, self.seen = drafts, []

    def propose(self, requests: list[DraftRequest]) -> dict[str, list[int]]:
        self.seen.extend(requests)
        return {r.req_id: self.drafts for r in requests}


def test_no_structured_outputs_has_nothing_pending_nor_to_mask():
    none = NoStructuredOutputs(build=lambda: "built")
    assert none.num_pending == 0 and none.poll() == ([], []) and none.remove("r") is None
    assert none.step_bitmask(SchedulerOutput(num_scheduled_tokens={"r": 1}), {}) is None
    assert none.for_guided() == "built"  # the first guided request builds the real manager


def test_no_proposer_proposes_nothing():
    assert NoProposer().propose([DraftRequest("r", [1, 2], 3)]) == {}


def test_no_drafting_leaves_requests_without_drafts_and_counts_nothing():
    drafting, request = NoDrafting(), decoding("r")
    drafting.propose([request])
    drafting.count({}, {"r": [5]}, {"r": request})
    assert request.draft.token_ids == [] and drafting.stats == SpecDecodeStats()
    assert isinstance(drafting.proposer, NoProposer)


def test_drafting_caps_drafts_at_max_tokens_and_skips_prefill_only():
    proposer = FixedProposer([7, 8, 9])
    drafting = Drafting(proposer, 3, 0, 1000)
    near_end, handoff = decoding("a", max_tokens=3), decoding("b")
    handoff.mode = RequestMode.PREFILL_ONLY
    drafting.propose([near_end, handoff])
    assert [(r.req_id, r.max_drafts) for r in proposer.seen] == [("a", 1)]
    assert near_end.draft.token_ids == [7] and handoff.draft.token_ids == []


def test_drafting_is_off_past_disable_by_batch_size():
    proposer = FixedProposer([7])
    Drafting(proposer, 2, 1, 1000).propose([decoding("a"), decoding("b")])
    assert proposer.seen == []


def test_counts_and_the_pause_after_a_step_that_kept_no_draft():
    drafting, request = Drafting(FixedProposer([7, 8]), 2, 0, 1000), decoding("r")
    drafting.count({"r": [7, 8]}, {"r": [7, 8, 9]}, {"r": request})   # both kept
    drafting.count({"r": [7, 8]}, {"r": [5]}, {"r": request})         # none kept
    assert drafting.stats == SpecDecodeStats(num_proposed_tokens=4, num_accepted_tokens=2, num_verifications=2)
    assert request.draft.misses == 1 and request.draft.pause == 2
    drafting.propose([request])  # paused: one step fewer to wait, no drafts
    assert request.draft.pause == 1 and request.draft.token_ids == []


def test_engine_stats_reads_the_spec_counts_by_their_flat_names():
    stats = EngineStats(spec=SpecDecodeStats(5, 3, 2))
    assert (stats.num_spec_proposed_tokens, stats.num_spec_accepted_tokens, stats.num_spec_verifications) == (5, 3, 2)
    assert EngineStats().num_spec_verifications == 0


def test_no_decode_graphs_runs_every_step_eagerly():
    graphs = NoDecodeGraphs()
    assert graphs.run(object()) is None and graphs.graphs == {}
