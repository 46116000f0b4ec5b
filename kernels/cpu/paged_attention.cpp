// Decode attention that reads the paged KV cache in place (the CPU twin of the Triton
// decode kernel in kernels/paged_attention.py; reference: paged_decode_attention_ref).
//
// Decode is bound by reading K and V, so the loop is laid out for streaming them:
//
//   work item = (sequence, chunk of up to kMaxChunk keys); all KV heads of the item at once,
//   so a block's rows are read front to back (a block is [block_size, kv_heads, head_dim],
//   contiguous) and each K/V row once for the GROUP query heads that share it.
//
//   per tile of up to kTile rows of one block, per KV head h:
//     s[g][r] = scale * q[g] . k[r]                  (softcap: cap * tanh(s / cap))
//     online softmax: m[g] = max(m[g], max_r s[g][r]); p = exp(s - m); rescale l, acc
//     acc[g] += sum_r p[g][r] * v[r]
//
// A sequence longer than kMaxChunk keys is split into chunks whose (m, l, acc) are merged at
// the end, so few long sequences still spread over all threads. A sequence's chunks depend on
// its keys only, and each is computed the same way whichever thread runs it: the result
// depends neither on the thread count nor on the rest of the batch.
//
// t runs over [begin, seq_len): begin = max(0, seq_len - window) with a window (window > 0),
// else 0, so a windowed layer reads only the keys its query sees.
//
// Vector code: AVX-512 intrinsics where the compiler targets it (build.py compiles with
// -march=native), else plain loops the compiler vectorizes for the machine it builds on
// (AVX2 included); nothing here selects instructions the build machine lacks.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__AVX512F__) || defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>

namespace {

struct Shape {
  int64_t num_seqs, num_heads, num_kv_heads, group, head_dim, block_size, max_blocks;
  int64_t q_stride_seq, q_stride_head, out_stride_seq, out_stride_head;
  int64_t cache_stride_block, cache_stride_row, cache_stride_head, table_stride;
};

// Rows scored together: one AVX-512 vector of scores per query head.
constexpr int64_t kTile = 16;
// The longest chunk a sequence is split into (into equal chunks, ceil(keys / kMaxChunk)).
// Long enough that the typical decode context is one chunk and a split's cost (a
// [heads, head_dim] partial per chunk and their merge) is noise next to reading its K/V;
// short enough that one sequence of a few hundred tokens still splits between two threads.
constexpr int64_t kMaxChunk = 512;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// ---------------------------------------------------------------- conversions to float

// n elements to float. Without AVX-512, 16-bit caches are converted one tile at a time into
// L1 scratch and read by the float code: the conversion is cheap next to the memory read.
inline void to_float(float* __restrict dst, const c10::BFloat16* __restrict src, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16) {  // bf16 is the top half of a float32
    const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
    _mm512_storeu_ps(dst + i, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16)));
  }
#elif defined(__AVX2__)
  for (; i + 8 <= n; i += 8) {
    const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16)));
  }
#endif
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

inline void to_float(float* __restrict dst, const c10::Half* __restrict src, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i))));
#elif defined(__F16C__)
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
#endif
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// n rows (`stride` elements apart) as float rows: float32 caches in place (stride kept),
// 16-bit ones converted into `tmp` (stride head_dim). Returns the rows and sets *out_stride.
template <typename scalar_t>
inline const float* rows_as_float(const scalar_t* rows, int64_t stride, int64_t n, int64_t d, float* tmp,
                                  int64_t* out_stride) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    *out_stride = stride;
    return rows;
  } else {
    for (int64_t r = 0; r < n; ++r) to_float(tmp + r * d, rows + r * stride, d);
    *out_stride = d;
    return tmp;
  }
}

#if defined(__AVX512F__)
// 16 cache elements as floats, converted in registers (the AVX-512 paths read 16-bit caches
// in place, with no converted copy).
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
#endif

// ---------------------------------------------------------------- scores

