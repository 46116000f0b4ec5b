"""The C++ CPU decode kernel (kernels/cpu) against paged_decode_attention_ref."""
from __future__ import annotations

import pytest
import torch

from pdserve.kernels.cpu import paged_decode_attention
from pdserve.kernels.paged_attention import paged_decode_attention_ref
from tests.kernels.test_paged_attention import (DECODE_LENS, SOFTCAPS, WINDOWS, assert_close_fp32, dense_decode,
                                                make_block_tables, make_caches, num_blocks_for,
                                                poison_outside_windows, variant_case)

TOLERANCES = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}


def make_case(block_size: int, head_dim: int, num_kv_heads: int, group: int, seq_lens: list[int],
              dtype: torch.dtype, seed: int = 0) -> tuple:
    """(query, key_cache, value_cache, block_tables, seq_lens) with shuffled block tables."""
    torch.manual_seed(seed)
    num_blocks = num_blocks_for(seq_lens, block_size)
    key_cache, value_cache = make_caches(num_blocks, block_size, num_kv_heads, head_dim, dtype)
    tables = make_block_tables(seq_lens, block_size, num_blocks)
    query = torch.randn(len(seq_lens), num_kv_heads * group, head_dim).to(dtype)
    return query, key_cache, value_cache, tables, torch.tensor(seq_lens, dtype=torch.int32)


def assert_matches_ref(args: tuple, scale: float = 0.125) -> torch.Tensor:
    out = paged_decode_attention(*args, scale)
    ref = paged_decode_attention_ref(*args, scale)
    assert out.dtype == ref.dtype and out.shape == ref.shape
    tol = TOLERANCES[ref.dtype]
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [16, 32])
def test_decode_matches_reference(block_size, head_dim, group, dtype):
    # 1 token, exactly one and two blocks, one past a block, a long ragged one
    seq_lens = [1, block_size, block_size + 1, 2 * block_size, 5 * block_size + 7]
    assert_matches_ref(make_case(block_size, head_dim, 2, group, seq_lens, dtype))


@pytest.mark.parametrize("head_dim", [80, 256])
def test_odd_and_largest_head_dims(head_dim):
    assert_matches_ref(make_case(16, head_dim, 1, 3, [9, 40, 33], torch.float32))


def test_float16():
    assert_matches_ref(make_case(16, 64, 3, 3, [1, 16, 270], torch.float16))


def test_strided_query_and_out():
    """query as a slice of a fused QKV output, out a slice of a wider buffer (last dims contiguous)."""
    query, *rest = make_case(16, 64, 2, 3, [5, 40], torch.float32)
    qkv = torch.randn(2, 10, 64)
    qkv[:, :6] = query
    wide = torch.zeros(2, 8, 64)
    paged_decode_attention(qkv[:, :6], *rest, 0.125, out=wide[:, 1:7])
    ref = paged_decode_attention_ref(query, *rest, 0.125)
    torch.testing.assert_close(wide[:, 1:7], ref, atol=1e-5, rtol=1e-5)
    assert wide[:, 0].abs().max() == 0 and wide[:, 7].abs().max() == 0


def test_threads_do_not_change_the_result():
    args = make_case(16, 64, 3, 3, [1, 16, 270, 33, 100, 7, 64, 200], torch.float32)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = paged_decode_attention(*args, 0.125)
        torch.set_num_threads(max(2, threads))
        several = paged_decode_attention(*args, 0.125)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, several)


def test_empty_batch():
    query, key_cache, value_cache, _, _ = make_case(16, 64, 1, 1, [3], torch.float32)
    out = paged_decode_attention(query[:0], key_cache, value_cache, torch.zeros(0, 4, dtype=torch.int32),
                                 torch.zeros(0, dtype=torch.int32), 0.125)
    assert out.shape == (0, 1, 64)


def test_cache_offsets_do_not_overflow_int32(huge_kv_caches, far_block_tables):
    """Blocks past element 2**32 of the (block-interleaved, so strided) fp16 cache."""
    key_cache, value_cache = huge_kv_caches
    head_dim, block_tables = key_cache.shape[-1], far_block_tables
    query = torch.randn(2, 3, head_dim).half()
    lens = torch.tensor([40, 20], dtype=torch.int32)
    assert_matches_ref((query, key_cache, value_cache, block_tables, lens))


def _bad(**changes) -> dict:
    query, key_cache, value_cache, tables, lens = make_case(16, 64, 2, 3, [5, 40], torch.float32)
    args = dict(query=query, key_cache=key_cache, value_cache=value_cache, block_tables=tables,
                seq_lens=lens, scale=0.125)
    return {**args, **{k: change(args) for k, change in changes.items()}}


