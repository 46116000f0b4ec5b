// Decode attention that reads the paged KV cache in place (the CPU twin of the Triton
// decode kernel in kernels/paged_attention.py; reference: paged_decode_attention_ref).
//
// One task per (sequence, KV head): the GROUP query heads sharing that KV head are scored
// together, so each K/V row is loaded (and converted to float) once for the whole group.
//
//   context position t  ->  block_tables[seq][t / block_size], row t % block_size
//
//   pass 1: scores[g][t] = scale * q[g] . k[t]           (K rows, in place)
//           softcap > 0: scores = softcap * tanh(scores / softcap)
//   softmax over t in float32, per query head g
//   pass 2: acc[g] += p[g][t] * v[t]                      (V rows, in place)
//
// t runs over [begin, seq_len): begin = max(0, seq_len - window) with a window (window > 0),
// else 0, so a windowed layer reads only the keys its query sees.
//
// Tasks run under at::parallel_for, so torch.set_num_threads applies; a task's arithmetic
// does not depend on which thread runs it, so results are identical for any thread count.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

struct Shape {
  int64_t num_seqs, num_heads, num_kv_heads, group, head_dim, block_size, max_blocks;
  int64_t q_stride_seq, q_stride_head, out_stride_seq, out_stride_head;
  int64_t cache_stride_block, cache_stride_row, cache_stride_head, table_stride;
};

// Plain loops over contiguous float rows: with -O3 and `omp simd` gcc vectorizes them
// (the reduction clause allows reassociating the float sum).
// dot keeps kLanes partial sums (4 AVX2 registers): independent FMA chains instead of one
// chain as long as head_dim / 8, whose latency would bound the score pass.
constexpr int64_t kLanes = 32;

inline float dot(const float* __restrict a, const float* __restrict b, int64_t n) {
  float lanes[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
#pragma omp simd
    for (int64_t j = 0; j < kLanes; ++j) lanes[j] += a[i + j] * b[i + j];
  }
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < kLanes; ++j) sum += lanes[j];
  for (; i < n; ++i) sum += a[i] * b[i];  // head_dim % 32 (e.g. 80)
  return sum;
}

inline void axpy(float* __restrict y, float a, const float* __restrict x, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}

template <typename scalar_t>
inline void to_float(float* __restrict dst, const scalar_t* __restrict src, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// A cache row as float: float32 caches are used in place, 16-bit ones converted into `tmp`.
template <typename scalar_t>
inline const float* row_as_float(const scalar_t* row, float* tmp, int64_t n) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    return row;
  } else {
    to_float(tmp, row, n);
    return tmp;
  }
}

// A sequence's blocks sit at random places in the cache and one KV head's rows are strided,
// so the hardware prefetcher cannot follow them: without software prefetch the passes wait
// on memory (measured: 2x slower at batch 64 x 270 tokens).
template <typename scalar_t>
inline void prefetch_row(const scalar_t* row, int64_t head_dim) {
  constexpr int64_t kLine = 64;
  const char* bytes = reinterpret_cast<const char*>(row);
  for (int64_t off = 0; off < head_dim * static_cast<int64_t>(sizeof(scalar_t)); off += kLine)
    __builtin_prefetch(bytes + off);
}

// visit(t, row) for each context position t in [begin, seq_len), in order, with `row` this KV
// head's row of position t. Row r of a block prefetches row r of the next block: a block ahead
// of use, and spread out rather than one burst that would overflow the miss buffers.
template <typename scalar_t, typename Visit>
inline void for_each_row(const Shape& s, const scalar_t* cache, const int32_t* table, int64_t kv_head,
                         int64_t begin, int64_t seq_len, Visit&& visit) {
  auto block_at = [&](int64_t b) {
    return cache + table[b] * s.cache_stride_block + kv_head * s.cache_stride_head;
  };
  auto rows_in = [&](int64_t b) {  // block b's rows before seq_len
    return std::max<int64_t>(0, std::min(s.block_size, seq_len - b * s.block_size));
  };
  const int64_t first = begin / s.block_size, first_row = begin % s.block_size;
  for (int64_t r = first_row; r < rows_in(first); ++r)
    prefetch_row(block_at(first) + r * s.cache_stride_row, s.head_dim);
  // the next block's rows below first_row, which the first block's loop does not prefetch
  for (int64_t r = 0; r < std::min(first_row, rows_in(first + 1)); ++r)
    prefetch_row(block_at(first + 1) + r * s.cache_stride_row, s.head_dim);
  for (int64_t b = first; b * s.block_size < seq_len; ++b) {
    const int64_t n = rows_in(b), n_next = rows_in(b + 1);
    const scalar_t* block = block_at(b);
    const scalar_t* next = n_next ? block_at(b + 1) : block;
    for (int64_t r = b == first ? first_row : 0; r < n; ++r) {
      if (r < n_next) prefetch_row(next + r * s.cache_stride_row, s.head_dim);
      visit(b * s.block_size + r, block + r * s.cache_stride_row);
    }
  }
}