// Fallback dot product: kLanes partial sums, independent FMA chains the compiler vectorizes
// (the reduction clause allows reassociating the float sum).
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

#if defined(__AVX512F__)
// Lane r of the result = the sum of v[r]'s 16 lanes: a transpose-and-add tree (15 adds for
// 16 rows) instead of 16 separate horizontal sums.
inline __m512 sum_lanes_16(const __m512* v) {
  __m512 pairs[8], quads[4], octs[2];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
    pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: rows 4i..4i+3, that lane's share
    const __m512d a = _mm512_castps_pd(pairs[2 * i]), b = _mm512_castps_pd(pairs[2 * i + 1]);
    quads[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  for (int i = 0; i < 2; ++i)  // [rows 8i..+3 (2 shares), rows 8i+4..+7 (2 shares)]
    octs[i] = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], 0x88),
                            _mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(octs[0], octs[1], 0x88), _mm512_shuffle_f32x4(octs[0], octs[1], 0xDD));
}

// scores[r] = q . k[r] for r < n (rows `stride` elements apart), 0 beyond; d % 16 == 0.
template <typename scalar_t>
inline void tile_dots_avx512(const float* q, const scalar_t* k, int64_t stride, int64_t n, int64_t d,
                             float* scores) {
  __m512 acc[kTile];
  for (int r = 0; r < kTile; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t c = 0; c < d; c += 16) {
    const __m512 qc = _mm512_loadu_ps(q + c);
#pragma GCC unroll 16
    for (int r = 0; r < kTile; ++r)
      if (r < n) acc[r] = _mm512_fmadd_ps(qc, load16(k + r * stride + c), acc[r]);
  }
  _mm512_storeu_ps(scores, sum_lanes_16(acc));
}
#endif

// scores[g * kTile + r] = q[g] . k[r] for the group's query heads g and rows r < n (rows
// `stride` elements apart); lanes r >= n are -inf (so they drop out of the max and exp to 0).
// tmp: kTile * d floats for the fallback's converted rows.
template <typename scalar_t>
inline void tile_scores(const float* q, int64_t group, int64_t d, const scalar_t* k, int64_t stride, int64_t n,
                        float* scores, float* tmp) {
#if defined(__AVX512F__)
  if (d % 16 == 0) {
    for (int64_t g = 0; g < group; ++g) tile_dots_avx512(q + g * d, k, stride, n, d, scores + g * kTile);
  } else
#endif
  {
    int64_t k_stride;
    const float* kf = rows_as_float(k, stride, n, d, tmp, &k_stride);
    for (int64_t g = 0; g < group; ++g)
      for (int64_t r = 0; r < n; ++r) scores[g * kTile + r] = dot(q + g * d, kf + r * k_stride, d);
  }
  for (int64_t g = 0; g < group; ++g)
    for (int64_t r = n; r < kTile; ++r) scores[g * kTile + r] = kNegInf;
}

// scores[0, n) -> softcap * tanh(score / softcap), in place.
inline void soft_cap(float* scores, int64_t n, float softcap) {
  const float inv = 1.f / softcap;
  for (int64_t t = 0; t < n; ++t) scores[t] = softcap * std::tanh(scores[t] * inv);
}

// ---------------------------------------------------------------- softmax

#if defined(__AVX512F__)
// exp of 16 floats <= 0 (score - running max), float32-accurate (Cephes expf: a degree-5
// polynomial on x - n ln2, |error| ~1 ulp); scalef applies 2^n without overflow tricks.
// -inf (masked lanes) is clamped to -104, whose exp underflows to 0.
inline __m512 exp_avx512(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-104.f)), _mm512_set1_ps(88.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);  // ln2 in two parts: r exact
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);
}
#endif