def _int32(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


def _with(t: torch.Tensor, index: tuple, value: int) -> torch.Tensor:
    t = t.clone()
    t[index] = value
    return t


BAD_INPUTS = {
    "query: dtype": dict(query=lambda a: a["query"].double()),
    "key_cache: dtype": dict(key_cache=lambda a: a["key_cache"].bfloat16()),
    "value_cache: expected": dict(value_cache=lambda a: a["value_cache"][:, :8]),
    "query: expected": dict(query=lambda a: a["query"][0]),
    "key_cache: num_kv_heads": dict(query=lambda a: a["query"][:, :5]),
    "key_cache: head_dim": dict(query=lambda a: a["query"][..., :32]),
    "query: last dim must be contiguous": dict(query=lambda a: a["query"].mT.contiguous().mT),
    "block_tables: expected int32": dict(block_tables=lambda a: a["block_tables"].long()),
    "seq_lens: expected contiguous int32": dict(seq_lens=lambda a: a["seq_lens"].long()),
    "seq_lens: sequence 1 has length 0": dict(seq_lens=lambda a: _int32([5, 0])),
    "seq_lens: sequence 0 has length 9999": dict(seq_lens=lambda a: _int32([9999, 5])),
    "block_tables: sequence 1 block 2 is -1": dict(block_tables=lambda a: _with(a["block_tables"], (1, 2), -1)),
}


@pytest.mark.parametrize("message", sorted(BAD_INPUTS))
def test_bad_inputs_name_the_argument(message):
    args = _bad(**BAD_INPUTS[message])
    with pytest.raises(RuntimeError, match=message):
        paged_decode_attention(**args)


def test_bad_out_names_the_argument():
    args = _bad()
    with pytest.raises(RuntimeError, match="out: expected the shape and dtype of query"):
        paged_decode_attention(**args, out=torch.empty(2, 6, 64, dtype=torch.bfloat16))


def test_a_failed_build_says_what_failed_and_names_the_torch_backend(monkeypatch):
    from pdserve.kernels.cpu import build

    def no_compiler(**kwargs):
        raise RuntimeError("Error building extension 'pdserve_cpu_kernels'")
    monkeypatch.setattr(build.cpp_extension, "load", no_compiler)
    with pytest.raises(build.CpuKernelBuildError, match="attention_backend='torch'") as info:
        build.load_library.__wrapped__()
    assert "paged_attention.cpp" in str(info.value) and "Error building extension" in str(info.value)


@pytest.mark.parametrize("softcap", SOFTCAPS)
@pytest.mark.parametrize("window", WINDOWS)
def test_windowed_softcapped_decode_matches_dense(window, softcap):
    args = variant_case(DECODE_LENS)
    out = paged_decode_attention(*args, 0.3, window=window, softcap=softcap)
    assert_close_fp32(out, dense_decode(*args, 0.3, window=window, softcap=softcap))


@pytest.mark.parametrize("softcap", SOFTCAPS)
def test_a_window_wider_than_every_context_changes_nothing(softcap):
    args = variant_case(DECODE_LENS)
    for window in (max(DECODE_LENS), 1000):
        assert torch.equal(paged_decode_attention(*args, 0.3, window=window, softcap=softcap),
                           paged_decode_attention(*args, 0.3, softcap=softcap))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_windowed_softcapped_16_bit(dtype):
    args = make_case(16, 64, 2, 4, [1, 16, 33, 270], dtype)
    out = paged_decode_attention(*args, 0.125, window=40, softcap=20.0)
    ref = paged_decode_attention_ref(*args, 0.125, window=40, softcap=20.0)
    torch.testing.assert_close(out.float(), ref.float(), atol=TOLERANCES[dtype], rtol=TOLERANCES[dtype])


@pytest.mark.parametrize("window", [1, 7, 16, 40])  # under a block, a block, several
def test_decode_reads_only_the_window(window):
    """Everything outside the windows is NaN: the loop starts at the window's first key."""
    seq_lens = [300, 45, 290, 9]
    query, key_cache, value_cache, tables, lens = variant_case(seq_lens)
    dense = dense_decode(query, key_cache, value_cache, tables, lens, 0.3, window=window, softcap=5.0)
    first_seen = [max(0, n - window) for n in seq_lens]
    caches = [poison_outside_windows(c, tables, seq_lens, first_seen) for c in (key_cache, value_cache)]
    assert_close_fp32(paged_decode_attention(query, *caches, tables, lens, 0.3, window=window, softcap=5.0), dense)


def test_bad_window_and_softcap_are_refused():
    args = _bad()
    with pytest.raises(ValueError, match="window"):
        paged_decode_attention(**args, window=0)
    with pytest.raises(ValueError, match="softcap"):
        paged_decode_attention(**args, softcap=-1.0)
    with pytest.raises(RuntimeError, match="window: expected 0"):  # the op itself, called directly
        torch.ops.pdserve.paged_decode_attention(torch.empty_like(args["query"]), *list(args.values())[:5],
                                                 0.125, -3, 0.0)
