"""The simulator on tiny traces whose answers are known in closed form."""
from dataclasses import replace

import pytest

from pdserve.services.router.config import PathConfig, RouterConfig
import pdserve.services.router.decide.policy as router_policy
from pdserve.sim.cluster import ClusterConfig, simulate
from pdserve.sim.metrics import summarize
from pdserve.sim.profile import Table1D
from pdserve.sim.trace import TraceRequest
from pdserve.sim.worker import SimWorker
from tests.sim.helpers import flat_profile

THRESHOLD_ALL_POOL = RouterConfig(paths=PathConfig(policy="threshold"), short_prompt_tokens=0)


def one(n_in, n_out, t=0.0, hash_ids=()):
    return TraceRequest(t, n_in, n_out, hash_ids)


def test_one_request_colocated_ttft_is_its_prefill_and_itl_its_decode_step():
    p = flat_profile()
    [r] = simulate([one(100, 4)], p, ClusterConfig(0, 1))
    assert r.first_s - r.arrival_s == pytest.approx(p.prefill_s(100))
    assert r.itls == pytest.approx([p.decode_step_s(1, 100)] * 3)


def test_the_step_overhead_is_paid_by_every_step_and_the_request_overhead_once():
    p = replace(flat_profile(), step_overhead_s=0.005, request_overhead_s=0.030)
    [r] = simulate([one(100, 4)], p, ClusterConfig(0, 1))
    assert r.first_s - r.arrival_s == pytest.approx(p.prefill_s(100) + 0.005)
    assert r.itls == pytest.approx([p.decode_step_s(1, 100) + 0.005] * 3)
    assert summarize([r], p.request_overhead_s)["ttft_s"]["p50"] == pytest.approx(p.prefill_s(100) + 0.035)
    with pytest.raises(ValueError, match="step_overhead_s"):
        replace(p, step_overhead_s=-0.001)


def test_long_prompt_is_chunked_by_the_threshold():
    p = flat_profile(long_prefill_token_threshold=512)
    [r] = simulate([one(1200, 1)], p, ClusterConfig(0, 1))
    assert r.first_s == pytest.approx(p.prefill_s(512) * 2 + p.prefill_s(176))


def test_prompts_queued_together_share_one_step_costed_per_prompt():
    # a step of several prompts pays each prompt's own attention (sim/profile.py), as the
    # engine's varlen attention does: the three first tokens come at the step's end
    p = replace(flat_profile(), prefill=Table1D((0.0, 400.0, 1200.0), (0.1, 2.3, 9.0)))
    a, b, c = simulate([one(400, 1), one(400, 1, t=0.01), one(400, 1, t=0.02)], p, ClusterConfig(0, 1))
    assert a.first_s == pytest.approx(p.prefill_s(400))  # alone: the others arrived mid-step
    assert b.first_s == c.first_s == pytest.approx(a.first_s + p.step_s([400, 400], 0, 0.0))
    assert p.step_s([400, 400], 0, 0.0) == pytest.approx(0.1 + 2 * 2.2)


def test_disaggregated_pays_the_handoff_before_the_second_token():
    p = flat_profile(long_prefill_token_threshold=2048)
    [r] = simulate([one(1000, 3)], p, ClusterConfig(1, 1, THRESHOLD_ALL_POOL))
    assert r.path == "disaggregated" and r.workers == ["prefill-0", "decode-0"]
    assert r.first_s == pytest.approx(p.prefill_s(1000))
    # the decode computes the first token's KV and samples the second
    assert r.itls[0] == pytest.approx(p.handoff_s(1000) + p.decode_step_s(1, 1000))
    assert r.itls[1] == pytest.approx(p.decode_step_s(1, 1001))


def test_the_handoffs_call_overlaps_the_prefills_write_and_precedes_the_read():
    base = flat_profile(long_prefill_token_threshold=2048)
    nbytes = 1000 * base.kv_bytes_per_token
    for overhead in (0.0005, 0.5):  # shorter than the write (hidden), then longer
        p = replace(base, handoff_overhead_s=overhead)
        [r] = simulate([one(1000, 3)], p, ClusterConfig(1, 1, THRESHOLD_ALL_POOL))
        assert r.itls[0] == pytest.approx(max(overhead, p.kv_put(nbytes)) + p.kv_get(nbytes)
                                          + p.decode_step_s(1, 1000))
    with pytest.raises(ValueError, match="handoff_overhead_s"):
        replace(base, handoff_overhead_s=-1.0)