// scores[0, n) -> exp(score - max), in place; returns 1 / their sum.
inline float softmax_numerators(float* scores, int64_t n) {
  float max_score = -std::numeric_limits<float>::infinity();
  for (int64_t t = 0; t < n; ++t) max_score = std::max(max_score, scores[t]);
  float sum = 0.f;
  for (int64_t t = 0; t < n; ++t) {
    scores[t] = std::exp(scores[t] - max_score);
    sum += scores[t];
  }
  return 1.f / sum;
}

// Per-thread scratch, sized once per parallel chunk and reused by its tasks.
struct Scratch {
  std::vector<float> q, scores, acc, row, inv_sum;
  Scratch(const Shape& s, int64_t max_len)
      : q(s.group * s.head_dim), scores(s.group * max_len), acc(s.group * s.head_dim), row(s.head_dim),
        inv_sum(s.group) {}
};

// scores[0, n) -> softcap * tanh(score / softcap), in place.
inline void soft_cap(float* scores, int64_t n, float softcap) {
  const float inv = 1.f / softcap;
  for (int64_t t = 0; t < n; ++t) scores[t] = softcap * std::tanh(scores[t] * inv);
}

// The keys a query at position seq_len - 1 sees: the last `window` (window > 0) or all.
inline int64_t window_begin(int64_t seq_len, int64_t window) {
  return window > 0 ? std::max<int64_t>(0, seq_len - window) : 0;
}

template <typename scalar_t>
void attend_one(const Shape& s, int64_t seq, int64_t kv_head, int64_t seq_len, scalar_t* out,
                const scalar_t* query, const scalar_t* key_cache, const scalar_t* value_cache,
                const int32_t* block_tables, float scale, int64_t window, float softcap, Scratch& w) {
  const int64_t d = s.head_dim, group = s.group;
  const int64_t begin = window_begin(seq_len, window), n = seq_len - begin;  // scores[g * n + t - begin]
  const int64_t first_head = kv_head * group;
  for (int64_t g = 0; g < group; ++g) {  // q pre-scaled: one multiply per head, not per score
    const scalar_t* q = query + seq * s.q_stride_seq + (first_head + g) * s.q_stride_head;
    for (int64_t i = 0; i < d; ++i) w.q[g * d + i] = static_cast<float>(q[i]) * scale;
  }
  const int32_t* table = block_tables + seq * s.table_stride;

  for_each_row(s, key_cache, table, kv_head, begin, seq_len, [&](int64_t t, const scalar_t* k_row) {
    const float* k = row_as_float(k_row, w.row.data(), d);
    for (int64_t g = 0; g < group; ++g) w.scores[g * n + t - begin] = dot(w.q.data() + g * d, k, d);
  });
  if (softcap > 0.f) soft_cap(w.scores.data(), group * n, softcap);
  for (int64_t g = 0; g < group; ++g) w.inv_sum[g] = softmax_numerators(w.scores.data() + g * n, n);

  std::fill(w.acc.begin(), w.acc.end(), 0.f);
  for_each_row(s, value_cache, table, kv_head, begin, seq_len, [&](int64_t t, const scalar_t* v_row) {
    const float* v = row_as_float(v_row, w.row.data(), d);
    for (int64_t g = 0; g < group; ++g) axpy(w.acc.data() + g * d, w.scores[g * n + t - begin], v, d);
  });

  for (int64_t g = 0; g < group; ++g) {
    scalar_t* o = out + seq * s.out_stride_seq + (first_head + g) * s.out_stride_head;
    for (int64_t i = 0; i < d; ++i) o[i] = static_cast<scalar_t>(w.acc[g * d + i] * w.inv_sum[g]);
  }
}

template <typename scalar_t>
void decode(const Shape& s, at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
            const at::Tensor& value_cache, const int32_t* tables, const int32_t* lens, int64_t max_len,
            float scale, int64_t window, float softcap) {
  scalar_t* out_ptr = out.data_ptr<scalar_t>();
  const scalar_t* q_ptr = query.const_data_ptr<scalar_t>();
  const scalar_t* k_ptr = key_cache.const_data_ptr<scalar_t>();
  const scalar_t* v_ptr = value_cache.const_data_ptr<scalar_t>();
  at::parallel_for(0, s.num_seqs * s.num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    Scratch scratch(s, window > 0 ? std::min(max_len, window) : max_len);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t seq = task / s.num_kv_heads, kv_head = task % s.num_kv_heads;
      attend_one<scalar_t>(s, seq, kv_head, lens[seq], out_ptr, q_ptr, k_ptr, v_ptr, tables, scale, window,
                           softcap, scratch);
    }
  });
}

