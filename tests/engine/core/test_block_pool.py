"""BlockPool, hashing and KVCacheManager: exact block ids, ref counts and eviction order."""
from __future__ import annotations

import subprocess
import sys

import pytest

from pdserve.engine.core.block_hash import hash_block_tokens, hash_full_blocks, model_fingerprint
from pdserve.engine.core.block_pool import BlockPool
from pdserve.engine.core.kv_cache_manager import NO_HITS, KVCacheManager
from pdserve.engine.request import Request
from pdserve.engine.engine_request import EngineRequest
from pdserve.engine.sampling_params import SamplingParams

ROOT = model_fingerprint("m", "float32", 2, 2, 16, 4)


def _request(req_id: str, tokens: list[int]) -> Request:
    return Request(EngineRequest(req_id, tokens, SamplingParams(max_tokens=4)))


def test_hash_chains_from_parent_and_is_stable_across_processes():
    h0 = hash_block_tokens(ROOT, [1, 2, 3, 4])
    h1 = hash_block_tokens(h0, [5, 6, 7, 8])
    assert hash_full_blocks(ROOT, [1, 2, 3, 4, 5, 6, 7, 8, 9], 4) == [h0, h1]
    assert hash_block_tokens(hash_block_tokens(ROOT, [9, 9, 9, 9]), [5, 6, 7, 8]) != h1
    assert hash_block_tokens(ROOT, [1, 2, 3, 4], ("lora-a",)) != h0
    code = ("from pdserve.engine.core.block_hash import *; "
            "print(hash_block_tokens(model_fingerprint('m','float32',2,2,16,4), [1,2,3,4]).hex())")
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert other.stdout.strip() == h0.hex()


def test_fingerprint_separates_models_and_layouts():
    assert model_fingerprint("m", "float32", 2, 2, 16, 4) != model_fingerprint("m", "bfloat16", 2, 2, 16, 4)
    assert model_fingerprint("m", "float32", 2, 2, 16, 4) != model_fingerprint("m", "float32", 2, 2, 16, 4, tp_rank=1)
    assert model_fingerprint("m", "float32", 2, 2, 16, 4) != model_fingerprint("n", "float32", 2, 2, 16, 4)


def test_free_queue_lru_order_and_middle_removal():
    pool = BlockPool(5)
    blocks = pool.get_new_blocks(4)
    assert [b.block_id for b in blocks] == [0, 1, 2, 3]
    assert pool.free_block_queue.block_ids() == [4]
    pool.free_blocks([blocks[2], blocks[0]])
    assert pool.free_block_queue.block_ids() == [4, 2, 0]
    pool.touch([blocks[2]])  # a prefix hit on a free block takes it out of the middle
    assert pool.free_block_queue.block_ids() == [4, 0]
    assert blocks[2].ref_cnt == 1
    assert pool.get_new_blocks(3) is None
    assert [b.block_id for b in pool.get_new_blocks(2)] == [4, 0]


def test_ref_counts_and_double_free():
    pool = BlockPool(2)
    (block,) = pool.get_new_blocks(1)
    pool.touch([block])
    pool.free_blocks([block])
    assert block.ref_cnt == 1 and pool.num_free_blocks == 1
    pool.free_blocks([block])
    assert pool.num_free_blocks == 2
    with pytest.raises(RuntimeError):
        pool.free_blocks([block])


def test_longest_hit_and_lru_eviction_of_cached_blocks():
    kv = KVCacheManager(num_blocks=6, block_size=4, root_hash=ROOT)
    a = _request("a", list(range(10)))  # 2 full blocks + 2 tokens
    assert kv.allocate_slots(a, 10) is not None
    assert kv.get_block_ids("a") == [0, 1, 2]
    kv.free(a)  # freed tail-first: block 2 (uncached) then 1, 0
    assert kv.pool.free_block_queue.block_ids() == [3, 4, 5, 2, 1, 0]

    b = _request("b", list(range(8)) + [99, 98, 97])
    hits, num_hit_tokens = kv.get_computed_blocks(b)
    assert [h.block_id for h in hits.device] == [0, 1] and hits.host == [] and num_hit_tokens == 8
    new = kv.allocate_slots(b, 3, hits)
    assert [blk.block_id for blk in new] == [3]
    assert kv.get_block_ids("b") == [0, 1, 3]
    kv.free(b)

    # Fill the pool: uncached blocks are reused first, cached ones evicted LRU-first.
    c = _request("c", [7] * 20)
    assert kv.allocate_slots(c, 20) is not None
    assert kv.get_block_ids("c") == [4, 5, 2, 3, 1]
    assert kv.pool.get_cached_block(hash_full_blocks(ROOT, list(range(8)), 4)[1]) is None
    assert kv.pool.get_cached_block(hash_full_blocks(ROOT, list(range(8)), 4)[0]) is not None


def test_fully_cached_prompt_recomputes_its_last_token():
    kv = KVCacheManager(num_blocks=4, block_size=4, root_hash=ROOT)
    a = _request("a", list(range(8)))
    kv.allocate_slots(a, 8)
    kv.free(a)
    hits, n = kv.get_computed_blocks(_request("b", list(range(8))))
    assert len(hits.device) == 1 and n == 4


def test_prefix_caching_off_never_hits():
    kv = KVCacheManager(num_blocks=4, block_size=4, root_hash=ROOT, enable_prefix_caching=False)
    a = _request("a", list(range(9)))
    kv.allocate_slots(a, 9)
    kv.free(a)
    assert kv.get_computed_blocks(_request("b", list(range(9)))) == (NO_HITS, 0)
    assert not kv.pool.cached_block_hash_to_block


def test_allocation_failure_changes_nothing():
    kv = KVCacheManager(num_blocks=3, block_size=4, root_hash=ROOT)
    a = _request("a", list(range(8)))
    kv.allocate_slots(a, 8)
    assert kv.allocate_slots(_request("b", [5] * 12), 12) is None
    assert kv.num_free_blocks == 1
