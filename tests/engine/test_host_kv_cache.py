"""The host tier's bytes (engine/worker/host_kv_cache.py): every layer's K and V of a block
moves to its slot and back exactly, many blocks in one op; the caches are one allocation;
the copies' wire form for the ranks."""
from __future__ import annotations

import pytest
import torch

from pdserve.engine.config import ModelArchConfig
from pdserve.engine.executor.messages import pack_pairs, unpack_pairs
from pdserve.engine.worker.host_kv_cache import HostKVCache, NoHostKVCache, host_kv_cache
from pdserve.engine.worker.kv_cache import allocate_kv_caches, stacked_kv_caches

ARCH = ModelArchConfig("LlamaForCausalLM", 10, 8, 16, num_layers=3, num_heads=2, num_kv_heads=2, head_dim=4,
                       rms_norm_eps=1e-5, rope_theta=1e4, max_position_embeddings=64, tie_word_embeddings=True)


def _filled_caches(num_blocks: int = 5) -> list[torch.Tensor]:
    caches = allocate_kv_caches(num_blocks, ARCH, 2, torch.float32, torch.device("cpu"))
    for layer, cache in enumerate(caches):  # every element tells its layer, K/V, block, slot, head, dim
        cache.copy_(torch.arange(cache.numel(), dtype=torch.float32).view(cache.shape) + 1000 * layer)
    return caches


def test_the_layers_are_views_of_one_allocation():
    caches = _filled_caches()
    stacked = stacked_kv_caches(caches)
    assert stacked.shape == (3, 2, 5, 2, 2, 4)
    stacked[1, 0, 4] = -1.0  # written through the stack, seen in the layer's own tensor
    assert bool((caches[1][0, 4] == -1).all())
    assert torch.equal(stacked_kv_caches(caches[:2]), stacked[:2])  # a pipeline stage's leading layers
    with pytest.raises(ValueError, match="one allocation"):
        stacked_kv_caches([torch.zeros(2, 5, 2, 2, 4) for _ in range(3)])


def test_offloads_then_onloads_move_whole_blocks_exactly():
    caches = _filled_caches()
    before = [c.clone() for c in caches]
    host = HostKVCache(caches, num_slots=3)
    host.copy([(1, 0), (3, 2)], [])
    for layer in range(3):
        assert torch.equal(host.host_cache[layer, :, 0], before[layer][:, 1])
        assert torch.equal(host.host_cache[layer, :, 2], before[layer][:, 3])
    # block 1 is reused (overwritten), then slot 0 comes back into block 4, slot 2 into block 0
    for cache in caches:
        cache[:, 1].fill_(7.0)
    host.copy([(1, 1)], [(0, 4), (2, 0)])
    for layer in range(3):
        assert torch.equal(host.host_cache[layer, :, 1], torch.full_like(before[layer][:, 1], 7.0))
        assert torch.equal(caches[layer][:, 4], before[layer][:, 1])
        assert torch.equal(caches[layer][:, 0], before[layer][:, 3])
        assert torch.equal(caches[layer][:, 2], before[layer][:, 2])  # untouched


def test_an_offload_in_the_same_step_is_read_back_by_its_onload():
    caches = _filled_caches()
    before = caches[2][:, 3].clone()
    HostKVCache(caches, num_slots=1).copy([(3, 0)], [(0, 3)])  # the old owner's bytes, back in place
    assert torch.equal(caches[2][:, 3], before)


def test_no_host_tier_copies_nothing_and_refuses_a_copy():
    none = host_kv_cache([torch.zeros(2, 5, 2, 2, 4)], 0)  # any caches will do: no buffer is made
    assert isinstance(none, NoHostKVCache) and none.num_slots == 0
    none.copy([], [])
    with pytest.raises(RuntimeError, match="without a host tier"):
        none.copy([(0, 0)], [])


def test_the_copies_travel_to_the_ranks_as_flat_pairs():
    offloads, onloads = [(5, 0), (9, 1)], [(3, 7)]
    ints = pack_pairs(offloads, onloads)
    assert ints == [5, 0, 9, 1, 3, 7]
    assert unpack_pairs(ints, 2, 1) == [offloads, onloads]
    assert unpack_pairs([], 0, 0) == [[], []]