// s[0, kTile) -> exp(s - m_new), returning their sum.
inline float exp_shifted(float* s, float m_new) {
#if defined(__AVX512F__)
  const __m512 p = exp_avx512(_mm512_sub_ps(_mm512_loadu_ps(s), _mm512_set1_ps(m_new)));
  _mm512_storeu_ps(s, p);
  return _mm512_reduce_add_ps(p);
#else
  float sum = 0.f;
  for (int64_t r = 0; r < kTile; ++r) {
    s[r] = std::exp(s[r] - m_new);
    sum += s[r];
  }
  return sum;
#endif
}

// Running softmax state of one query head over the keys seen so far: max score m, sum of
// exp(score - m) l, and acc = sum of exp(score - m) * v (divided by l at the end).
struct Running {
  float* m;
  float* l;
  float* acc;
};

// Folds a tile's scores (s[g * kTile + r]) into the group's running state; leaves the
// tile's probabilities exp(s - m) in s for the V pass.
inline void online_softmax(float* s, int64_t group, int64_t d, const Running& st) {
  for (int64_t g = 0; g < group; ++g) {
    float* sg = s + g * kTile;
    float tile_max = kNegInf;
    for (int64_t r = 0; r < kTile; ++r) tile_max = std::max(tile_max, sg[r]);
    float& m = st.m[g];
    if (tile_max > m) {  // a new max: what was summed against the old one shrinks
      const float shrink = std::exp(m - tile_max);  // 0 for the first tile (m = -inf)
      st.l[g] *= shrink;
      float* acc = st.acc + g * d;
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) acc[i] *= shrink;
      m = tile_max;
    }
    st.l[g] += exp_shifted(sg, m);
  }
}

// ---------------------------------------------------------------- values

// K and V rows to prefetch: the next block's rows of the head in use, one row per row
// processed, so the read runs a block ahead and is spread out rather than one burst that
// would overflow the miss buffers. A sequence's blocks sit at random places in the cache,
// where the hardware prefetcher cannot follow (measured 2x slower without).
//
// Into L2 (prefetcht1), not L1: a prefetch into L1 holds one of L1's few miss buffers until
// its line arrives, and with a block's 128 lines requested at once on a Zen 4 core the
// prefetches themselves stalled the loop (profile: a fifth of the kernel's samples on
// prefetcht0), leaving the read at 7 GB/s per core; L2 tracks more misses, and the later load
// from L2 costs a few cycles that the FMAs hide. Measured there 1.5-1.7x on batch-64 decode.
struct Prefetch {
  const char* k = nullptr;  // row 0 of the tile's rows in the next block, or null
  const char* v = nullptr;
  int64_t stride_bytes = 0, row_bytes = 0;
};

inline void prefetch_row(const char* row, int64_t bytes) {
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(row + off, 0, 2);  // read, prefetcht1
}

inline void prefetch_next(const Prefetch& next, int64_t r) {
  if (next.k) {
    prefetch_row(next.k + r * next.stride_bytes, next.row_bytes);
    prefetch_row(next.v + r * next.stride_bytes, next.row_bytes);
  }
}

#if defined(__AVX512F__)
// The AVX-512 tile_accumulate (d % 16 == 0). Accumulators for up to 4 query heads x 64
// columns stay in registers across the tile's rows, and each V row is loaded once for those
// heads: 16 independent FMA chains rather than a load and a store of acc per FMA.
constexpr int kHeadsPerPass = 4, kVecsPerPass = 4;

