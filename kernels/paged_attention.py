"""Attention over a paged KV cache: decode (one query per sequence) and chunked prefill."""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int, start: int = 0) -> torch.Tensor:
    """One sequence's K (or V) rows at positions [start, seq_len): [seq_len - start, num_kv_heads, head_dim]."""
    block_size = cache.shape[1]
    first, num_blocks = start // block_size, -(-seq_len // block_size)
    rows = cache[block_table[first:num_blocks].long()].flatten(0, 1)
    return rows[start - first * block_size:seq_len - first * block_size]


def _check_window_softcap(window: int | None, softcap: float | None) -> None:
    if window is not None and window < 1:
        raise ValueError(f"window: expected None (off) or >= 1 keys, got {window}")
    if softcap is not None and softcap <= 0:
        raise ValueError(f"softcap: expected None (off) or > 0, got {softcap}")


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
               softcap: float | None) -> torch.Tensor:
    """softmax(cap * tanh(scale * q k^T / cap), masked) v over the last two dims (batch dims
    broadcast); softcap None is plain scaled dot-product attention."""
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    scores = (q.float() @ k.float().transpose(-1, -2)) * scale
    scores = softcap * torch.tanh(scores / softcap)
    probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
    return (probs @ v.float()).to(q.dtype)


def paged_decode_attention_ref(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                               block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float, *,
                               window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """query: [num_seqs, num_heads, head_dim], one token per sequence, the last of its context.
    block_tables: [num_seqs, max_blocks]; seq_lens: [num_seqs] context lengths. Returns like query.

    window W: the query sees only the last W positions of its context (its own included);
    softcap: scores = softcap * tanh(scores / softcap) after the scale. None: off."""
    _check_window_softcap(window, softcap)
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    max_len = int(seq_lens.max())
    if window is not None and window >= max_len:
        window = None  # every context fits the window
    keys, values, mask = (_gather_all(key_cache, value_cache, block_tables, seq_lens, max_len) if window is None
                          else _gather_windows(key_cache, value_cache, block_tables, seq_lens, window))
    # GQA without copying KV: the query heads of one KV head act as that head's query rows
    grouped = query.view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim).to(keys.dtype)
    out = _attention(grouped, keys, values, mask[:, None, None, :], scale, softcap)
    return out.reshape(num_seqs, num_heads, head_dim).to(query.dtype)


