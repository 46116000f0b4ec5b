"""Workers of both roles behind a real router (fake workers, the real contracts): one
address in both pools. A long prompt is prefilled on one and continued on another, never
handed over from a worker to itself; a worker alone prefills its long prompts directly."""
from __future__ import annotations

import threading

from pdserve.engine import SamplingParams
from pdserve.services.router.client import RouterClient
from pdserve.services.router.decide.paths import DIRECT, DISAGGREGATED, SAME_WORKER
from pdserve.services.router.state.discovery import DECODE, PREFILL
from pdserve.services.router.state.poller import MAX_SLOW_ROUNDS
from tests.services.router.fakes import expected_tokens

PROMPT = list(range(300, 400))  # 100 tokens: over the fake cluster's threshold (32)


def _generate(cluster, prompt: list[int]):
    with RouterClient(cluster.router.address) as client:
        return list(client.generate(prompt, SamplingParams(temperature=0, max_tokens=4), timeout_s=30))


def _decisions(cluster, path: str, reason: str) -> float:
    return cluster.router.metrics.metrics.value("router_path_decisions_total", {"path": path, "reason": reason})


def test_two_both_workers_hand_prompts_over_to_each_other_never_to_themselves(make_cluster):
    cluster = make_cluster(num_prefill=0, num_decode=0, num_both=2)
    for _ in range(3):
        msgs = _generate(cluster, PROMPT)
        assert [t for m in msgs for t in m.token_ids] == expected_tokens(len(PROMPT), 4)
        assert msgs[-1].path == DISAGGREGATED
    # both idle, so every placement's tie goes to the first listed, worker 0: the path
    # assumed it decodes, so worker 1 prefills, and the decode then avoids worker 1
    prefilled = [{r.req_id for r in p.requests} for p in cluster.prefills]
    continued = [{r.req_id for r in d.requests if r.HasField("first_token_id")} for d in cluster.decodes]
    assert len(prefilled[1]) == 3 and not prefilled[0]
    assert continued[0] == prefilled[1] and not continued[1]
    assert _decisions(cluster, DISAGGREGATED, "long_prompt") == 3


def test_a_both_worker_alone_prefills_its_long_prompt_directly(make_cluster):
    cluster = make_cluster(num_prefill=0, num_decode=0, num_both=1)
    msgs = _generate(cluster, PROMPT)
    assert [t for m in msgs for t in m.token_ids] == expected_tokens(len(PROMPT), 4)
    assert msgs[-1].path == DIRECT and not cluster.prefills[0].requests
    (request,) = cluster.decodes[0].requests
    assert not request.HasField("first_token_id") and not request.kv_handle.lease_id
    assert _decisions(cluster, DIRECT, SAME_WORKER) == 1
    assert not cluster.kvstore.releases  # no lease was ever taken


def test_a_decode_worker_beside_a_both_worker_decodes_what_the_both_worker_prefilled(make_cluster):
    cluster = make_cluster(num_prefill=0, num_decode=1, num_both=1)  # decode pool: [d, b]; prefill pool: [b]
    msgs = _generate(cluster, PROMPT)
    assert [t for m in msgs for t in m.token_ids] == expected_tokens(len(PROMPT), 4)
    assert len(cluster.prefills[0].requests) == 1
    assert [r.HasField("first_token_id") for r in cluster.decodes[0].requests] == [True]
    assert not cluster.decodes[1].requests


def test_a_both_worker_slow_to_answer_its_polls_stays_up_as_many_rounds_as_any_worker(make_cluster):
    """It is asked once per pool each round: the time-outs count per pool, or it would be
    taken out of both pools a round early."""
    cluster = make_cluster(num_prefill=0, num_decode=0, num_both=1, poll_timeout_s=0.05)
    hold = threading.Event()
    cluster.prefills[0].load_hold = cluster.decodes[0].load_hold = hold
    try:
        for _ in range(MAX_SLOW_ROUNDS - 1):
            cluster.router.poll_now()
            assert all(w.up for pool in (PREFILL, DECODE) for w in cluster.router.registry.views(pool))
        cluster.router.poll_now()
        assert not any(w.up for pool in (PREFILL, DECODE) for w in cluster.router.registry.views(pool))
    finally:
        hold.set()