template <typename scalar_t>
inline void tile_accumulate_avx512(const float* p, int64_t group, int64_t d, const scalar_t* v, int64_t stride,
                                   int64_t n, float* acc, const Prefetch& next) {
  for (int64_t g0 = 0; g0 < group; g0 += kHeadsPerPass) {
    const int64_t heads = std::min<int64_t>(kHeadsPerPass, group - g0);
    for (int64_t c = 0; c < d; c += 16 * kVecsPerPass) {
      const int64_t width = std::min<int64_t>(kVecsPerPass, (d - c) / 16);  // vectors in this column block
      __m512 a[kHeadsPerPass][kVecsPerPass];
#pragma GCC unroll 4
      for (int g = 0; g < kHeadsPerPass; ++g)
#pragma GCC unroll 4
        for (int j = 0; j < kVecsPerPass; ++j)
          a[g][j] = g < heads && j < width ? _mm512_loadu_ps(acc + (g0 + g) * d + c + 16 * j) : _mm512_setzero_ps();
      for (int64_t r = 0; r < n; ++r) {
        if (g0 == 0 && c == 0) prefetch_next(next, r);  // spread over the first pass, not a burst
        const scalar_t* vr = v + r * stride + c;
        __m512 vj[kVecsPerPass];
#pragma GCC unroll 4
        for (int j = 0; j < kVecsPerPass; ++j) vj[j] = j < width ? load16(vr + 16 * j) : _mm512_setzero_ps();
#pragma GCC unroll 4
        for (int g = 0; g < kHeadsPerPass; ++g) {
          if (g >= heads) break;
          const __m512 pr = _mm512_set1_ps(p[(g0 + g) * kTile + r]);
#pragma GCC unroll 4
          for (int j = 0; j < kVecsPerPass; ++j) a[g][j] = _mm512_fmadd_ps(pr, vj[j], a[g][j]);
        }
      }
#pragma GCC unroll 4
      for (int g = 0; g < kHeadsPerPass; ++g)
#pragma GCC unroll 4
        for (int j = 0; j < kVecsPerPass; ++j)
          if (g < heads && j < width) _mm512_storeu_ps(acc + (g0 + g) * d + c + 16 * j, a[g][j]);
    }
  }
}
#endif

// acc[g] += sum_{r < n} p[g * kTile + r] * v[r] for the group's query heads g (rows `stride`
// elements apart); tmp: kTile * d floats for the fallback's converted rows.
template <typename scalar_t>
inline void tile_accumulate(const float* p, int64_t group, int64_t d, const scalar_t* v_rows, int64_t stride,
                            int64_t n, float* acc, const Prefetch& next, float* tmp) {
#if defined(__AVX512F__)
  if (d % 16 == 0) {
    tile_accumulate_avx512(p, group, d, v_rows, stride, n, acc, next);
    return;
  }
#endif
  int64_t v_stride;
  const float* v = rows_as_float(v_rows, stride, n, d, tmp, &v_stride);
  for (int64_t r = 0; r < n; ++r) {
    prefetch_next(next, r);
    const float* vr = v + r * v_stride;
    for (int64_t g = 0; g < group; ++g) {
      const float pr = p[g * kTile + r];
      float* __restrict a = acc + g * d;
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) a[i] += pr * vr[i];
    }
  }
}

// ---------------------------------------------------------------- one work item

template <typename scalar_t>
struct Inputs {
  scalar_t* out;
  const scalar_t *query, *key_cache, *value_cache;
  const int32_t *tables, *lens;
  float scale, softcap;
  int64_t window;
};

// Per-thread scratch, allocated once per thread and reused by its items.
struct Scratch {
  std::vector<float> q, m, l, acc, scores, rows;
  explicit Scratch(const Shape& s)
      : q(s.num_heads * s.head_dim), m(s.num_heads), l(s.num_heads), acc(s.num_heads * s.head_dim),
        scores(s.group * kTile), rows(kTile * s.head_dim) {}
};