def _gather_all(key_cache, value_cache, block_tables, seq_lens, max_len: int) -> tuple[torch.Tensor, ...]:
    """Every sequence's positions [0, max_len) as [num_seqs, kv_heads, L, d] K and V, and the
    [num_seqs, L] mask of those inside its context."""
    block_size = key_cache.shape[1]
    table = block_tables[:, :-(-max_len // block_size)].long()
    # [num_seqs, num_blocks * block_size, kv_heads, d] -> [num_seqs, kv_heads, L, d]
    keys = key_cache[table].flatten(1, 2).transpose(1, 2)
    values = value_cache[table].flatten(1, 2).transpose(1, 2)
    positions = torch.arange(keys.shape[2], device=keys.device)
    return keys, values, positions[None, :] < seq_lens[:, None].to(positions.device)


def _gather_windows(key_cache, value_cache, block_tables, seq_lens, window: int) -> tuple[torch.Tensor, ...]:
    """Like _gather_all, but only the `window` positions each sequence's last query sees:

        seq_len 40, window 16:   positions [24 ........ 40)
        seq_len 9,  window 16:   positions [0 ... 9)[pad)    (masked)
    """
    block_size = key_cache.shape[1]
    lens = seq_lens.to(block_tables.device).long()
    positions = (lens - window).clamp(min=0)[:, None] + torch.arange(window, device=lens.device)
    inside = positions < lens[:, None]
    positions = torch.where(inside, positions, 0)  # padding reads position 0: a valid block
    blocks = block_tables.long().gather(1, positions // block_size)
    rows = positions % block_size
    keys, values = key_cache[blocks, rows].transpose(1, 2), value_cache[blocks, rows].transpose(1, 2)
    return keys, values, inside.to(keys.device)


def paged_prefill_attention_ref(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                                block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                                seq_lens: torch.Tensor, scale: float, *, window: int | None = None,
                                softcap: float | None = None) -> torch.Tensor:
    """Causal attention of each sequence's query chunk to its cached prefix and itself.

        keys:    [0 ............ seq_len)         (read through the block table)
        queries:            [seq_len - q_len, seq_len)   (this step's chunk)

    query: [num_tokens, num_heads, head_dim], sequences packed as query_start_loc says.
    window and softcap as in paged_decode_attention_ref; with a window, the keys gathered
    start at the chunk's first query position - window + 1.
    """
    _check_window_softcap(window, softcap)
    out = torch.empty_like(query)
    starts = query_start_loc.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        start, end = starts[i], starts[i + 1]
        seq_window = None if window is None or window >= seq_len else window  # wider: no effect
        if seq_window is None and softcap is None:
            attn = _prefill_one(query[start:end], key_cache, value_cache, block_tables[i], seq_len, scale)
        else:
            attn = _prefill_one_windowed(query[start:end], key_cache, value_cache, block_tables[i], seq_len,
                                         scale, seq_window, softcap)
        out[start:end] = attn.to(query.dtype)
    return out


def _prefill_one(query, key_cache, value_cache, block_table, seq_len: int, scale: float) -> torch.Tensor:
    q_len, num_heads, num_kv_heads = query.shape[0], query.shape[1], key_cache.shape[2]
    keys = gather_kv(key_cache, block_table, seq_len).transpose(0, 1)
    values = gather_kv(value_cache, block_table, seq_len).transpose(0, 1)
    # 4-D (a batch of one): 3-D inputs take SDPA's math path on CPU, 4-D its flash kernel,
    # 3.6x faster for a 512-token prompt on a 2-core EPYC
    q = query.transpose(0, 1).to(keys.dtype)[None]
    keys, values = keys[None], values[None]
    if q_len == seq_len:
        attn = F.scaled_dot_product_attention(q, keys, values, is_causal=True, scale=scale,
                                              enable_gqa=num_heads != num_kv_heads)
    else:
        mask = torch.ones(q_len, seq_len, dtype=torch.bool, device=query.device).tril(seq_len - q_len)
        attn = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale,
                                              enable_gqa=num_heads != num_kv_heads)
    return attn[0].transpose(0, 1)


def _prefill_one_windowed(query, key_cache, value_cache, block_table, seq_len: int, scale: float,
                          window: int | None, softcap: float | None) -> torch.Tensor:
    """One sequence's chunk with a window and/or softcap. Query position p sees keys j with
    p - window < j <= p; the GQA group's query heads act as rows of their KV head."""
    q_len, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    group = num_heads // num_kv_heads
    first = seq_len - q_len
    lo = 0 if window is None else max(0, first - window + 1)
    keys = gather_kv(key_cache, block_table, seq_len, lo).transpose(0, 1)
    values = gather_kv(value_cache, block_table, seq_len, lo).transpose(0, 1)
    q_pos = torch.arange(first, seq_len, device=query.device)[:, None]
    k_pos = torch.arange(lo, seq_len, device=query.device)[None, :]
    mask = k_pos <= q_pos
    if window is not None:
        mask &= k_pos > q_pos - window
    # [num_heads, q_len, d] -> [kv_heads, group * q_len, d]: row g * q_len + t is token t of head g
    q = query.transpose(0, 1).reshape(num_kv_heads, group * q_len, head_dim).to(keys.dtype)
    attn = _attention(q, keys, values, mask.repeat(group, 1).to(keys.device), scale, softcap)
    return attn.reshape(num_heads, q_len, head_dim).transpose(0, 1)


# ---------------------------------------------------------------------------------------------
# Triton kernels. Shared conventions:
#   * softmax runs in base 2: scores are pre-multiplied by scale * log2(e), so the exponentials
#     are the hardware's native exp2. A soft-cap applies in the natural-log domain before that:
#     cap * tanh(scale * qk / cap) * log2(e).
#   * HAS_WINDOW / SOFTCAP are constexpr flags: without them the kernels compile as if the
#     window and softcap arguments did not exist.
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
def _tanh(x):
    """tanh (Triton's libdevice tanh does not run in the interpreter): 1 - 2 / (e^2x + 1), and
    near 0, where that cancels, its Taylor series."""
    x2 = x * x
    series = x * (1.0 + x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0 - x2 * (17.0 / 315.0))))
    return tl.where(tl.abs(x) < 0.125, series, 1.0 - 2.0 / (tl.exp(2.0 * tl.minimum(x, 15.0)) + 1.0))


