"""Scheduler policy without a model: budgets, ordering, chunking, preemption, aborts."""
from __future__ import annotations

from pdserve.engine.config import SchedulerConfig
from pdserve.engine.core.block_hash import model_fingerprint
from pdserve.engine.core.kv_cache_manager import KVCacheManager
from pdserve.engine.core.scheduler import Scheduler
from pdserve.engine.core.scheduler_output import ModelRunnerOutput
from pdserve.engine.request import FamilyMember, Request, RequestStatus
from pdserve.engine.engine_request import EngineRequest
from pdserve.engine.sampling_params import SamplingParams


def _scheduler(num_blocks=64, block_size=4, **cfg) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size, model_fingerprint("m", "f32", 1, 1, 1, block_size))
    return Scheduler(SchedulerConfig(**{"max_model_len": 1024, **cfg}), kv)


def _add(s: Scheduler, req_id: str, n: int, max_tokens: int = 8) -> Request:
    base = 1000 * len(s.requests)  # distinct prompts: no prefix-cache sharing between them
    r = Request(EngineRequest(req_id, list(range(base, base + n)), SamplingParams(max_tokens=max_tokens)))
    s.add_request(r)
    return r


def _step(s: Scheduler, token: int = 7):
    """Schedule, then sample `token` for every request that reached its last known token."""
    out = s.schedule()
    sampled = {r: [token] for r in out.num_scheduled_tokens
               if s.requests[r].num_computed_tokens == s.requests[r].num_tokens}
    for request, token_ids in s.update_from_output(out, ModelRunnerOutput(sampled_token_ids=sampled)):
        for token_id in token_ids:
            request.append_output_token(token_id)
    return out


def test_decodes_first_then_prefills_within_one_budget():
    s = _scheduler(max_num_batched_tokens=10, long_prefill_token_threshold=100)
    _add(s, "a", 3)
    assert _step(s).num_scheduled_tokens == {"a": 3}
    _add(s, "b", 20)
    out = _step(s)
    assert list(out.num_scheduled_tokens.items()) == [("a", 1), ("b", 9)]
    assert out.total_num_scheduled_tokens == 10
    assert [n.req_id for n in out.scheduled_new_reqs] == ["b"]
    assert [c.req_id for c in out.scheduled_cached_reqs] == ["a"]


def test_long_prefill_is_chunked_by_threshold():
    s = _scheduler(max_num_batched_tokens=100, long_prefill_token_threshold=7)
    r = _add(s, "a", 20)
    chunks = [_step(s).num_scheduled_tokens["a"] for _ in range(3)]
    assert chunks == [7, 7, 6]
    assert r.num_output_tokens == 1  # sampled only after the last chunk


def test_max_num_seqs_limits_running():
    s = _scheduler(max_num_seqs=2)
    for i in range(3):
        _add(s, f"r{i}", 2)
    out = _step(s)
    assert set(out.num_scheduled_tokens) == {"r0", "r1"}
    assert [r.req_id for r in s.waiting] == ["r2"]


def test_preemption_recomputes_latest_and_requeues_it_first():
    # 4 blocks of 4 tokens: two 7-token prompts fill them once they decode past 8 tokens.
    s = _scheduler(num_blocks=4, block_size=4)
    a, b = _add(s, "a", 7, max_tokens=20), _add(s, "b", 7, max_tokens=20)
    _add(s, "c", 2)
    _step(s)
    assert [r.req_id for r in s.running] == ["a", "b"]
    _step(s)
    out = _step(s)  # both need a third block: b (latest) is preempted
    assert out.preempted_req_ids == {"b"} and "b" in out.finished_req_ids
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert [r.req_id for r in s.waiting] == ["b", "c"]
    assert a.num_output_tokens == 3 and b.num_output_tokens == 2


