"""Engine runs under each mode the issue names, compared token for token with transformers."""
from __future__ import annotations

import random

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.engine_core import EngineCore
from pdserve.engine.engine_request import EngineRequest


def varied_prompts(vocab_size: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    """Random prompts of the given lengths; the last two share a long common prefix."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, vocab_size) for _ in range(n)] for n in lengths]
    shared = prompts[-1][: (lengths[-1] * 3) // 4]
    prompts.append(shared + [rng.randrange(3, vocab_size) for _ in range(21)])
    return prompts


MODES = {
    "prefix_cache_on": dict(enable_prefix_caching=True),
    "prefix_cache_off": dict(enable_prefix_caching=False),
    "chunked_7": dict(long_prefill_token_threshold=7, max_num_batched_tokens=40),
    # whole prompts past the threshold; the budget (max_model_len) is smaller than all prompts
    # together, so some wait at the queue head while others decode
    "unchunked": dict(enable_chunked_prefill=False, long_prefill_token_threshold=7,
                      max_num_batched_tokens=None, max_model_len=512),
}


def run_llm(loaded, model_path: str, prompts, max_tokens: int, **kwargs) -> tuple[list[list[int]], LLM]:
    llm = LLM(model=model_path, loaded_model=loaded, progress=False, **kwargs)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=max_tokens))
    return [o.token_ids for o in outs], llm


def run_added_mid_run(engine: EngineCore, prompts, max_tokens: int) -> list[list[int]]:
    """Half the requests first; the rest join while the first ones are decoding."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    half = len(prompts) // 2
    results: dict[str, list[int]] = {}
    for i in range(half):
        engine.add_request(EngineRequest(f"r{i}", prompts[i], params))
    for _ in range(3):
        _collect(engine.step(), results)
    for i in range(half, len(prompts)):
        engine.add_request(EngineRequest(f"r{i}", prompts[i], params))
        _collect(engine.step(), results)
    while engine.has_unfinished_requests():
        _collect(engine.step(), results)
    return [results[f"r{i}"] for i in range(len(prompts))]


def _collect(outputs, results: dict) -> None:
    for out in outputs:
        if out.finished:
            results[out.req_id] = out.token_ids


def run_to_completion(engine: EngineCore, requests) -> dict:
    """Adds each (req_id, prompt_token_ids, params[, add_request keywords]) and steps until
    nothing is left; the final outputs by request id."""
    for req_id, prompt, params, *extra in requests:
        engine.add_request(EngineRequest(req_id, prompt, params, **(extra[0] if extra else {})))
    outs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outs[out.req_id] = out
    return outs
