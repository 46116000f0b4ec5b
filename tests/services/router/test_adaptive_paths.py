"""The adaptive path policy end to end against fake workers: the router reads the rates the
workers report, sends each request down the path it chose, passes the chunk cap on, counts
the decision by reason, and tells the client the path in the final message."""
from __future__ import annotations

import pytest

from pdserve.engine import SamplingParams
from pdserve.services.pb import common_pb2
from pdserve.services.router.client import RouterClient
from pdserve.services.router.config import PathConfig
from pdserve.services.router.decide.paths import DIRECT, DISAGGREGATED
from tests.services.router.fakes import expected_tokens

PROMPT = list(range(300, 400))  # 100 tokens: 0.1 s of prefill at the rates below, > one step's room


def _load(**fields) -> common_pb2.WorkerLoad:
    return common_pb2.WorkerLoad(num_free_kv_blocks=100, num_total_kv_blocks=100, max_num_seqs=8, **fields)


@pytest.fixture
def adaptive(make_cluster):
    cluster = make_cluster(num_prefill=1, num_decode=1, paths=PathConfig(policy="adaptive"))
    cluster.prefills[0].load = _load(prefill_tokens_per_s=1000)
    cluster.decodes[0].load = _load(prefill_tokens_per_s=1000, decode_step_ms=60)
    return cluster


def _generate(cluster) -> list[common_pb2.GenerateResponse]:
    with RouterClient(cluster.router.address) as client:
        return list(client.generate(PROMPT, SamplingParams(temperature=0, max_tokens=4), timeout_s=30))


def _decisions(cluster, path: str, reason: str) -> float:
    return cluster.router.metrics.metrics.value("router_path_decisions_total", {"path": path, "reason": reason})


def test_an_idle_prefill_pool_takes_the_prompt(adaptive):
    adaptive.router.poll_now()
    msgs = _generate(adaptive)
    assert [t for m in msgs for t in m.token_ids] == expected_tokens(len(PROMPT), 4)
    assert len(adaptive.prefills[0].requests) == 1 and msgs[-1].path == DISAGGREGATED
    assert _decisions(adaptive, DISAGGREGATED, "prefill_pool") == 1


def test_a_busy_prefill_pool_leaves_the_prompt_to_the_decode_worker_in_small_chunks(adaptive):
    adaptive.prefills[0].load = _load(prefill_tokens_per_s=1000, num_queued_prefill_tokens=20_000)
    adaptive.router.poll_now()
    msgs = _generate(adaptive)
    assert [t for m in msgs for t in m.token_ids] == expected_tokens(len(PROMPT), 4)
    assert not adaptive.prefills[0].requests and msgs[-1].path == DIRECT
    (request,) = adaptive.decodes[0].requests
    assert request.prefill_chunk_tokens == 20  # half of (100 ms ITL target - 60 ms step) x 1000 tokens/s
    assert _decisions(adaptive, DIRECT, "prefill_pool_busy") == 1