void check_inputs(const at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                  const at::Tensor& value_cache, const at::Tensor& block_tables, const at::Tensor& seq_lens) {
  for (const auto* t : {&out, &query, &key_cache, &value_cache, &block_tables, &seq_lens})
    TORCH_CHECK(t->device().is_cpu(), "paged_decode_attention: all tensors must be on the CPU (got ",
                t->device(), "); use attention_backend='triton' on a GPU");
  TORCH_CHECK(query.dim() == 3, "query: expected [num_seqs, num_heads, head_dim], got ", query.sizes());
  TORCH_CHECK(key_cache.dim() == 4,
              "key_cache: expected [num_blocks, block_size, num_kv_heads, head_dim], got ", key_cache.sizes());
  auto dtype = query.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
              "query: dtype must be float32, bfloat16 or float16, got ", dtype);
  TORCH_CHECK(out.sizes() == query.sizes() && out.scalar_type() == dtype,
              "out: expected the shape and dtype of query ", query.sizes(), " ", dtype, ", got ", out.sizes(),
              " ", out.scalar_type());
  TORCH_CHECK(key_cache.scalar_type() == dtype, "key_cache: dtype must equal query's (", dtype, "), got ",
              key_cache.scalar_type());
  TORCH_CHECK(value_cache.sizes() == key_cache.sizes() && value_cache.strides() == key_cache.strides() &&
                  value_cache.scalar_type() == dtype,
              "value_cache: expected the shape, strides and dtype of key_cache");
  TORCH_CHECK(key_cache.size(3) == query.size(2), "key_cache: head_dim ", key_cache.size(3),
              " differs from query's ", query.size(2));
  TORCH_CHECK(key_cache.size(2) > 0 && query.size(1) % key_cache.size(2) == 0, "key_cache: num_kv_heads ",
              key_cache.size(2), " must divide query's num_heads ", query.size(1));
  TORCH_CHECK(query.stride(2) == 1, "query: last dim must be contiguous");
  TORCH_CHECK(out.stride(2) == 1, "out: last dim must be contiguous");
  TORCH_CHECK(key_cache.stride(3) == 1, "key_cache: last dim must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.dim() == 2 &&
                  block_tables.size(0) == query.size(0) && block_tables.stride(1) == 1,
              "block_tables: expected int32 [num_seqs, max_blocks] with a contiguous last dim, got ",
              block_tables.scalar_type(), " ", block_tables.sizes());
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.dim() == 1 && seq_lens.size(0) == query.size(0) &&
                  seq_lens.is_contiguous(),
              "seq_lens: expected contiguous int32 [num_seqs], got ", seq_lens.scalar_type(), " ", seq_lens.sizes());
}

// Out-of-range lengths or block ids would read outside the cache: checked up front (cheap
// next to the attention itself), since a TORCH_CHECK inside the parallel loop cannot name them well.
int64_t check_tables(const Shape& s, const int32_t* tables, const int32_t* lens, int64_t num_blocks) {
  int64_t max_len = 0;
  for (int64_t seq = 0; seq < s.num_seqs; ++seq) {
    const int64_t len = lens[seq];
    TORCH_CHECK(len >= 1 && len <= s.max_blocks * s.block_size, "seq_lens: sequence ", seq, " has length ",
                len, "; expected 1..", s.max_blocks * s.block_size, " (max_blocks * block_size)");
    for (int64_t b = 0; b < (len + s.block_size - 1) / s.block_size; ++b) {
      const int64_t id = tables[seq * s.table_stride + b];
      TORCH_CHECK(id >= 0 && id < num_blocks, "block_tables: sequence ", seq, " block ", b, " is ", id,
                  "; the cache has ", num_blocks, " blocks");
    }
    max_len = std::max(max_len, len);
  }
  return max_len;
}

at::Tensor& paged_decode_attention(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                                   const at::Tensor& value_cache, const at::Tensor& block_tables,
                                   const at::Tensor& seq_lens, double scale, int64_t window, double softcap) {
  check_inputs(out, query, key_cache, value_cache, block_tables, seq_lens);
  TORCH_CHECK(window >= 0, "window: expected 0 (no window) or the number of keys a query sees, got ", window);
  TORCH_CHECK(softcap >= 0, "softcap: expected 0 (no soft-cap) or a positive cap, got ", softcap);
  const int64_t num_kv_heads = key_cache.size(2);
  const Shape s{query.size(0), query.size(1), num_kv_heads, query.size(1) / num_kv_heads, query.size(2),
                key_cache.size(1), block_tables.size(1), query.stride(0), query.stride(1), out.stride(0),
                out.stride(1), key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
                block_tables.stride(0)};
  const int32_t* tables = block_tables.const_data_ptr<int32_t>();
  const int32_t* lens = seq_lens.const_data_ptr<int32_t>();
  const int64_t max_len = check_tables(s, tables, lens, key_cache.size(0));
  if (s.num_seqs == 0) return out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "paged_decode_attention", [&] {
    decode<scalar_t>(s, out, query, key_cache, value_cache, tables, lens, max_len, static_cast<float>(scale),
                     window, static_cast<float>(softcap));
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(pdserve, m) {
  m.def(
      "paged_decode_attention(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, "
      "Tensor block_tables, Tensor seq_lens, float scale, int window=0, float softcap=0.0) -> Tensor(a!)");
}

TORCH_LIBRARY_IMPL(pdserve, CPU, m) { m.impl("paged_decode_attention", &paged_decode_attention); }
