"""Blocks outside every layer's window go back to the pool (KVCacheManager.free_outside_window):
exact block ids, the placeholder in the table, prefix entries kept, prefill-only requests
untouched."""
from __future__ import annotations

from pdserve.engine.core.block_hash import model_fingerprint
from pdserve.engine.core.kv_cache_manager import WINDOWED_OUT, KVCacheManager
from pdserve.engine.request import Request, RequestMode
from pdserve.engine.engine_request import EngineRequest
from pdserve.engine.sampling_params import SamplingParams

ROOT = model_fingerprint("m", "float32", 2, 2, 16, 4)


def _compute(kv: KVCacheManager, request: Request, num_tokens: int) -> None:
    assert kv.allocate_slots(request, num_tokens) is not None
    request.num_computed_tokens += num_tokens


def test_blocks_behind_the_window_are_freed_and_stay_cached():
    kv = KVCacheManager(num_blocks=8, block_size=4, root_hash=ROOT, window=6)
    request = Request(EngineRequest("r", list(range(100, 120)), SamplingParams(max_tokens=4)))
    _compute(kv, request, 12)                       # positions 0-11 in blocks 0, 1, 2
    # the next query (position 12) sees 7..12: block 0 (0-3) is dead, block 1 (4-7) is not
    assert kv.free_outside_window(request) == 1
    assert kv.get_block_ids("r") == [0, 1, 2] and kv.req_to_blocks["r"][0] is WINDOWED_OUT
    assert kv.num_free_blocks == 8 - 2
    assert kv.free_outside_window(request) == 0    # nothing new: idempotent
    _compute(kv, request, 4)                        # 16 computed: the next query sees 11..16
    assert kv.free_outside_window(request) == 1     # block 1 (4-7) now; block 2 (8-11) still seen
    assert kv.num_windowed_out_blocks == 2
    # the freed blocks keep their prefix entries until evicted: a new request hits them
    other = Request(EngineRequest("o", list(range(100, 120)), SamplingParams(max_tokens=4)))
    hits, num_hit_tokens = kv.get_computed_blocks(other)
    assert [b.block_id for b in hits.device][:2] == [0, 1] and num_hit_tokens >= 8
    kv.free(request)
    assert kv.num_free_blocks == 8                  # the placeholders were not freed twice


def test_prefill_only_requests_keep_every_block_for_their_export():
    kv = KVCacheManager(num_blocks=8, block_size=4, root_hash=ROOT, window=4)
    request = Request(EngineRequest("p", list(range(20)), SamplingParams(max_tokens=1), mode=RequestMode.PREFILL_ONLY))
    _compute(kv, request, 20)
    assert kv.free_outside_window(request) == 0 and kv.num_blocks("p") == 5


def test_models_with_a_full_attention_layer_free_nothing():
    kv = KVCacheManager(num_blocks=8, block_size=4, root_hash=ROOT, window=None)
    request = Request(EngineRequest("r", list(range(20)), SamplingParams(max_tokens=1)))
    _compute(kv, request, 20)
    assert kv.free_outside_window(request) == 0 and kv.num_free_blocks == 3
