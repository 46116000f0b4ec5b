"""Attention over a paged KV cache: decode (one query per sequence) and chunked prefill."""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """One sequence's first `seq_len` K (or V) rows: [seq_len, num_kv_heads, head_dim]."""
    block_size = cache.shape[1]
    num_blocks = -(-seq_len // block_size)
    return cache[block_table[:num_blocks].long()].flatten(0, 1)[:seq_len]


def paged_decode_attention_ref(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                               block_tables: torch.Tensor, seq_lens: torch.Tensor,
                               scale: float) -> torch.Tensor:
    """query: [num_seqs, num_heads, head_dim], one token per sequence, the last of its context.
    block_tables: [num_seqs, max_blocks]; seq_lens: [num_seqs] context lengths. Returns like query."""
    num_seqs, num_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    max_len = int(seq_lens.max())
    num_blocks = -(-max_len // block_size)
    table = block_tables[:, :num_blocks].long()
    # [num_seqs, num_blocks * block_size, kv_heads, d] -> [num_seqs, kv_heads, L, d]
    keys = key_cache[table].flatten(1, 2).transpose(1, 2)
    values = value_cache[table].flatten(1, 2).transpose(1, 2)
    positions = torch.arange(keys.shape[2], device=query.device)
    mask = (positions[None, :] < seq_lens[:, None].to(positions.device))[:, None, None, :]
    # GQA without copying KV: the query heads of one KV head act as that head's query rows
    grouped = query.view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim).to(keys.dtype)
    out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=mask, scale=scale)
    return out.reshape(num_seqs, num_heads, head_dim).to(query.dtype)