def test_transfers_on_one_worker_run_one_after_another():
    w = SimWorker("w", flat_profile())
    assert w.transfer(0.0, 1.0) == 1.0
    assert w.transfer(0.5, 1.0) == 2.0  # queued behind the first
    assert w.transfer(5.0, 1.0) == 6.0  # the core was free again
    # two prompts that end in one prefill step: the second's write follows the first's
    p = flat_profile(long_prefill_token_threshold=2048)
    trace = [one(100, 1), one(1000, 3, t=0.001), one(1000, 3, t=0.002)]  # the pair queue behind the first
    _, a, b = simulate(trace, p, ClusterConfig(1, 1, THRESHOLD_ALL_POOL))
    assert a.first_s == b.first_s
    assert b.written_s - a.written_s == pytest.approx(p.kv_put(1000 * p.kv_bytes_per_token))


def test_a_kv_read_on_the_decode_workers_core_stretches_its_running_streams_steps():
    """kv_cpu_share 1 (a CPU host): the read of a second request's KV takes the decode
    core from the first's stream, whose next step ends that much later; 0 (RDMA): it does
    not. A read onto an idle core costs no other stream anything."""
    trace = [one(1000, 40), one(1000, 3, t=0.3)]
    cfg = ClusterConfig(1, 1, THRESHOLD_ALL_POOL)
    base = flat_profile(long_prefill_token_threshold=2048)
    shared = replace(base, kv_cpu_share=1.0)
    free_a, _ = simulate(trace, base, cfg)
    busy_a, _ = simulate(trace, shared, cfg)
    stretched = [i for i, (x, y) in enumerate(zip(free_a.itls, busy_a.itls)) if y > x + 1e-9]
    assert len(stretched) == 1  # one step of the first stream took the read's time
    assert busy_a.itls[stretched[0]] - free_a.itls[stretched[0]] == pytest.approx(base.kv_get(1000 * 1000))
    [alone_free] = simulate(trace[:1], base, cfg)
    [alone_shared] = simulate(trace[:1], shared, cfg)
    assert alone_shared.itls == pytest.approx(alone_free.itls)  # its own read and write met idle cores
    with pytest.raises(ValueError, match="kv_cpu_share"):
        replace(base, kv_cpu_share=1.5)


def test_a_kv_write_on_the_prefill_workers_core_delays_the_next_prefill():
    trace = [one(1000, 3), one(1000, 3, t=0.05)]  # the second waits while the first prefills
    cfg = ClusterConfig(1, 1, THRESHOLD_ALL_POOL)
    base = flat_profile(long_prefill_token_threshold=2048)
    a_free, b_free = simulate(trace, base, cfg)
    a_busy, b_busy = simulate(trace, replace(base, kv_cpu_share=1.0), cfg)
    put = base.kv_put(1000 * 1000)
    assert b_busy.first_s - b_free.first_s == pytest.approx(put)  # the core time the write took
    # the write itself shared the core with b's prefill: it lasted twice as long
    assert a_free.written_s - a_free.first_s == pytest.approx(put)
    assert a_busy.written_s - a_busy.first_s == pytest.approx(2 * put)
    # b's own write met an idle core
    assert b_busy.written_s - b_busy.first_s == pytest.approx(put)


def test_workers_on_one_host_slow_each_other_while_both_step():
    """A decodes on decode-0 while B's long prefill runs on prefill-0. On one host, B's
    prefill runs at the prefill factor the whole time (A decodes throughout), and A's steps
    at the decode factor while B prefills: A ends later by B's prefill time x (1 - 1/2)."""
    p = replace(flat_profile(long_prefill_token_threshold=8192, max_num_batched_tokens=8192),
                neighbour_prefill_factor=1.5, neighbour_decode_factor=2.0)
    trace = [one(100, 60), one(5000, 1, t=0.1)]
    apart_a, apart_b = simulate(trace, p, ClusterConfig(1, 1, THRESHOLD_ALL_POOL))
    shared_a, shared_b = simulate(trace, p, ClusterConfig(1, 1, THRESHOLD_ALL_POOL, workers_per_host=2))
    assert apart_b.first_s - 0.1 == pytest.approx(p.prefill_s(5000))
    assert shared_b.first_s - 0.1 == pytest.approx(1.5 * p.prefill_s(5000))
    assert 0.1 + 1.5 * p.prefill_s(5000) < apart_a.end_s  # A decodes all through B's prefill
    assert shared_a.end_s - apart_a.end_s == pytest.approx(1.5 * p.prefill_s(5000) * (1 - 1 / 2.0))
    assert max(shared_a.itls) == pytest.approx(2 * p.decode_step_s(1, 200))  # a step wholly beside B's
    with pytest.raises(ValueError, match="workers-per-host"):
        ClusterConfig(1, 1, workers_per_host=0)
    with pytest.raises(ValueError, match="neighbour_decode_factor"):
        replace(p, neighbour_decode_factor=0.9)