// Keys [t0, t1) of a sequence, all heads: fills w.m, w.l, w.acc (w.q holds the scaled query).
template <typename scalar_t>
void attend_keys(const Shape& s, const Inputs<scalar_t>& in, int64_t seq, int64_t t0, int64_t t1, Scratch& w) {
  const int64_t d = s.head_dim, bs = s.block_size, group = s.group;
  const int32_t* table = in.tables + seq * s.table_stride;
  const int64_t stride_bytes = s.cache_stride_row * static_cast<int64_t>(sizeof(scalar_t));
  for (int64_t t = t0; t < t1;) {
    const int64_t b = t / bs, row_end = std::min(bs, t1 - b * bs);
    const int64_t block_offset = table[b] * s.cache_stride_block;
    const bool has_next = (b + 1) * bs < t1;
    const int64_t next_offset = has_next ? table[b + 1] * s.cache_stride_block : 0;
    for (int64_t r0 = t % bs; r0 < row_end; r0 += kTile) {
      const int64_t n = std::min(kTile, row_end - r0);
      for (int64_t h = 0; h < s.num_kv_heads; ++h) {
        const int64_t rows = r0 * s.cache_stride_row + h * s.cache_stride_head;
        const Running st{w.m.data() + h * group, w.l.data() + h * group, w.acc.data() + h * group * d};
        tile_scores(w.q.data() + h * group * d, group, d, in.key_cache + block_offset + rows, s.cache_stride_row,
                    n, w.scores.data(), w.rows.data());
        if (in.softcap > 0.f)
          for (int64_t g = 0; g < group; ++g) soft_cap(w.scores.data() + g * kTile, n, in.softcap);
        online_softmax(w.scores.data(), group, d, st);
        Prefetch next;
        if (has_next) {
          next = {reinterpret_cast<const char*>(in.key_cache + next_offset + rows),
                  reinterpret_cast<const char*>(in.value_cache + next_offset + rows), stride_bytes,
                  d * static_cast<int64_t>(sizeof(scalar_t))};
        }
        tile_accumulate(w.scores.data(), group, d, in.value_cache + block_offset + rows, s.cache_stride_row, n,
                        st.acc, next, w.rows.data());
      }
    }
    t = b * bs + row_end;
  }
}

// The keys a query at position seq_len - 1 sees: the last `window` (window > 0) or all.
inline int64_t window_begin(int64_t seq_len, int64_t window) {
  return window > 0 ? std::max<int64_t>(0, seq_len - window) : 0;
}

// ---------------------------------------------------------------- work split and merge

// Keys [t0, t1) of sequence seq. split < 0: the whole sequence, written straight to out;
// else the index of its Split, and slot that of its partial (m, l, acc).
struct Item {
  int64_t seq, t0, t1, split, slot;
};

// A sequence split into `count` chunks, whose partials are slots [first_slot, +count).
struct Split {
  int64_t seq, first_slot, count;
};

// A partial is [m (heads), l (heads), acc (heads * head_dim)].
inline int64_t partial_size(const Shape& s) { return s.num_heads * (s.head_dim + 2); }

// A sequence's chunks depend on its own keys only (not on the batch or the thread count).
// Inner boundaries fall on multiples of kTile, so with block sizes that are multiples of
// kTile every tile is full but the sequence's first and last.
void plan_items(const Shape& s, const int32_t* lens, int64_t window, std::vector<Item>& items,
                std::vector<Split>& splits) {
  int64_t slots = 0;
  for (int64_t seq = 0; seq < s.num_seqs; ++seq) {
    const int64_t len = lens[seq], begin = window_begin(len, window), keys = len - begin;
    const int64_t chunks = (keys + kMaxChunk - 1) / kMaxChunk;
    if (chunks == 1) {
      items.push_back({seq, begin, len, -1, -1});
      continue;
    }
    const int64_t split = static_cast<int64_t>(splits.size());
    splits.push_back({seq, slots, chunks});
    for (int64_t c = 0, t0 = begin; c < chunks; ++c) {  // chunks > 1: keys > kMaxChunk, shares > kTile
      const int64_t t1 = c + 1 == chunks ? len : (begin + keys * (c + 1) / chunks) / kTile * kTile;
      items.push_back({seq, t0, t1, split, slots++});
      t0 = t1;
    }
  }
}

// Longest first: threads take items in this order, so the last ones taken are the
// shortest and the threads finish close together.
void order_longest_first(std::vector<Item>& items) {
  std::stable_sort(items.begin(), items.end(),
                   [](const Item& a, const Item& b) { return a.t1 - a.t0 > b.t1 - b.t0; });
}

