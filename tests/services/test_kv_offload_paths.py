"""The host tier on the workers, through router -> prefill -> kvstore -> decode: a prefill
worker whose device cache lost a prompt's blocks finds them in its host tier and asks the
kvstore for none of them; every answer is the offline engine's."""
from __future__ import annotations

import random

import pytest

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.worker.kv_cache import bytes_per_block
from pdserve.services.router.client import RouterClient
from tests.services.cluster import start_cluster

MAX_TOKENS = 8


def _prompts(vocab_size: int) -> tuple[list[int], list[list[int]], list[int]]:
    rng = random.Random(7)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, vocab_size) for _ in range(n)]
    first = tokens(80)
    return first, [tokens(75) for _ in range(6)], first[:64] + tokens(9)


def _generate(router_address: str, prompt: list[int]) -> tuple[list[int], str]:
    client = RouterClient(router_address)
    try:
        msgs = list(client.generate(prompt, SamplingParams(temperature=0, max_tokens=MAX_TOKENS)))
    finally:
        client.close()
    return [t for m in msgs for t in m.token_ids], msgs[-1].path


@pytest.fixture
def cluster(tiny, tiny_llama_dir):
    block = bytes_per_block(tiny.arch, 16, next(tiny.model.parameters()).dtype)
    c = start_cluster(tiny_llama_dir, tiny, num_prefill=1, num_decode=1, kv_cache_memory_bytes=24 * block,
                      kv_offloading_bytes=64 * block)
    yield c
    c.stop()


def test_a_prefill_reads_its_host_tier_before_the_kvstore(cluster, tiny, tiny_llama_dir):
    first, others, again = _prompts(tiny.arch.vocab_size)
    offline = LLM(tiny_llama_dir, loaded_model=tiny, progress=False).generate(
        [{"prompt_token_ids": p} for p in [first, *others, again]], SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
    got = [_generate(cluster.router.address, p) for p in [first, *others]]
    prefill = cluster.prefills[0]
    hashes = prefill.loop.info.prompt_block_hashes(again, "")[:4]
    # the prefill worker's device cache lost the first prompt's blocks; its host tier kept them
    assert prefill.loop.call(lambda e: len(e.kv_manager.find_longest_cache_hit(hashes))).result() == 0
    assert prefill.loop.num_local_prefix_blocks(hashes) == 4
    imported = prefill.servicer.metrics.kvstore_imported._value.get()
    got.append(_generate(cluster.router.address, again))
    assert [tokens for tokens, _ in got] == [o.token_ids for o in offline]
    assert {path for _, path in got} == {"disaggregated"}
    assert prefill.servicer.metrics.kvstore_imported._value.get() == imported  # nothing read from the store
    assert prefill.loop.call(lambda e: e.stats().host.num_hit_tokens).result() == 64