@triton.jit
def _kv_offsets(block_table_ptr, pos, pos_mask, head_offset, dims, block_size, stride_cb, stride_cs):
    """[TILE_N, DIM_PAD] cache offsets of one KV head's keys at context positions `pos`."""
    block_ids = tl.load(block_table_ptr + pos // block_size, mask=pos_mask, other=0).to(tl.int64)
    rows = block_ids * stride_cb + (pos % block_size) * stride_cs + head_offset
    return rows[:, None] + dims[None, :]


@triton.jit
def _attend_tile(q, m, l, acc, k_cache_ptr, v_cache_ptr, offsets, kv_mask, visible, scale_log2,
                 softcap_scale, softcap_log2, SOFTCAP: tl.constexpr, EMPTY_ROWS: tl.constexpr,
                 FP32_DOT: tl.constexpr):
    """One online-softmax step of the rows of q over one K/V tile; `visible` masks scores.
    SOFTCAP: scores = tanh(qk * softcap_scale) * softcap_log2 (scale / cap and cap * log2e).
    EMPTY_ROWS: a row may have seen no visible key yet (a window's rows start at different keys);
    its max stays -inf, so exponents are taken against 0 instead, which leaves its l and acc 0."""
    k = tl.load(k_cache_ptr + offsets, mask=kv_mask, other=0.0)
    v = tl.load(v_cache_ptr + offsets, mask=kv_mask, other=0.0)
    if SOFTCAP:
        scores = _tanh(_dot(q, tl.trans(k), FP32_DOT) * softcap_scale) * softcap_log2
    else:
        scores = _dot(q, tl.trans(k), FP32_DOT) * scale_log2
    scores = tl.where(visible, scores, float("-inf"))
    m_new = tl.maximum(m, tl.max(scores, 1))
    m_sub = m_new
    if EMPTY_ROWS:
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(scores - m_sub[:, None])
    alpha = tl.exp2(m - m_sub)
    l = l * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, FP32_DOT)
    return m_new, l, acc


@triton.jit
def _decode_partition_kernel(
        out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr,
        q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, scale_log2,
        window, softcap_scale, softcap_log2,
        stride_qs, stride_qh, stride_os, stride_oh, stride_cb, stride_cs, stride_ch, stride_bt,
        num_heads, max_partitions, block_size,
        GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
        TILE_N: tl.constexpr, PARTITION_SIZE: tl.constexpr, SINGLE_PARTITION: tl.constexpr,
        HAS_WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, FP32_DOT: tl.constexpr):
    """Program (seq, kv_head, partition): all GROUP query heads of one KV head over one slice
    of the context, so each K/V tile is read once for the whole group.

    With a window the partitions tile only the keys the query sees, so every key a program
    reads is visible and no partition lies wholly outside the window:

        seq_len 1300, window 700, PARTITION_SIZE 512: cdiv(700, 512) = 2 partitions
        [0 ... unread ... 600)[600 --- partition 0 --- 1112)[1112 - partition 1 - 1300)
    """
    seq, kv_head, part = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    start = part * PARTITION_SIZE
    if HAS_WINDOW:
        start += tl.maximum(seq_len - window, 0)
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
                                 pos_mask[None, :], scale_log2, softcap_scale, softcap_log2,
                                 SOFTCAP, False, FP32_DOT)
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
def _decode_reduce_kernel(out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr, seq_lens_ptr, window,
                          stride_os, stride_oh, num_heads, max_partitions,
                          PARTS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
                          PARTITION_SIZE: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """Program (seq, head): out = sum_p 2^(m_p - M) acc_p / sum_p 2^(m_p - M) l_p over the
    partitions that ran: those that tile the seq_len keys (with a window, min(seq_len, window))."""
    seq, head = tl.program_id(0), tl.program_id(1)
    num_keys = tl.load(seq_lens_ptr + seq)
    if HAS_WINDOW:
        num_keys = tl.minimum(num_keys, window)
    num_parts = tl.cdiv(num_keys, PARTITION_SIZE)
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
        scale_log2, window, softcap_scale, softcap_log2,
        stride_qt, stride_qh, stride_ot, stride_oh, stride_cb, stride_cs, stride_ch, stride_bt,
        block_size, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr,
        HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, TILE_N: tl.constexpr,
        HAS_WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, FP32_DOT: tl.constexpr):
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
    kv_start = 0
    if HAS_WINDOW:
        # Keys before the window of the tile's first query are invisible to all of its rows.
        # Padding rows take the tile's last query position, so every row sees its own key.
        kv_start = tl.maximum(ctx_len + q_tile * BLOCK_Q - window + 1, 0)
        q_pos = tl.minimum(q_pos, kv_end - 1)
    for tile_start in range(kv_start, kv_end, TILE_N):
        pos = tile_start + tl.arange(0, TILE_N)
        pos_mask = pos < kv_end
        offsets = _kv_offsets(table, pos, pos_mask, head_offset, dims, block_size, stride_cb, stride_cs)
        kv_mask = pos_mask[:, None] & (dims[None, :] < HEAD_DIM)
        visible = pos[None, :] <= q_pos[:, None]
        if HAS_WINDOW:
            visible = visible & (pos[None, :] > q_pos[:, None] - window)
        # Without a window key 0 is visible to every row (padding rows too), so no row's max
        # stays -inf; with one, a row's first tiles may hold none of its keys (EMPTY_ROWS).
        m, l, acc = _attend_tile(q, m, l, acc, k_cache_ptr, v_cache_ptr, offsets, kv_mask, visible,
                                 scale_log2, softcap_scale, softcap_log2, SOFTCAP, HAS_WINDOW, FP32_DOT)
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


