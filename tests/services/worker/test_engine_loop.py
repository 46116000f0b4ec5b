"""The engine loop hands each stream outputs the engine no longer changes: a reader that
falls behind the loop still reads every step's tokens once, in order."""
from __future__ import annotations

import time

from pdserve.engine import EngineCore, SamplingParams
from pdserve.engine.config import CacheConfig, EngineConfig
from pdserve.engine.engine_request import EngineRequest
from pdserve.services.worker.engine_loop import EngineLoop

PROMPT = list(range(100, 120))
PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)


def test_a_reader_lagging_behind_the_loop_reads_each_step_once(tiny, tiny_llama_dir):
    engine = EngineCore(EngineConfig(model=tiny_llama_dir, cache=CacheConfig(kv_cache_memory_bytes=8 << 20)),
                        progress=False, loaded=tiny)
    loop = EngineLoop(engine)
    loop.start()
    try:
        stream = loop.submit(EngineRequest("lagging", PROMPT, PARAMS))
        deadline = time.monotonic() + 30
        while stream.qsize() < PARAMS.max_tokens + 1:  # every step's output and the end, unread
            assert time.monotonic() < deadline, "the request did not finish"
            time.sleep(0.01)
        outputs = []
        while (out := stream.get()) is not None:
            outputs.append(out)
    finally:
        loop.stop()
    final = outputs[-1]
    assert [o.finished for o in outputs] == [False] * (len(outputs) - 1) + [True]
    assert [t for o in outputs for t in o.new_token_ids] == final.token_ids
    assert len(final.token_ids) == PARAMS.max_tokens
    for o in outputs[:-1]:  # each step's own logprobs, not the ones of the steps after it
        assert [lp.token_id for lp in o.logprobs] == o.new_token_ids
