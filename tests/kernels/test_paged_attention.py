"""Triton paged attention (run by the Triton interpreter) against the torch references."""
from __future__ import annotations

import math

import pytest
import torch
import triton
import triton.language as tl

from pdserve.kernels.paged_attention import (_tanh, paged_decode_attention, paged_decode_attention_ref,
                                             paged_prefill_attention, paged_prefill_attention_ref)

TOLERANCES = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 2.5e-2}


def make_block_tables(seq_lens: list[int], block_size: int, num_blocks: int,
                      num_extra: int = 2) -> torch.Tensor:
    """Each sequence gets distinct blocks from a random permutation of all block ids, so tables
    are non-contiguous; every row has `num_extra` or more unused (but valid) trailing entries."""
    needed = [-(-n // block_size) for n in seq_lens]
    width = max(needed) + num_extra
    ids = torch.randperm(num_blocks)
    assert sum(needed) <= num_blocks
    rows, used = [], 0
    for n in needed:
        row = torch.cat([ids[used:used + n], torch.randint(0, num_blocks, (width - n,))])
        rows.append(row)
        used += n
    return torch.stack(rows).to(torch.int32)


def make_caches(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)


def num_blocks_for(seq_lens: list[int], block_size: int) -> int:
    return sum(-(-n // block_size) for n in seq_lens) + 3


def assert_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    tol = TOLERANCES[ref.dtype]
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


# (block_size, head_dim, num_kv_heads, group, seq_lens, dtype, partition_size)
DECODE_CASES = [
    (16, 64, 2, 1, [1, 16, 17, 50], torch.float32, 512),
    (32, 128, 1, 3, [32, 33, 1, 95], torch.float32, 32),
    (16, 128, 1, 8, [48, 7, 16, 129], torch.float32, 64),
    (16, 80, 1, 3, [20, 33], torch.float32, 16),
    (32, 64, 2, 8, [64, 65, 3], torch.float16, 32),
    (16, 64, 1, 3, [17, 31, 80], torch.bfloat16, 64),
]


@pytest.mark.parametrize("block_size,head_dim,num_kv_heads,group,seq_lens,dtype,partition_size",
                         DECODE_CASES)
def test_decode_matches_reference(block_size, head_dim, num_kv_heads, group, seq_lens, dtype,
                                  partition_size):
    torch.manual_seed(0)
    num_blocks = num_blocks_for(seq_lens, block_size)
    key_cache, value_cache = make_caches(num_blocks, block_size, num_kv_heads, head_dim, dtype)
    block_tables = make_block_tables(seq_lens, block_size, num_blocks)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    query = torch.randn(len(seq_lens), num_kv_heads * group, head_dim).to(dtype)
    scale = 1 / math.sqrt(head_dim)
    out = paged_decode_attention(query, key_cache, value_cache, block_tables, lens, scale,
                                 partition_size=partition_size)
    assert_close(out, paged_decode_attention_ref(query, key_cache, value_cache, block_tables, lens, scale))


def test_decode_writes_into_strided_out():
    """The backend hands in a row slice of its output and a query slice of a wider tensor."""
    torch.manual_seed(0)
    key_cache, value_cache = make_caches(8, 16, 2, 64, torch.float32)
    block_tables = make_block_tables([40, 9], 16, 8)
    lens = torch.tensor([40, 9], dtype=torch.int32)
    wide = torch.randn(2, 6, 64)
    query = wide[:, :4]
    out = torch.full((3, 4, 64), 7.0)
    paged_decode_attention(query, key_cache, value_cache, block_tables, lens, 0.125, out=out[1:],
                           max_seq_len=40, partition_size=16)
    ref = paged_decode_attention_ref(query, key_cache, value_cache, block_tables, lens, 0.125)
    assert_close(out[1:], ref)
    assert bool((out[0] == 7.0).all())


# (block_size, head_dim, num_kv_heads, group, seq_lens, query_lens, dtype)
PREFILL_CASES = [
    (16, 64, 2, 1, [1, 16, 17, 40], [1, 16, 5, 40], torch.float32),
    (32, 128, 1, 3, [33, 64, 65], [33, 7, 1], torch.float32),
    (16, 64, 1, 8, [32, 17, 20], [9, 17, 2], torch.float32),
    (32, 64, 2, 3, [96, 40], [30, 40], torch.float16),
    (16, 128, 1, 8, [48, 15], [16, 15], torch.bfloat16),
]


@pytest.mark.parametrize("block_size,head_dim,num_kv_heads,group,seq_lens,query_lens,dtype", PREFILL_CASES)
def test_prefill_matches_reference(block_size, head_dim, num_kv_heads, group, seq_lens, query_lens, dtype):
    torch.manual_seed(0)
    num_blocks = num_blocks_for(seq_lens, block_size)
    key_cache, value_cache = make_caches(num_blocks, block_size, num_kv_heads, head_dim, dtype)
    block_tables = make_block_tables(seq_lens, block_size, num_blocks)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    query_start_loc = torch.tensor([0, *query_lens], dtype=torch.int32).cumsum(0).to(torch.int32)
    query = torch.randn(sum(query_lens), num_kv_heads * group, head_dim).to(dtype)
    scale = 1 / math.sqrt(head_dim)
    args = (query, key_cache, value_cache, block_tables, query_start_loc, lens, scale)
    assert_close(paged_prefill_attention(*args), paged_prefill_attention_ref(*args))


def test_cache_offsets_do_not_overflow_int32(huge_kv_caches, far_block_tables):
    """Blocks past element 2**32 of the cache: an int32 block_id * stride would wrap."""
    key_cache, value_cache = huge_kv_caches
    head_dim, block_tables = key_cache.shape[-1], far_block_tables
    lens = torch.tensor([40, 20], dtype=torch.int32)
    query = torch.randn(2, 3, head_dim).half()
    out = paged_decode_attention(query, key_cache, value_cache, block_tables, lens, 0.125, partition_size=16)
    assert_close(out, paged_decode_attention_ref(query, key_cache, value_cache, block_tables, lens, 0.125))
    query_start_loc = torch.tensor([0, 1, 3], dtype=torch.int32)
    chunk = torch.randn(3, 3, head_dim).half()
    args = (chunk, key_cache, value_cache, block_tables, query_start_loc, lens, 0.125)
    assert_close(paged_prefill_attention(*args), paged_prefill_attention_ref(*args))


def random_case(seed: int) -> dict:
    """A random shape from the grid the fixed cases above cover by hand."""
    gen = torch.Generator().manual_seed(seed)

    def pick(options):
        return options[int(torch.randint(len(options), (1,), generator=gen))]

    block_size = pick([16, 32])
    edges = [1, block_size, block_size + 1, 2 * block_size, 3 * block_size + 1]
    seq_lens = [pick(edges) if int(torch.randint(2, (1,), generator=gen)) else
                int(torch.randint(1, 150, (1,), generator=gen)) for _ in range(pick([1, 3, 5]))]
    query_lens = [int(torch.randint(1, n + 1, (1,), generator=gen)) for n in seq_lens]
    return dict(block_size=block_size, head_dim=pick([64, 128]), num_kv_heads=pick([1, 2]),
                group=pick([1, 3, 8]), seq_lens=seq_lens, query_lens=query_lens,
                partition_size=pick([16, 32, 64, 512]))


@pytest.mark.parametrize("seed", range(8))
def test_random_shapes_match_reference(seed):
    case = random_case(seed)
    torch.manual_seed(seed)
    seq_lens, query_lens, head_dim = case["seq_lens"], case["query_lens"], case["head_dim"]
    num_blocks = num_blocks_for(seq_lens, case["block_size"])
    key_cache, value_cache = make_caches(num_blocks, case["block_size"], case["num_kv_heads"], head_dim,
                                         torch.float32)
    block_tables = make_block_tables(seq_lens, case["block_size"], num_blocks)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    num_heads = case["num_kv_heads"] * case["group"]
    query = torch.randn(len(seq_lens), num_heads, head_dim)
    out = paged_decode_attention(query, key_cache, value_cache, block_tables, lens, 0.1,
                                 partition_size=case["partition_size"])
    assert_close(out, paged_decode_attention_ref(query, key_cache, value_cache, block_tables, lens, 0.1))
    query_start_loc = torch.tensor([0, *query_lens]).cumsum(0).to(torch.int32)
    query = torch.randn(sum(query_lens), num_heads, head_dim)
    args = (query, key_cache, value_cache, block_tables, query_start_loc, lens, 0.1)
    assert_close(paged_prefill_attention(*args), paged_prefill_attention_ref(*args))


# --- sliding windows and soft-capping, against a dense reference -------------------------------

def dense_kv(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """One sequence's K (or V) rows read position by position: [seq_len, num_kv_heads, head_dim]."""
    block_size = cache.shape[1]
    return torch.stack([cache[int(block_table[j // block_size]), j % block_size] for j in range(seq_len)])


def dense_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, first_pos: int, scale: float,
                    window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """Plain attention in float64 of queries [q_len, num_heads, d] at positions first_pos, ... over
    one sequence's keys/values [seq_len, num_kv_heads, d]: the query at p sees keys j with
    p - window < j <= p, scores soft-capped after the scale."""
    group = query.shape[1] // keys.shape[1]
    k, v = keys.double().repeat_interleave(group, 1), values.double().repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", query.double(), k) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    p = torch.arange(first_pos, first_pos + query.shape[0])[:, None]
    j = torch.arange(keys.shape[0])[None, :]
    mask = (j <= p) & (j > p - window) if window is not None else j <= p
    probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v).to(query.dtype)


def dense_decode(query, key_cache, value_cache, block_tables, seq_lens, scale, **variant) -> torch.Tensor:
    rows = []
    for i, n in enumerate(seq_lens.tolist()):
        keys, values = dense_kv(key_cache, block_tables[i], n), dense_kv(value_cache, block_tables[i], n)
        rows.append(dense_attention(query[i:i + 1], keys, values, n - 1, scale, **variant))
    return torch.cat(rows)


def dense_prefill(query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, scale,
                  **variant) -> torch.Tensor:
    starts, rows = query_start_loc.tolist(), []
    for i, n in enumerate(seq_lens.tolist()):
        keys, values = dense_kv(key_cache, block_tables[i], n), dense_kv(value_cache, block_tables[i], n)
        chunk = query[starts[i]:starts[i + 1]]
        rows.append(dense_attention(chunk, keys, values, n - chunk.shape[0], scale, **variant))
    return torch.cat(rows)


def assert_close_fp32(out: torch.Tensor, ref: torch.Tensor) -> None:
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


# GQA 8 query heads over 2 KV heads, blocks of 16; a ragged batch around the block edges.
# Windows: 1 (only itself), under a block, not a multiple of it, exactly 3 blocks.
VARIANT_BLOCK_SIZE, VARIANT_KV_HEADS, VARIANT_GROUP, VARIANT_HEAD_DIM = 16, 2, 4, 32
DECODE_LENS = [1, 5, 16, 17, 40, 70]
PREFILL_LENS, PREFILL_QUERY_LENS = [40, 17, 70, 5, 33], [8, 17, 30, 1, 33]  # cached prefixes and fresh prompts
WINDOWS = [None, 1, 5, 20, 48]
SOFTCAPS = [None, 5.0]


def variant_case(seq_lens: list[int], query_lens: list[int] | None = None, seed: int = 0) -> tuple:
    """(query, key_cache, value_cache, block_tables, [query_start_loc,] seq_lens): fp32, shuffled tables."""
    torch.manual_seed(seed)
    num_blocks = num_blocks_for(seq_lens, VARIANT_BLOCK_SIZE)
    caches = make_caches(num_blocks, VARIANT_BLOCK_SIZE, VARIANT_KV_HEADS, VARIANT_HEAD_DIM, torch.float32)
    tables = make_block_tables(seq_lens, VARIANT_BLOCK_SIZE, num_blocks)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    num_tokens = len(seq_lens) if query_lens is None else sum(query_lens)
    query = torch.randn(num_tokens, VARIANT_KV_HEADS * VARIANT_GROUP, VARIANT_HEAD_DIM)
    if query_lens is None:
        return query, *caches, tables, lens
    return query, *caches, tables, torch.tensor([0, *query_lens]).cumsum(0).to(torch.int32), lens


@pytest.mark.parametrize("softcap", SOFTCAPS)
@pytest.mark.parametrize("window", WINDOWS)
def test_windowed_softcapped_decode_matches_dense(window, softcap):
    args = variant_case(DECODE_LENS)
    variant = dict(window=window, softcap=softcap)
    dense = dense_decode(*args, 0.3, **variant)
    assert_close_fp32(paged_decode_attention_ref(*args, 0.3, **variant), dense)
    for partition_size in (16, 512):  # several partitions per sequence, and one
        assert_close_fp32(paged_decode_attention(*args, 0.3, partition_size=partition_size, **variant), dense)


@pytest.mark.parametrize("softcap", SOFTCAPS)
@pytest.mark.parametrize("window", WINDOWS)
def test_windowed_softcapped_prefill_matches_dense(window, softcap):
    args = variant_case(PREFILL_LENS, PREFILL_QUERY_LENS)
    variant = dict(window=window, softcap=softcap)
    dense = dense_prefill(*args, 0.3, **variant)
    assert_close_fp32(paged_prefill_attention_ref(*args, 0.3, **variant), dense)
    assert_close_fp32(paged_prefill_attention(*args, 0.3, **variant), dense)


@pytest.mark.parametrize("softcap", SOFTCAPS)
def test_a_window_wider_than_every_context_changes_nothing(softcap):
    decode, prefill = variant_case(DECODE_LENS), variant_case(PREFILL_LENS, PREFILL_QUERY_LENS)
    for window in (max(DECODE_LENS), 1000):  # exactly the longest context, and far more
        for fn, args in ((paged_decode_attention_ref, decode), (paged_decode_attention, decode),
                         (paged_prefill_attention_ref, prefill), (paged_prefill_attention, prefill)):
            assert torch.equal(fn(*args, 0.3, window=window, softcap=softcap), fn(*args, 0.3, softcap=softcap))


def poison_outside_windows(cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: list[int],
                           first_seen: list[int]) -> torch.Tensor:
    """A copy of the cache with NaN everywhere but each sequence's positions [first_seen, seq_len):
    a kernel that reads (or combines) anything outside them returns NaN."""
    poisoned = torch.full_like(cache, float("nan"))
    block_size = cache.shape[1]
    for i, (n, first) in enumerate(zip(seq_lens, first_seen)):
        for j in range(first, n):
            block, row = int(block_tables[i][j // block_size]), j % block_size
            poisoned[block, row] = cache[block, row]
    return poisoned


@pytest.mark.parametrize("window", [20, 70])  # one partition's worth of keys, and three (with the reduction)
def test_decode_reads_only_the_partitions_inside_the_window(window):
    """Contexts of up to 10 partitions of 32 keys; everything outside the windows is NaN."""
    seq_lens = [300, 45, 290, 9]
    query, key_cache, value_cache, tables, lens = variant_case(seq_lens)
    dense = dense_decode(query, key_cache, value_cache, tables, lens, 0.3, window=window, softcap=5.0)
    first_seen = [max(0, n - window) for n in seq_lens]
    caches = [poison_outside_windows(c, tables, seq_lens, first_seen) for c in (key_cache, value_cache)]
    out = paged_decode_attention(query, *caches, tables, lens, 0.3, partition_size=32, window=window, softcap=5.0)
    assert_close_fp32(out, dense)
    assert_close_fp32(paged_decode_attention_ref(query, *caches, tables, lens, 0.3, window=window, softcap=5.0),
                      dense)


def test_prefill_reads_only_keys_inside_the_window():
    seq_lens, query_lens, window = [90, 70], [20, 64], 12
    query, key_cache, value_cache, tables, loc, lens = variant_case(seq_lens, query_lens)
    dense = dense_prefill(query, key_cache, value_cache, tables, loc, lens, 0.3, window=window)
    first_seen = [max(0, n - q - window + 1) for n, q in zip(seq_lens, query_lens)]
    caches = [poison_outside_windows(c, tables, seq_lens, first_seen) for c in (key_cache, value_cache)]
    assert_close_fp32(paged_prefill_attention(query, *caches, tables, loc, lens, 0.3, window=window), dense)
    assert_close_fp32(paged_prefill_attention_ref(query, *caches, tables, loc, lens, 0.3, window=window), dense)


def test_prefill_rows_whose_window_starts_past_the_first_key_tile(monkeypatch):
    """Key tiles of 16 under query tiles of 64 tokens (no GQA): the tile's last rows see none of
    the first tile's keys, so their running max is still -inf after it."""
    import pdserve.kernels.paged_attention as pa
    monkeypatch.setattr(pa, "TILE_N", 16)
    torch.manual_seed(0)
    seq_lens, query_lens = [100, 64], [64, 64]
    key_cache, value_cache = make_caches(num_blocks_for(seq_lens, 16), 16, 1, 32, torch.float32)
    tables = make_block_tables(seq_lens, 16, key_cache.shape[0])
    args = (torch.randn(128, 1, 32), key_cache, value_cache, tables,
            torch.tensor([0, 64, 128], dtype=torch.int32), torch.tensor(seq_lens, dtype=torch.int32), 0.3)
    for window in (3, 20):
        assert_close_fp32(pa.paged_prefill_attention(*args, window=window, softcap=5.0),
                          dense_prefill(*args, window=window, softcap=5.0))


def test_bad_window_and_softcap_are_refused():
    args = variant_case([5])
    for fn in (paged_decode_attention_ref, paged_decode_attention):
        with pytest.raises(ValueError, match="window"):
            fn(*args, 0.3, window=0)
        with pytest.raises(ValueError, match="softcap"):
            fn(*args, 0.3, softcap=0.0)


@triton.jit
def _tanh_kernel(x_ptr, y_ptr, N: tl.constexpr):
    offsets = tl.arange(0, N)
    tl.store(y_ptr + offsets, _tanh(tl.load(x_ptr + offsets)))


def test_kernel_tanh_matches_torch():
    """The kernels' own tanh: accurate near 0 (where 1 - 2 / (e^2x + 1) cancels) and saturating."""
    x = torch.cat([torch.linspace(-0.3, 0.3, 241), torch.tensor([0.0, 1e-8, -1e-30, 0.125, -0.125, 20.0, -60.0,
                                                                  1e4, -1e4, 3.0, -7.5]), torch.randn(4)])
    x = torch.cat([x, torch.zeros(256 - x.numel())])
    y = torch.empty_like(x)
    _tanh_kernel[(1,)](x, y, N=256)
    torch.testing.assert_close(y, torch.tanh(x), atol=1.5e-7, rtol=1e-6)