template <typename scalar_t>
void load_query(const Shape& s, const Inputs<scalar_t>& in, int64_t seq, float* q) {
  for (int64_t h = 0; h < s.num_heads; ++h) {  // pre-scaled: one multiply per head, not per score
    const scalar_t* src = in.query + seq * s.q_stride_seq + h * s.q_stride_head;
    for (int64_t i = 0; i < s.head_dim; ++i) q[h * s.head_dim + i] = static_cast<float>(src[i]) * in.scale;
  }
}

template <typename scalar_t>
void write_out(const Shape& s, const Inputs<scalar_t>& in, int64_t seq, const float* l, const float* acc) {
  for (int64_t h = 0; h < s.num_heads; ++h) {
    scalar_t* o = in.out + seq * s.out_stride_seq + h * s.out_stride_head;
    const float inv = 1.f / l[h];
    for (int64_t i = 0; i < s.head_dim; ++i) o[i] = static_cast<scalar_t>(acc[h * s.head_dim + i] * inv);
  }
}

// out = sum_c acc_c exp(m_c - M) / sum_c l_c exp(m_c - M), M = max_c m_c, per head; chunks
// in order, so the sum does not depend on the thread that ran each.
template <typename scalar_t>
void merge_split(const Shape& s, const Inputs<scalar_t>& in, const Split& sp, const float* partials, Scratch& w) {
  const int64_t heads = s.num_heads, d = s.head_dim;
  std::fill(w.m.begin(), w.m.end(), kNegInf);
  std::fill(w.l.begin(), w.l.end(), 0.f);
  std::fill(w.acc.begin(), w.acc.end(), 0.f);
  for (int64_t c = 0; c < sp.count; ++c) {
    const float* p = partials + (sp.first_slot + c) * partial_size(s);
    for (int64_t h = 0; h < heads; ++h) w.m[h] = std::max(w.m[h], p[h]);
  }
  for (int64_t c = 0; c < sp.count; ++c) {
    const float* p = partials + (sp.first_slot + c) * partial_size(s);
    for (int64_t h = 0; h < heads; ++h) {
      const float weight = std::exp(p[h] - w.m[h]);
      w.l[h] += p[heads + h] * weight;
      const float* acc = p + 2 * heads + h * d;
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) w.acc[h * d + i] += acc[i] * weight;
    }
  }
  write_out(s, in, sp.seq, w.l.data(), w.acc.data());
}

// Runs one item. A split's last chunk to finish (whichever thread ran it) merges the
// split's partials: no second parallel region, whose barrier costs most on a busy machine.
template <typename scalar_t>
void run_item(const Shape& s, const Inputs<scalar_t>& in, const Item& it, const std::vector<Split>& splits,
              float* partials, std::atomic<int64_t>* remaining, Scratch& w) {
  load_query(s, in, it.seq, w.q.data());
  std::fill(w.m.begin(), w.m.end(), kNegInf);
  std::fill(w.l.begin(), w.l.end(), 0.f);
  std::fill(w.acc.begin(), w.acc.end(), 0.f);
  attend_keys(s, in, it.seq, it.t0, it.t1, w);
  if (it.split < 0) {
    write_out(s, in, it.seq, w.l.data(), w.acc.data());
    return;
  }
  float* p = partials + it.slot * partial_size(s);
  std::copy(w.m.begin(), w.m.end(), p);
  std::copy(w.l.begin(), w.l.end(), p + s.num_heads);
  std::copy(w.acc.begin(), w.acc.end(), p + 2 * s.num_heads);
  // acq_rel: the last one sees the other chunks' partials, released by their decrements
  if (remaining[it.split].fetch_sub(1, std::memory_order_acq_rel) == 1)
    merge_split(s, in, splits[it.split], partials, w);
}