def paged_prefill_attention_ref(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                                block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                                seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of each sequence's query chunk to its cached prefix and itself.

        keys:    [0 ............ seq_len)         (read through the block table)
        queries:            [seq_len - q_len, seq_len)   (this step's chunk)

    query: [num_tokens, num_heads, head_dim], sequences packed as query_start_loc says.
    """
    out = torch.empty_like(query)
    num_heads, num_kv_heads = query.shape[1], key_cache.shape[2]
    starts = query_start_loc.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        start, end = starts[i], starts[i + 1]
        q_len = end - start
        keys = gather_kv(key_cache, block_tables[i], seq_len).transpose(0, 1)
        values = gather_kv(value_cache, block_tables[i], seq_len).transpose(0, 1)
        q = query[start:end].transpose(0, 1).to(keys.dtype)
        if q_len == seq_len:
            attn = F.scaled_dot_product_attention(q, keys, values, is_causal=True, scale=scale,
                                                  enable_gqa=num_heads != num_kv_heads)
        else:
            mask = torch.ones(q_len, seq_len, dtype=torch.bool, device=query.device).tril(seq_len - q_len)
            attn = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale,
                                                  enable_gqa=num_heads != num_kv_heads)
        out[start:end] = attn.transpose(0, 1).to(query.dtype)
    return out


# ---------------------------------------------------------------------------------------------
# Triton kernels. Shared conventions:
#   * softmax runs in base 2: scores are pre-multiplied by scale * log2(e), so the exponentials
#     are the hardware's native exp2.
#   * K/V tiles of TILE_N tokens are gathered through the block table token by token, so the
#     tile size is independent of the cache's block size.
#   * cache offsets are int64: block_id * stride_block passes 2**31 on large caches.

LOG2E = 1.4426950408889634
PARTITION_SIZE = 512  # decode: context tokens per split-KV partition
TILE_N = 64           # keys per inner-loop step
BLOCK_M = 64          # prefill: (query token, query head) rows per program


def _use_fp32_dot(cache_dtype: torch.dtype) -> bool:
    """fp32 caches use exact fp32 products (no TF32); the interpreter's low-precision tl.dot
    is wrong (it multiplies bf16 bit patterns), so there tiles are upcast as well."""
    return cache_dtype == torch.float32 or os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _dot(a, b, FP32_DOT: tl.constexpr):
    if FP32_DOT:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        out = tl.dot(a, b)
    return out


@triton.jit
def _kv_offsets(block_table_ptr, pos, pos_mask, head_offset, dims, block_size, stride_cb, stride_cs):
    """[TILE_N, DIM_PAD] cache offsets of one KV head's keys at context positions `pos`."""
    block_ids = tl.load(block_table_ptr + pos // block_size, mask=pos_mask, other=0).to(tl.int64)
    rows = block_ids * stride_cb + (pos % block_size) * stride_cs + head_offset
    return rows[:, None] + dims[None, :]


@triton.jit
def _attend_tile(q, m, l, acc, k_cache_ptr, v_cache_ptr, offsets, kv_mask, visible, scale_log2,
                 FP32_DOT: tl.constexpr):
    """One online-softmax step of the rows of q over one K/V tile; `visible` masks scores."""
    k = tl.load(k_cache_ptr + offsets, mask=kv_mask, other=0.0)
    v = tl.load(v_cache_ptr + offsets, mask=kv_mask, other=0.0)
    scores = _dot(q, tl.trans(k), FP32_DOT) * scale_log2
    scores = tl.where(visible, scores, float("-inf"))
    m_new = tl.maximum(m, tl.max(scores, 1))
    p = tl.exp2(scores - m_new[:, None])
    alpha = tl.exp2(m - m_new)
    l = l * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, FP32_DOT)
    return m_new, l, acc


@triton.jit
def _decode_partition_kernel(
        out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr,
        q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, scale_log2,
        stride_qs, stride_qh, stride_os, stride_oh, stride_cb, stride_cs, stride_ch, stride_bt,
        num_heads, max_partitions, block_size,
        GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
        TILE_N: tl.constexpr, PARTITION_SIZE: tl.constexpr, SINGLE_PARTITION: tl.constexpr,
        FP32_DOT: tl.constexpr):
    """Program (seq, kv_head, partition): all GROUP query heads of one KV head over one slice
    of the context, so each K/V tile is read once for the whole group."""
    seq, kv_head, part = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    start = part * PARTITION_SIZE
    if start >= seq_len:
        return
    end = tl.minimum(start + PARTITION_SIZE, seq_len)
    group = tl.arange(0, GROUP_PAD)
    heads = kv_head * GROUP + group
    dims = tl.arange(0, DIM_PAD)
    row_mask = (group[:, None] < GROUP) & (dims[None, :] < HEAD_DIM)
    q = tl.load(q_ptr + seq.to(tl.int64) * stride_qs + heads[:, None] * stride_qh + dims[None, :],
                mask=row_mask, other=0.0).to(k_cache_ptr.dtype.element_ty)
    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, DIM_PAD], tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    head_offset = kv_head * stride_ch
    for tile_start in range(start, end, TILE_N):
        pos = tile_start + tl.arange(0, TILE_N)
        pos_mask = pos < end
        offsets = _kv_offsets(table, pos, pos_mask, head_offset, dims, block_size, stride_cb, stride_cs)
        kv_mask = pos_mask[:, None] & (dims[None, :] < HEAD_DIM)
        m, l, acc = _attend_tile(q, m, l, acc, k_cache_ptr, v_cache_ptr, offsets, kv_mask,
                                 pos_mask[None, :], scale_log2, FP32_DOT)
    if SINGLE_PARTITION:
        out = out_ptr + seq.to(tl.int64) * stride_os + heads[:, None] * stride_oh + dims[None, :]
        tl.store(out, acc / l[:, None], mask=row_mask)
    else:
        # Unnormalized partials; the reduction rescales them to the global max.
        idx = (seq * num_heads + heads).to(tl.int64) * max_partitions + part
        tl.store(part_acc_ptr + idx[:, None] * HEAD_DIM + dims[None, :], acc, mask=row_mask)
        tl.store(part_max_ptr + idx, m, mask=group < GROUP)
        tl.store(part_sum_ptr + idx, l, mask=group < GROUP)


@triton.jit
def _decode_reduce_kernel(out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr, seq_lens_ptr,
                          stride_os, stride_oh, num_heads, max_partitions,
                          PARTS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
                          PARTITION_SIZE: tl.constexpr):
    """Program (seq, head): out = sum_p 2^(m_p - M) acc_p / sum_p 2^(m_p - M) l_p."""
    seq, head = tl.program_id(0), tl.program_id(1)
    num_parts = tl.cdiv(tl.load(seq_lens_ptr + seq), PARTITION_SIZE)
    parts = tl.arange(0, PARTS_PAD)
    part_mask = parts < num_parts
    dims = tl.arange(0, DIM_PAD)
    idx = (seq * num_heads + head).to(tl.int64) * max_partitions + parts
    m = tl.load(part_max_ptr + idx, mask=part_mask, other=float("-inf"))
    l = tl.load(part_sum_ptr + idx, mask=part_mask, other=0.0)
    acc = tl.load(part_acc_ptr + idx[:, None] * HEAD_DIM + dims[None, :],
                  mask=part_mask[:, None] & (dims[None, :] < HEAD_DIM), other=0.0)
    weight = tl.exp2(m - tl.max(m, 0))
    out = tl.sum(acc * weight[:, None], 0) / tl.sum(l * weight, 0)
    tl.store(out_ptr + seq.to(tl.int64) * stride_os + head * stride_oh + dims, out, mask=dims < HEAD_DIM)


@triton.jit
def _prefill_kernel(
        out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, query_start_loc_ptr, seq_lens_ptr,
        scale_log2, stride_qt, stride_qh, stride_ot, stride_oh, stride_cb, stride_cs, stride_ch, stride_bt,
        block_size, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr,
        HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, TILE_N: tl.constexpr, FP32_DOT: tl.constexpr):
    """Program (seq, q_tile, kv_head): BLOCK_Q query tokens x the GROUP query heads of one KV head,
    as BLOCK_M = BLOCK_Q * GROUP (+ padding) rows, so each K/V tile is read once per group.
    Tiles past a sequence's chunk exit at once: the batch is ragged, the grid is not."""
    seq, q_tile, kv_head = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if q_tile * BLOCK_Q >= q_len:
        return
    ctx_len = tl.load(seq_lens_ptr + seq) - q_len
    rows = tl.arange(0, BLOCK_M)
    tokens = q_tile * BLOCK_Q + rows // GROUP
    heads = kv_head * GROUP + rows % GROUP
    dims = tl.arange(0, DIM_PAD)
    row_mask = ((rows < BLOCK_Q * GROUP) & (tokens < q_len))[:, None] & (dims[None, :] < HEAD_DIM)
    row_offsets = (q_start + tokens).to(tl.int64)[:, None]
    q = tl.load(q_ptr + row_offsets * stride_qt + heads[:, None] * stride_qh + dims[None, :],
                mask=row_mask, other=0.0).to(k_cache_ptr.dtype.element_ty)
    q_pos = ctx_len + tokens
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DIM_PAD], tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    # Keys past the tile's last query are causally invisible to all of its rows.
    kv_end = tl.minimum(ctx_len + q_len, ctx_len + (q_tile + 1) * BLOCK_Q)
    head_offset = kv_head * stride_ch
    for tile_start in range(0, kv_end, TILE_N):
        pos = tile_start + tl.arange(0, TILE_N)
        pos_mask = pos < kv_end
        offsets = _kv_offsets(table, pos, pos_mask, head_offset, dims, block_size, stride_cb, stride_cs)
        kv_mask = pos_mask[:, None] & (dims[None, :] < HEAD_DIM)
        # Key 0 is visible to every row (padding rows too), so no row's max stays -inf.
        m, l, acc = _attend_tile(q, m, l, acc, k_cache_ptr, v_cache_ptr, offsets, kv_mask,
                                 pos[None, :] <= q_pos[:, None], scale_log2, FP32_DOT)
    out = out_ptr + row_offsets * stride_ot + heads[:, None] * stride_oh + dims[None, :]
    tl.store(out, acc / l[:, None], mask=row_mask)


