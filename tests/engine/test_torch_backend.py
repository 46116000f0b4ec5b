"""The torch backend's decode grouping: which decodes share a gather, and that the grouped
result is each sequence's own attention, whatever the mix of context lengths."""
from __future__ import annotations

import torch

from pdserve.engine.attention.backend import AttentionMetadata
from pdserve.engine.attention.selector import get_attention_backend
from pdserve.engine.attention.torch_backend import length_groups
from pdserve.kernels.paged_attention import paged_decode_attention_ref
from tests.kernels.test_paged_attention import dense_decode


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


def decode_step(seq_lens: list[int], block_size: int = 16, num_blocks: int = 300) -> AttentionMetadata:
    """Decodes only, over shuffled blocks; this step's token at each sequence's last position."""
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    perm = torch.randperm(num_blocks).tolist()
    tables, start = [], 0
    for n in blocks_per_seq:
        tables.append(perm[start:start + n] + [0] * (max(blocks_per_seq) - n))
        start += n
    return AttentionMetadata(
        num_decodes=len(seq_lens), query_start_loc=torch.arange(len(seq_lens) + 1, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_tables=torch.tensor(tables, dtype=torch.int32),
        slot_mapping=torch.tensor([tables[i][(n - 1) // block_size] * block_size + (n - 1) % block_size
                                   for i, n in enumerate(seq_lens)]),
        max_query_len=1, max_seq_len=max(seq_lens))


def test_a_window_groups_decodes_by_the_keys_they_gather():
    """Past the window every context gathers the same `window` keys: one group; without the
    window (another layer of the same step) the lengths still split."""
    meta = decode_step([70, 2050, 33, 600, 5, 1500])
    backend = get_attention_backend("torch")
    assert backend._decode_groups(meta, 64) is None
    assert [g.tolist() for g in backend._decode_groups(meta, None)] == [[4, 2, 0], [3], [5, 1]]
    assert [g.tolist() for g in backend._decode_groups(meta, 600)] == [[4, 2, 0], [1, 3, 5]]


def test_windowed_softcapped_decodes_equal_the_dense_reference():
    torch.manual_seed(0)
    seq_lens, num_heads, num_kv_heads, head_dim = [70, 2050, 33, 600, 5, 1500], 8, 2, 32
    meta = decode_step(seq_lens)
    query = torch.randn(len(seq_lens), num_heads, head_dim)
    key, value = torch.randn(2, len(seq_lens), num_kv_heads, head_dim)
    kv_cache = torch.randn(2, 300, 16, num_kv_heads, head_dim)
    for window, softcap in [(100, None), (600, 30.0), (None, 5.0), (1, None)]:
        out = get_attention_backend("torch").forward(query, key, value, kv_cache, meta, 0.2, window=window,
                                                     softcap=softcap)
        dense = dense_decode(query, kv_cache[0], kv_cache[1], meta.block_tables, meta.seq_lens, 0.2,
                             window=window, softcap=softcap)
        torch.testing.assert_close(out, dense, atol=1e-5, rtol=1e-5)