template <typename scalar_t>
void decode(const Shape& s, const Inputs<scalar_t>& in) {
  std::vector<Item> items;
  std::vector<Split> splits;
  plan_items(s, in.lens, in.window, items, splits);
  const int64_t num_slots = splits.empty() ? 0 : splits.back().first_slot + splits.back().count;
  std::vector<float> partials(num_slots * partial_size(s));
  std::unique_ptr<std::atomic<int64_t>[]> remaining(new std::atomic<int64_t>[splits.size()]);
  for (size_t i = 0; i < splits.size(); ++i) remaining[i].store(splits[i].count, std::memory_order_relaxed);
  order_longest_first(items);
  // Threads take the next item as they finish one, rather than a fixed share each: a thread
  // the OS pauses (other processes on the cores) then delays the call by one item, not by
  // its whole share.
  std::atomic<int64_t> next{0};
  const int64_t num_items = static_cast<int64_t>(items.size());
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), num_items));
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    Scratch scratch(s);
    for (int64_t i = next.fetch_add(1, std::memory_order_relaxed); i < num_items;
         i = next.fetch_add(1, std::memory_order_relaxed))
      run_item(s, in, items[i], splits, partials.data(), remaining.get(), scratch);
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
void check_tables(const Shape& s, const int32_t* tables, const int32_t* lens, int64_t num_blocks) {
  for (int64_t seq = 0; seq < s.num_seqs; ++seq) {
    const int64_t len = lens[seq];
    TORCH_CHECK(len >= 1 && len <= s.max_blocks * s.block_size, "seq_lens: sequence ", seq, " has length ",
                len, "; expected 1..", s.max_blocks * s.block_size, " (max_blocks * block_size)");
    for (int64_t b = 0; b < (len + s.block_size - 1) / s.block_size; ++b) {
      const int64_t id = tables[seq * s.table_stride + b];
      TORCH_CHECK(id >= 0 && id < num_blocks, "block_tables: sequence ", seq, " block ", b, " is ", id,
                  "; the cache has ", num_blocks, " blocks");
    }
  }
}

template <typename scalar_t>
void run(const Shape& s, at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
         const at::Tensor& value_cache, const int32_t* tables, const int32_t* lens, double scale, int64_t window,
         double softcap) {
  const Inputs<scalar_t> in{out.data_ptr<scalar_t>(), query.const_data_ptr<scalar_t>(),
                            key_cache.const_data_ptr<scalar_t>(), value_cache.const_data_ptr<scalar_t>(),
                            tables, lens, static_cast<float>(scale), static_cast<float>(softcap), window};
  decode<scalar_t>(s, in);
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
  check_tables(s, tables, lens, key_cache.size(0));
  if (s.num_seqs == 0) return out;
  // the dtypes check_inputs admits (not double, which AT_DISPATCH_FLOATING_TYPES would add)
  AT_DISPATCH_SWITCH(query.scalar_type(), "paged_decode_attention",
                     AT_DISPATCH_CASE(at::kFloat, [&] { run<scalar_t>(s, out, query, key_cache, value_cache,
                                                                      tables, lens, scale, window, softcap); })
                     AT_DISPATCH_CASE(at::kBFloat16, [&] { run<scalar_t>(s, out, query, key_cache, value_cache,
                                                                         tables, lens, scale, window, softcap); })
                     AT_DISPATCH_CASE(at::kHalf, [&] { run<scalar_t>(s, out, query, key_cache, value_cache,
                                                                     tables, lens, scale, window, softcap); }));
  return out;
}

}  // namespace

TORCH_LIBRARY(pdserve, m) {
  m.def(
      "paged_decode_attention(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, "
      "Tensor block_tables, Tensor seq_lens, float scale, int window=0, float softcap=0.0) -> Tensor(a!)");
}

TORCH_LIBRARY_IMPL(pdserve, CPU, m) { m.impl("paged_decode_attention", &paged_decode_attention); }
