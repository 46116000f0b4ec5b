"""The torch backend's decode grouping: which decodes share a gather, and that the grouped
result is each sequence's own attention, whatever the mix of context lengths."""
from __future__ import annotations

import torch

from engine.attention.backend import AttentionMetadata
from engine.attention.selector import get_attention_backend
from engine.attention.torch_backend import length_groups
from kernels.paged_attention import paged_decode_attention_ref


def test_long_contexts_do_not_share_a_gather_with_short_ones():
    assert length_groups([70, 65, 2050, 90, 2060]) == [[1, 0, 3], [2, 4]]
    assert length_groups([10, 200, 260]) == [[0, 1, 2]]       # within the slack: one gather
    assert length_groups([300, 601, 599]) == [[0, 2], [1]]    # 601 > 2 x 300
    assert length_groups([]) == []
    groups = length_groups([5] * 40)
    assert [len(g) for g in groups] == [16, 16, 8] and sorted(sum(groups, [])) == list(range(40))


def test_grouped_decodes_equal_each_sequence_alone():
    torch.manual_seed(0)
    block_size, num_blocks, num_heads, num_kv_heads, head_dim = 16, 300, 6, 2, 32
    seq_lens = [70, 2050, 33, 600, 5, 1500]
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    perm = torch.randperm(num_blocks).tolist()
    tables, start = [], 0
    for n in blocks_per_seq:
        tables.append(perm[start:start + n] + [0] * (max(blocks_per_seq) - n))
        start += n
    meta = AttentionMetadata(
        num_decodes=len(seq_lens), query_start_loc=torch.arange(len(seq_lens) + 1, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_tables=torch.tensor(tables, dtype=torch.int32),
        slot_mapping=torch.tensor([tables[i][(n - 1) // block_size] * block_size + (n - 1) % block_size
                                   for i, n in enumerate(seq_lens)]),
        max_query_len=1, max_seq_len=max(seq_lens))
    query = torch.randn(len(seq_lens), num_heads, head_dim)
    key, value = torch.randn(2, len(seq_lens), num_kv_heads, head_dim)
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim)
    out = get_attention_backend("torch").forward(query, key, value, kv_cache, meta, 0.2)
    for i in range(len(seq_lens)):  # the cache now holds this step's keys and values
        alone = paged_decode_attention_ref(query[i:i + 1], kv_cache[0], kv_cache[1], meta.block_tables[i:i + 1],
                                           meta.seq_lens[i:i + 1], 0.2)
        torch.testing.assert_close(out[i:i + 1], alone, atol=1e-5, rtol=1e-5)