def _check_layout(query: torch.Tensor, out: torch.Tensor, key_cache: torch.Tensor,
                  value_cache: torch.Tensor) -> None:
    assert query.stride(-1) == 1 and out.stride(-1) == 1, "query/out: last dim must be contiguous"
    assert key_cache.stride() == value_cache.stride() and key_cache.stride(-1) == 1, \
        "key_cache/value_cache: same layout, last dim contiguous"
    assert query.shape[1] % key_cache.shape[2] == 0, "num_heads must be a multiple of num_kv_heads"


def _cache_args(key_cache: torch.Tensor, block_tables: torch.Tensor) -> tuple:
    return (key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), block_tables.stride(0))


def _decode_partials(query: torch.Tensor, num_parts: int) -> tuple[torch.Tensor, ...]:
    """fp32 partial results: [seqs, heads, parts, dim] accumulators, [seqs, heads, parts] max and
    sum of exponentials. (With one partition the kernel writes the output itself.)"""
    num_seqs, num_heads, head_dim = query.shape
    part_acc = query.new_empty((num_seqs, num_heads, num_parts, head_dim), dtype=torch.float32)
    part_max = part_acc.new_empty((num_seqs, num_heads, num_parts))
    return part_acc, part_max, torch.empty_like(part_max)


def paged_decode_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float, *,
                           max_seq_len: int | None = None, out: torch.Tensor | None = None,
                           partition_size: int = PARTITION_SIZE) -> torch.Tensor:
    """Triton version of `paged_decode_attention_ref` (flash-decoding, see docs/kernels.md).
    max_seq_len (an upper bound of seq_lens) saves a device sync; out receives the result."""
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    out = torch.empty_like(query) if out is None else out
    _check_layout(query, out, key_cache, value_cache)
    if num_seqs == 0:
        return out
    max_seq_len = int(seq_lens.max()) if max_seq_len is None else max_seq_len
    num_parts = triton.cdiv(max_seq_len, partition_size)
    part_acc, part_max, part_sum = _decode_partials(query, num_parts) if num_parts > 1 else (out,) * 3
    group = num_heads // num_kv_heads
    dim_pad = triton.next_power_of_2(head_dim)
    _decode_partition_kernel[(num_seqs, num_kv_heads, num_parts)](
        out, part_acc, part_max, part_sum, query, key_cache, value_cache, block_tables, seq_lens,
        scale * LOG2E, query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        *_cache_args(key_cache, block_tables), num_heads, num_parts, key_cache.shape[1],
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim, DIM_PAD=dim_pad,
        TILE_N=TILE_N, PARTITION_SIZE=partition_size, SINGLE_PARTITION=num_parts == 1,
        FP32_DOT=_use_fp32_dot(key_cache.dtype))
    if num_parts > 1:
        _decode_reduce_kernel[(num_seqs, num_heads)](
            out, part_acc, part_max, part_sum, seq_lens, out.stride(0), out.stride(1),
            num_heads, num_parts, PARTS_PAD=triton.next_power_of_2(num_parts),
            HEAD_DIM=head_dim, DIM_PAD=dim_pad, PARTITION_SIZE=partition_size)
    return out


def paged_prefill_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                            block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                            seq_lens: torch.Tensor, scale: float, *, max_query_len: int | None = None,
                            out: torch.Tensor | None = None) -> torch.Tensor:
    """Triton version of `paged_prefill_attention_ref`: the whole ragged batch in one launch.
    max_query_len (an upper bound of the chunk lengths) saves a device sync."""
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    out = torch.empty_like(query) if out is None else out
    _check_layout(query, out, key_cache, value_cache)
    if num_tokens == 0:
        return out
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    group = num_heads // num_kv_heads
    block_m = max(BLOCK_M, triton.next_power_of_2(group))
    block_q = block_m // group
    grid = (seq_lens.shape[0], triton.cdiv(max_query_len, block_q), num_kv_heads)
    _prefill_kernel[grid](
        out, query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, scale * LOG2E,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        *_cache_args(key_cache, block_tables), key_cache.shape[1],
        GROUP=group, BLOCK_M=block_m, BLOCK_Q=block_q, HEAD_DIM=head_dim,
        DIM_PAD=triton.next_power_of_2(head_dim), TILE_N=TILE_N, FP32_DOT=_use_fp32_dot(key_cache.dtype))
    return out