def test_second_request_queues_behind_the_first_within_the_token_budget():
    p = flat_profile(max_num_batched_tokens=512, long_prefill_token_threshold=512)
    a, b = simulate([one(500, 1), one(500, 1, t=0.001)], p, ClusterConfig(0, 1))
    assert b.first_s - b.arrival_s == pytest.approx(2 * p.prefill_s(500) - 0.001)


def test_shared_prefix_is_reused_from_the_local_cache():
    p = flat_profile()
    a, b = simulate([one(1100, 1, hash_ids=(1, 2, 3)), one(1100, 1, t=5.0, hash_ids=(1, 2, 4))], p,
                    ClusterConfig(0, 1))
    assert b.first_s - b.arrival_s == pytest.approx(p.prefill_s(1100 - 1024))


def test_saturation_queues_grow_and_the_router_refuses_past_max_queue():
    p = flat_profile(max_num_seqs=4)
    trace = [one(200, 200, t=i * 0.01) for i in range(300)]  # far beyond 4 seqs x 1/(25 ms) per token
    reqs = simulate(trace, p, ClusterConfig(0, 1))
    s = summarize(reqs, slo_ttft_s=1.0, slo_tpot_s=0.1)
    assert s["rejected"] > 0  # waited past the interactive class's max_queue_ms in the router
    done = [r for r in reqs if not r.rejected]
    assert done[-1].first_s - done[-1].arrival_s > 10 * (done[0].first_s - done[0].arrival_s)
    assert s["slo_attainment"] < 0.5


def test_light_load_meets_every_slo():
    p = flat_profile()
    reqs = simulate([one(100, 10, t=i * 1.0) for i in range(20)], p, ClusterConfig(0, 2))
    s = summarize(reqs, slo_ttft_s=0.1, slo_tpot_s=0.05, num_workers=2)
    assert s["slo_attainment"] == 1.0 and s["rejected"] == 0
    assert s["goodput_rps"] == pytest.approx(20 / s["duration_s"])


def test_the_routers_own_policy_code_decides(monkeypatch):
    """Change the router's decode score: the simulated placement follows it."""
    p = flat_profile()
    cfg = ClusterConfig(0, 3, RouterConfig(placement="least_loaded"))
    trace = [one(100, 50, t=i * 0.05) for i in range(9)]
    spread = {r.workers[0] for r in simulate(trace, p, cfg)}
    assert spread == {"decode-0", "decode-1", "decode-2"}
    monkeypatch.setattr(router_policy, "decode_score", lambda w: -int(w.address.rsplit("-", 1)[1]))
    pinned = {r.workers[0] for r in simulate(trace, p, cfg)}
    assert pinned == {"decode-2"}


def test_the_routers_path_policy_decides():
    p = flat_profile()
    trace = [one(100, 2), one(3000, 2, t=1.0)]
    threshold = RouterConfig(paths=PathConfig(policy="threshold"), short_prompt_tokens=256)
    assert [r.path for r in simulate(trace, p, ClusterConfig(1, 1, threshold))] == ["direct", "disaggregated"]
    more = replace(threshold, short_prompt_tokens=5000)
    assert [r.path for r in simulate(trace, p, ClusterConfig(1, 1, more))] == ["direct", "direct"]


def test_bad_pool_sizes_name_the_flag():
    with pytest.raises(ValueError, match="--decode"):
        ClusterConfig(1, 0)
    with pytest.raises(ValueError, match="--prefill"):
        ClusterConfig(-1, 1)
