"""`n` through `pdserve up` (kvstore, 1 prefill, 1 decode, router, HTTP), on the
disaggregated path: the prompt is prefilled once on the prefill worker (its prompt-token
counter grows by the prompt once, not n times; the siblings hit the first's blocks), its KV
is written once and read n times by the decode worker (the lease held until the n-th read),
choice i equals the offline engine's request with seed + i, streamed or not, and no block
or lease is left once the requests are done."""
from __future__ import annotations

import time

import openai
import pytest

from pdserve.engine import LLM, SamplingParams
from tests.cli.up_platform import running_up, up_ports
from tests.services.test_parallel_sampling import assert_siblings_read_one_handle

KVSTORE, PREFILL, DECODE = 0, 1, 2  # Platform.metric's process indexes
PROMPT = list(range(1000, 1045))  # 45 tokens: two full blocks of 16 and a tail
N, SEED, MAX_TOKENS = 4, 5, 8
# every prompt longer than 4 tokens goes through the prefill worker
UP_ARGS = ["--prefill", "1", "--decode", "1", "--path-policy", "threshold", "--short-prompt-tokens", "4"]


@pytest.fixture(scope="module")
def offline(tiny, tiny_llama_dir) -> list[str]:
    """Each choice as a request of its own: seed + i."""
    llm = LLM(tiny_llama_dir, loaded_model=tiny, progress=False)
    return [llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(temperature=0.8, seed=SEED + i,
                                                                      max_tokens=MAX_TOKENS, ignore_eos=True))[0].text
            for i in range(N)]


def _counters(up) -> dict[str, float]:
    return {"prefilled": up.metric(PREFILL, "pdserve_prefill_tokens_total"),
            "prefill_hits": up.metric(PREFILL, "pdserve_prefix_cache_hit_tokens"),
            "imported": up.metric(DECODE, "pdserve_kvstore_imported_tokens_total")}


def _wait_all_free(up, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        used = [up.metric(i, "pdserve_kv_blocks_used") for i in (PREFILL, DECODE)]
        leases = up.metric(KVSTORE, "pdserve_kvstore_active_leases")
        free = [up.metric(i, "pdserve_kv_blocks_free") for i in (PREFILL, DECODE)]
        if used == [0, 0] and leases == 0 and all(free):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"left behind: blocks used {used}, active leases {leases}")
        time.sleep(0.2)


def test_n_prefills_once_and_each_choice_is_its_seed(tiny_llama_dir, tmp_path, offline):
    with running_up(tiny_llama_dir, up_ports(2, http=True), UP_ARGS, tmp_path) as up:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{up.ports['http']}/v1", api_key="unused",
                               max_retries=0, timeout=120)
        kwargs = dict(model=tiny_llama_dir, prompt=PROMPT, n=N, seed=SEED, temperature=0.8, max_tokens=MAX_TOKENS,
                      extra_body={"ignore_eos": True})
        before = _counters(up)
        reply = client.completions.create(**kwargs)
        assert [c.index for c in reply.choices] == list(range(N))
        assert [c.text for c in reply.choices] == offline
        assert len(set(offline)) > 1
        assert reply.usage.prompt_tokens == len(PROMPT)  # once, as OpenAI counts it
        assert reply.usage.completion_tokens == N * MAX_TOKENS
        _wait_all_free(up)
        after = _counters(up)
        assert after["prefilled"] - before["prefilled"] == len(PROMPT)  # not N times
        assert after["prefill_hits"] - before["prefill_hits"] == (N - 1) * 32  # the siblings' two full blocks
        assert_siblings_read_one_handle(after["imported"] - before["imported"], N, len(PROMPT))  # one handle, N reads

        texts = [""] * N
        for chunk in client.completions.create(**kwargs, stream=True):
            for choice in chunk.choices:
                texts[choice.index] += choice.text
        assert texts == offline
        _wait_all_free(up)
        assert _counters(up)["prefilled"] - after["prefilled"] == len(PROMPT)