def test_abort_frees_blocks_of_running_and_waiting():
    s = _scheduler(num_blocks=8)
    _add(s, "a", 9)
    _add(s, "b", 40)
    _step(s)
    assert s.kv.num_free_blocks < 8
    finished = s.finish_requests(["a", "b", "missing"], RequestStatus.FINISHED_ABORTED)
    assert [r.req_id for r in finished] == ["a", "b"]
    assert s.kv.num_free_blocks == 8 and not s.has_unfinished_requests()
    assert "a" in s.schedule().finished_req_ids  # the runner drops its state


def test_urgent_priority_jumps_the_waiting_queue_but_not_preempted():
    s = _scheduler(max_num_seqs=1)
    _add(s, "running", 2)
    _step(s)
    batch = [Request(EngineRequest(f"b{i}", [1, 2], SamplingParams(), priority=1)) for i in range(2)]
    for r in batch:
        s.add_request(r)
    s.add_request(Request(EngineRequest("i0", [3, 4], SamplingParams(), priority=0)))
    s.add_request(Request(EngineRequest("b2", [5, 6], SamplingParams(), priority=1)))
    s.add_request(Request(EngineRequest("i1", [7, 8], SamplingParams(), priority=0)))
    assert [r.req_id for r in s.waiting] == ["i0", "i1", "b0", "b1", "b2"]


def test_chunked_prefill_off_schedules_a_prompt_whole_past_the_threshold():
    s = _scheduler(max_num_batched_tokens=128, long_prefill_token_threshold=16, enable_chunked_prefill=False)
    r = _add(s, "a", 100)
    assert _step(s).num_scheduled_tokens == {"a": 100}
    assert r.num_output_tokens == 1


def test_chunked_prefill_on_splits_the_same_prompt():
    s = _scheduler(max_num_batched_tokens=128, long_prefill_token_threshold=16)
    _add(s, "a", 100)
    assert _step(s).num_scheduled_tokens == {"a": 16}


def test_chunked_prefill_off_a_prompt_that_does_not_fit_waits_at_the_head():
    s = _scheduler(max_num_batched_tokens=100, enable_chunked_prefill=False)
    _add(s, "a", 3)
    _step(s)
    _add(s, "long", 100)  # 99 tokens of budget left beside a's decode
    _add(s, "short", 2)   # would fit, but must not overtake the head
    out = _step(s)
    assert out.num_scheduled_tokens == {"a": 1}
    assert [r.req_id for r in s.waiting] == ["long", "short"]
    assert s.requests["long"].num_computed_tokens == 0
    s.finish_requests(["a"], RequestStatus.FINISHED_STOPPED)  # the whole budget is free again
    assert _step(s).num_scheduled_tokens == {"long": 100}
    assert [r.req_id for r in s.waiting] == ["short"]


def test_siblings_of_n_wait_for_the_first_chunks_then_hit_its_blocks():
    """SamplingParams.n (engine/parallel_sampling.py): the first sibling's chunks of 4 allocate
    the prompt's blocks; the siblings join once its full blocks (8 of the 10 tokens) are
    allocated and hit both, computing only the last two tokens; a request behind them is
    not held back."""
    s = _scheduler(block_size=4, max_num_batched_tokens=100, long_prefill_token_threshold=4)
    prompt = list(range(500, 510))
    for i, req_id in enumerate(["fan", "fan#1", "fan#2"]):
        s.add_request(Request(EngineRequest(req_id, prompt, SamplingParams(max_tokens=4)), family=FamilyMember(i, "fan")))
    _add(s, "other", 3)
    assert _step(s).num_scheduled_tokens == {"fan": 4, "other": 3}
    assert [r.req_id for r in s.waiting] == ["fan#1", "fan#2"]
    out = _step(s)  # the first's chunk covers its second full block: the siblings join, hitting both
    assert out.num_scheduled_tokens == {"fan": 4, "other": 1, "fan#1": 2, "fan#2": 2}
    shared = s.kv.get_block_ids("fan")[:2]
    assert s.kv.get_block_ids("fan#1")[:2] == shared == s.kv.get_block_ids("fan#2")[:2]
    assert s.kv.num_hit_tokens == 2 * 8
    assert s.requests["fan#1"].num_cached_tokens == 8