def _variant_args(scale: float, window: int | None, softcap: float | None) -> tuple[tuple, dict]:
    """The kernels' (scale_log2, window, softcap_scale, softcap_log2) arguments and their
    HAS_WINDOW / SOFTCAP flags; off, the values are unused placeholders."""
    _check_window_softcap(window, softcap)
    values = (scale * LOG2E, window or 0, scale / softcap if softcap else 0.0, softcap * LOG2E if softcap else 0.0)
    return values, dict(HAS_WINDOW=window is not None, SOFTCAP=softcap is not None)


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
                           partition_size: int = PARTITION_SIZE, window: int | None = None,
                           softcap: float | None = None) -> torch.Tensor:
    """Triton version of `paged_decode_attention_ref` (flash-decoding, see docs/kernels.md).
    max_seq_len (an upper bound of seq_lens) saves a device sync; out receives the result.
    With a window, partitions cover only the last `window` keys: at most cdiv(window, partition_size)."""
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    out = torch.empty_like(query) if out is None else out
    _check_layout(query, out, key_cache, value_cache)
    if num_seqs == 0:
        return out
    max_seq_len = int(seq_lens.max()) if max_seq_len is None else max_seq_len
    if window is not None and window >= max_seq_len:
        window = None  # every context fits the window
    num_parts = triton.cdiv(max_seq_len if window is None else window, partition_size)
    part_acc, part_max, part_sum = _decode_partials(query, num_parts) if num_parts > 1 else (out,) * 3
    group = num_heads // num_kv_heads
    dim_pad = triton.next_power_of_2(head_dim)
    values, flags = _variant_args(scale, window, softcap)
    _decode_partition_kernel[(num_seqs, num_kv_heads, num_parts)](
        out, part_acc, part_max, part_sum, query, key_cache, value_cache, block_tables, seq_lens,
        *values, query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        *_cache_args(key_cache, block_tables), num_heads, num_parts, key_cache.shape[1],
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim, DIM_PAD=dim_pad,
        TILE_N=TILE_N, PARTITION_SIZE=partition_size, SINGLE_PARTITION=num_parts == 1,
        FP32_DOT=_use_fp32_dot(key_cache.dtype), **flags)
    if num_parts > 1:
        _decode_reduce_kernel[(num_seqs, num_heads)](
            out, part_acc, part_max, part_sum, seq_lens, values[1], out.stride(0), out.stride(1),
            num_heads, num_parts, PARTS_PAD=triton.next_power_of_2(num_parts),
            HEAD_DIM=head_dim, DIM_PAD=dim_pad, PARTITION_SIZE=partition_size, HAS_WINDOW=flags["HAS_WINDOW"])
    return out


def paged_prefill_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                            block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                            seq_lens: torch.Tensor, scale: float, *, max_query_len: int | None = None,
                            out: torch.Tensor | None = None, window: int | None = None,
                            softcap: float | None = None) -> torch.Tensor:
    """Triton version of `paged_prefill_attention_ref`: the whole ragged batch in one launch.
    max_query_len (an upper bound of the chunk lengths) saves a device sync. With a window, a
    query tile's key loop starts at its first query's window."""
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
    values, flags = _variant_args(scale, window, softcap)
    _prefill_kernel[grid](
        out, query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, *values,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        *_cache_args(key_cache, block_tables), key_cache.shape[1],
        GROUP=group, BLOCK_M=block_m, BLOCK_Q=block_q, HEAD_DIM=head_dim,
        DIM_PAD=triton.next_power_of_2(head_dim), TILE_N=TILE_N, FP32_DOT=_use_fp32_dot(key_cache.dtype),
        **flags)
    return out
