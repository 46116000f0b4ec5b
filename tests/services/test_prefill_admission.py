"""A prefill request that arrives while the prefill worker is busy joins the very next
step. It used to cross the engine loop twice (the local prefix-cache check, then the
submit), each at a step boundary; on a worker with more work queued the loop started the
next step between the two, so the request waited one whole extra step. The simulator's
calibration (issue 18) found it as TTFT the simulated scheduler did not predict."""
from __future__ import annotations

import threading
import time

import pytest

from pdserve.engine import SamplingParams
from pdserve.engine.request import RequestMode
from tests.services.cluster import start_cluster
from tests.services.test_disaggregated import _prefill_direct
from pdserve.engine.engine_request import EngineRequest

STEP_S = 0.25  # each engine step of the prefill worker is slowed to at least this


@pytest.fixture
def cluster(tiny, tiny_llama_dir):
    c = start_cluster(tiny_llama_dir, tiny, num_prefill=1)
    yield c
    c.stop()


def test_a_prefill_arriving_mid_step_is_admitted_at_the_next_boundary(cluster):
    loop = cluster.prefills[0].loop
    engine = loop._engine
    step_starts: list[float] = []
    added: dict[str, float] = {}
    step, add_request = engine.step, engine.add_request

    def slow_step():
        step_starts.append(time.monotonic())
        time.sleep(STEP_S)
        return step()

    def recording_add(request):
        added[request.req_id] = time.monotonic()
        return add_request(request)

    engine.step, engine.add_request = slow_step, recording_add
    # work that keeps the loop stepping: a request decoding on the prefill worker's engine
    busy = loop.submit(EngineRequest("busy", list(range(3000, 3040)), SamplingParams(max_tokens=40, ignore_eos=True),
                                     mode=RequestMode.COLOCATED))
    try:
        for i in range(3):
            seen = len(step_starts)
            deadline = time.monotonic() + 10
            while len(step_starts) == seen and time.monotonic() < deadline:
                time.sleep(0.005)  # a step has just begun: this request arrives in the middle of it
            sent = time.monotonic()
            response = _prefill_direct(cluster.prefills[0], list(range(1000 + 100 * i, 1080 + 100 * i)), f"mid-{i}")
            assert response.choices[0].token_id >= 0
            between = [t for t in step_starts if sent < t < added[f"mid-{i}"]]
            assert between == [], (f"request mid-{i} was added {len(between)} step(s) after it arrived: "
                                   "it should join the step after the one it arrived in")
    finally:
        loop.abort("busy")
        while busy.get(timeout=30) is not None:
            pass
        engine.step, engine.add_request = step, add_request
