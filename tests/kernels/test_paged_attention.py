"""Triton paged attention (run by the Triton interpreter) against the torch references."""
from __future__ import annotations

import math

import pytest
import torch

from kernels.paged_attention import (paged_decode_attention, paged_decode_attention_ref,
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
