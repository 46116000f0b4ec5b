// y = x W^T (+ b) for a few rows of x (decode batches of 1-4 sequences), float32, reading the
// plain [out, in] weight once, front to back.
//
// With so few rows a linear layer is a read of its weight: 2 x rows FLOPs per 4 bytes.
// oneDNN's packed GEMM read SmolLM2's weights at 8-13 GB/s on one Zen 4 core, where a plain
// sum over memory reads 22 GB/s. What it lacks is distance: the hardware prefetcher runs a
// few lines ahead of each of the streams. So here each of the 4 weight rows in flight is
// prefetched 8 KiB ahead into L2 (prefetcht1: L2 tracks more misses than L1, see
// paged_attention.cpp's prefetch), and the rows reach 18-20 GB/s on one core, 25-33 GB/s on two.
//
//   per block of 4 output rows n..n+3, per 16 columns k:  acc[m][r] += x[m, k:k+16] * W[n+r, k:k+16]
//   y[m, n+r] = sum of acc[m][r]'s 16 lanes (+ b[n+r])
//
// The sum runs in 16 partial sums per output (then added in a fixed tree), a different order
// from oneDNN's or MKL's: float32 results differ from theirs in the last bits, as theirs do
// from each other's. The result depends neither on the thread count nor on the other rows.
//
// skinny_linear_fp8 runs the same loop over an fp8 (e4m3fn) weight, one byte a weight, with a
// float32 scale per output row and column block (engine/model/fp8_linear.py): each 16 bytes
// are widened and scaled in registers into the float32 weight torch would dequantize, so a
// decode step reads a quarter of the float32 weight's bytes.
//
// skinny_linear_gguf reads a weight kept in llama.cpp's GGUF blocks (Q4_0, Q4_1, Q8_0:
// engine/model/gguf_linear.py), each row its blocks of 32 columns as the file stores them:
// an fp16 scale d (Q4_1: and an fp16 offset m) then the 32 quants. Each 16 columns are
// widened and scaled in registers into the float32 weight gguf-py's dequantizer gives
// (Q4_0 d * (q - 8), Q4_1 d * q + m, Q8_0 q * d, each product and sum rounded once), so the
// result is skinny_linear's over that weight, bit for bit, reading 4.5-8.5 bits a weight.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace {

constexpr int64_t kMaxRows = 4;           // kernels/cpu/__init__.py: SKINNY_MAX_ROWS; beyond, oneDNN is as fast
constexpr int64_t kRowsPerBlock = 4;      // weight rows streamed together
constexpr int64_t kPrefetchBytes = 8192;  // how far ahead of each weight row's read

inline void prefetch_l2(const void* p) { __builtin_prefetch(p, 0, 2); }  // read, prefetcht1

// The weights a block reads, 16 columns at a time, as float32: the plain float32 weight, or
// an fp8 (e4m3fn) one with its float32 scales (skinny_linear_fp8 below).
struct Float32Weight {
  static constexpr bool kLoadsBlocks = false;  // read 16 columns a call (load), not 32 (load_block)
  const float* w;
  int64_t k_len;
  const float* row(int64_t n) const { return w + n * k_len; }
  void prefetch(int64_t n, int64_t k) const { prefetch_l2(row(n) + k + kPrefetchBytes / sizeof(float)); }
#if defined(__AVX512F__)
  __m512 load(int64_t n, int64_t k) const { return _mm512_loadu_ps(row(n) + k); }
  __m512 load_tail(int64_t n, int64_t k, __mmask16 mask) const { return _mm512_maskz_loadu_ps(mask, row(n) + k); }
#else
  const float* chunk(int64_t n, int64_t k, int64_t, float*) const { return row(n) + k; }
#endif
};

// An e4m3fn byte as float32, exactly: its 7 magnitude bits moved to float32's exponent and
// mantissa places (exponent bias 7, not 127) then multiplied by 2^120 to rebias, which also
// turns e4m3's subnormals into the right normal float32; then the sign. (e4m3fn's NaN, 0x7f,
// reads as 480: weights hold none.) The dequantized weight is that times its block's scale,
// rounded once, as torch computes `w.to(float32) * scale`: the same float32 weight, so the
// result equals skinny_linear over the dequantized weight bit for bit.
inline float fp8_e4m3_to_float(uint8_t b) {
  const uint32_t mag = static_cast<uint32_t>(b & 0x7F) << 20, sign = static_cast<uint32_t>(b & 0x80) << 24;
  float f;
  std::memcpy(&f, &mag, sizeof f);
  f *= 0x1p120f;
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  bits |= sign;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

struct Fp8Weight {
  static constexpr bool kLoadsBlocks = false;
  const uint8_t* w;
  const float* scale;     // [n_out, num_blocks]
  int64_t k_len, num_blocks, block_columns;
  const uint8_t* row(int64_t n) const { return w + n * k_len; }
  float scale_of(int64_t n, int64_t k) const { return scale[n * num_blocks + k / block_columns]; }
  void prefetch(int64_t n, int64_t k) const { prefetch_l2(row(n) + k + kPrefetchBytes); }
#if defined(__AVX512F__)
  static __m512 dequantize(__m128i bytes, float s) {
    const __m512i v = _mm512_cvtepu8_epi32(bytes);
    const __m512i mag = _mm512_slli_epi32(_mm512_and_si512(v, _mm512_set1_epi32(0x7F)), 20);
    const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(v, _mm512_set1_epi32(0x80)), 24);
    const __m512 f = _mm512_mul_ps(_mm512_castsi512_ps(mag), _mm512_set1_ps(0x1p120f));
    return _mm512_mul_ps(_mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(f), sign)), _mm512_set1_ps(s));
  }
  __m512 load(int64_t n, int64_t k) const {
    return dequantize(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row(n) + k)), scale_of(n, k));
  }
  __m512 load_tail(int64_t n, int64_t k, __mmask16) const {
    alignas(16) uint8_t tail[16] = {};
    std::memcpy(tail, row(n) + k, static_cast<size_t>(k_len - k));
    return dequantize(_mm_load_si128(reinterpret_cast<const __m128i*>(tail)), scale_of(n, k));
  }
#else
  const float* chunk(int64_t n, int64_t k, int64_t width, float* buf) const {
    const float s = scale_of(n, k);
    for (int64_t i = 0; i < width; ++i) buf[i] = fp8_e4m3_to_float(row(n)[k + i]) * s;
    return buf;
  }
#endif
};

// llama.cpp's block formats, by their ggml type ids (gguf.GGMLQuantizationType).
enum GgufType : int64_t { kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8 };
constexpr int64_t kGgufBlock = 32;  // columns a block holds

inline float fp16_to_float(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, sizeof bits);
#if defined(__F16C__)
  return _cvtsh_ss(bits);
#else
  return c10::detail::fp16_ieee_to_fp32_value(bits);
#endif
}

// Hides a value from the optimizer so that `opaque(a * b) + c` stays a rounded product and
// a rounded sum: with -march=native GCC would otherwise contract them into one fma, whose
// single rounding differs from gguf-py's numpy in the last bit.
template <class V>
inline V opaque(V v) {
#if defined(__x86_64__)
  asm("" : "+v"(v));
#else
  volatile V kept = v;
  v = kept;
#endif
  return v;
}

// A weight of GGUF blocks, [out, in / 32 blocks of kBytes]. The 4-bit formats hold column
// j of a block in the low nibble of byte j (j < 16) and column j + 16 in its high nibble.
// Rows are whole blocks (checked), so every read is a whole 16-column half of a block.
template <GgufType T>
struct GgufWeight {
  static constexpr int64_t kBytes = T == kQ4_0 ? 18 : T == kQ4_1 ? 20 : 34;
  static constexpr int64_t kQuants = T == kQ4_1 ? 4 : 2;  // the quants' offset in a block
#if defined(__AVX512F__)
  static constexpr bool kLoadsBlocks = true;
#endif
  const uint8_t* w;
  int64_t row_bytes;
  const uint8_t* block(int64_t n, int64_t k) const { return w + n * row_bytes + k / kGgufBlock * kBytes; }
  // one prefetch per 64 columns: per 16 they would mostly name a line already asked for
  void prefetch(int64_t n, int64_t k) const {
    if (k % 64 == 0) prefetch_l2(block(n, k) + kPrefetchBytes);
  }
#if defined(__AVX512F__)
  __m512 load(int64_t n, int64_t k) const {
    const uint8_t* b = block(n, k);
    const __m512 d = _mm512_set1_ps(fp16_to_float(b));
    if constexpr (T == kQ8_0) {
      const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + kQuants + k % kGgufBlock));
      return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)), d);
    } else {
      __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + kQuants));
      if (k % kGgufBlock) q = _mm_srli_epi16(q, 4);
      const __m512i qi = _mm512_cvtepu8_epi32(_mm_and_si128(q, _mm_set1_epi8(0x0F)));
      if constexpr (T == kQ4_0) {
        return _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_sub_epi32(qi, _mm512_set1_epi32(8))));
      } else {
        return _mm512_add_ps(opaque(_mm512_mul_ps(d, _mm512_cvtepi32_ps(qi))), _mm512_set1_ps(fp16_to_float(b + 2)));
      }
    }
  }
  __m512 load_tail(int64_t n, int64_t k, __mmask16) const { return load(n, k); }
  // The block at column k (a multiple of 32) as two float32 vectors, columns k..k+15 and
  // k+16..k+31. A 4-bit block builds its 16 possible weights once (d * i + m, or d * (i - 8),
  // rounded as gguf-py rounds each weight) and looks each quant up in them (vpermps reads an
  // index's low 4 bits, so the low nibble needs no mask): about half the work of widening,
  // converting and scaling every quant, and the same float32 weights.
  void load_block(int64_t n, int64_t k, __m512& lo, __m512& hi) const {
    const uint8_t* b = block(n, k);
    const __m512 d = _mm512_set1_ps(fp16_to_float(b));
    if constexpr (T == kQ8_0) {
      const __m128i* q = reinterpret_cast<const __m128i*>(b + kQuants);
      lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q))), d);
      hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q + 1))), d);
    } else {
      __m512 table;
      if constexpr (T == kQ4_0) {
        table = _mm512_mul_ps(d, _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7));
      } else {
        const __m512 scaled = _mm512_mul_ps(d, _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
        table = _mm512_add_ps(opaque(scaled), _mm512_set1_ps(fp16_to_float(b + 2)));
      }
      const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + kQuants)));
      lo = _mm512_permutexvar_ps(q, table);
      hi = _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), table);
    }
  }
#else
  const float* chunk(int64_t n, int64_t k, int64_t, float* buf) const {
    const uint8_t* b = block(n, k);
    const float d = fp16_to_float(b);
    const int64_t first = k % kGgufBlock;
#if defined(__AVX2__)
    __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + kQuants + (T == kQ8_0 ? first : 0)));
    __m256i lo, hi;  // columns 0-7 and 8-15 of this half, as int32
    if constexpr (T == kQ8_0) {
      lo = _mm256_cvtepi8_epi32(q);
      hi = _mm256_cvtepi8_epi32(_mm_srli_si128(q, 8));
    } else {
      if (first) q = _mm_srli_epi16(q, 4);
      q = _mm_and_si128(q, _mm_set1_epi8(0x0F));
      lo = _mm256_cvtepu8_epi32(q);
      hi = _mm256_cvtepu8_epi32(_mm_srli_si128(q, 8));
      if constexpr (T == kQ4_0) {
        lo = _mm256_sub_epi32(lo, _mm256_set1_epi32(8));
        hi = _mm256_sub_epi32(hi, _mm256_set1_epi32(8));
      }
    }
    const __m256 dv = _mm256_set1_ps(d);
    __m256 flo = _mm256_mul_ps(_mm256_cvtepi32_ps(lo), dv), fhi = _mm256_mul_ps(_mm256_cvtepi32_ps(hi), dv);
    if constexpr (T == kQ4_1) {
      const __m256 m = _mm256_set1_ps(fp16_to_float(b + 2));
      flo = _mm256_add_ps(opaque(flo), m);
      fhi = _mm256_add_ps(opaque(fhi), m);
    }
    _mm256_storeu_ps(buf, flo);
    _mm256_storeu_ps(buf + 8, fhi);
#else
    for (int64_t i = 0; i < 16; ++i) {
      const int64_t j = first + i;
      if constexpr (T == kQ8_0) {
        buf[i] = static_cast<float>(static_cast<int8_t>(b[kQuants + j])) * d;
      } else {
        const uint8_t byte = b[kQuants + j % 16];
        const int q = j < 16 ? byte & 0x0F : byte >> 4;
        buf[i] = T == kQ4_0 ? d * static_cast<float>(q - 8) : opaque(d * static_cast<float>(q)) + fp16_to_float(b + 2);
      }
    }
#endif
    return buf;
  }
#endif
};

#if defined(__AVX512F__)
// rows_block for weights read a 32-column block at a time (GGUF): the same sums in the same
// order (each lane adds columns k, k + 16, k + 32, ... in turn), so the same bits.
template <int M, int R, class Weight>
void rows_block_of_blocks(const float* x, const Weight& weight, int64_t k_len, int64_t n, int64_t n_out, float* y) {
  __m512 acc[M][R];
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < k_len; k += 32) {
    __m512 lo[R], hi[R];
    for (int r = 0; r < R; ++r) {
      weight.prefetch(n + r, k);
      weight.load_block(n + r, k, lo[r], hi[r]);
    }
    for (int m = 0; m < M; ++m) {
      const __m512 xlo = _mm512_loadu_ps(x + m * k_len + k), xhi = _mm512_loadu_ps(x + m * k_len + k + 16);
      for (int r = 0; r < R; ++r) acc[m][r] = _mm512_fmadd_ps(xhi, hi[r], _mm512_fmadd_ps(xlo, lo[r], acc[m][r]));
    }
  }
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) y[m * n_out + n + r] = _mm512_reduce_add_ps(acc[m][r]);
}

template <int M, int R, class Weight>
void rows_block(const float* x, const Weight& weight, int64_t k_len, int64_t n, int64_t n_out, float* y) {
  if constexpr (Weight::kLoadsBlocks) {
    rows_block_of_blocks<M, R>(x, weight, k_len, n, n_out, y);
    return;
  }
  __m512 acc[M][R];
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= k_len; k += 16) {
    __m512 wv[R];
    for (int r = 0; r < R; ++r) {
      weight.prefetch(n + r, k);
      wv[r] = weight.load(n + r, k);
    }
    for (int m = 0; m < M; ++m) {
      const __m512 xv = _mm512_loadu_ps(x + m * k_len + k);
      for (int r = 0; r < R; ++r) acc[m][r] = _mm512_fmadd_ps(xv, wv[r], acc[m][r]);
    }
  }
  if (k < k_len) {  // the last k_len % 16 columns, masked
    const __mmask16 mask = static_cast<__mmask16>((1u << (k_len - k)) - 1);
    for (int m = 0; m < M; ++m) {
      const __m512 xv = _mm512_maskz_loadu_ps(mask, x + m * k_len + k);
      for (int r = 0; r < R; ++r) acc[m][r] = _mm512_fmadd_ps(xv, weight.load_tail(n + r, k, mask), acc[m][r]);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) y[m * n_out + n + r] = _mm512_reduce_add_ps(acc[m][r]);
}
#else
// Without AVX-512: the same order of operations in plain loops (16 partial sums), which the
// compiler vectorizes for the machine it builds on (-march=native: AVX2 FMAs as two halves).
template <int M, int R, class Weight>
void rows_block(const float* x, const Weight& weight, int64_t k_len, int64_t n, int64_t n_out, float* y) {
  float acc[M][R][16] = {};
  float bufs[R][16];
  for (int64_t k = 0; k < k_len; k += 16) {
    const int64_t width = std::min<int64_t>(16, k_len - k);
    const float* wr[R];
    for (int r = 0; r < R; ++r) {
      weight.prefetch(n + r, k);
      wr[r] = weight.chunk(n + r, k, width, bufs[r]);
    }
    for (int m = 0; m < M; ++m)
      for (int r = 0; r < R; ++r)
#pragma omp simd
        for (int64_t i = 0; i < width; ++i) acc[m][r][i] += x[m * k_len + k + i] * wr[r][i];
  }
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) {
      float* a = acc[m][r];  // the AVX-512 path's lane tree: halves added until one is left
      for (int half = 8; half >= 1; half /= 2)
        for (int i = 0; i < half; ++i) a[i] += a[i + half];
      y[m * n_out + n + r] = a[0];
    }
}
#endif

template <int M, class Weight>
void rows_range(const float* x, const Weight& weight, int64_t k_len, int64_t n0, int64_t n1, int64_t n_out,
                float* y) {
  int64_t n = n0;
  for (; n + kRowsPerBlock <= n1; n += kRowsPerBlock) rows_block<M, kRowsPerBlock>(x, weight, k_len, n, n_out, y);
  for (; n < n1; ++n) rows_block<M, 1>(x, weight, k_len, n, n_out, y);
}

// y = x W^T for `rows` rows, W read through `weight`; then + bias.
template <class Weight>
at::Tensor run_rows(const char* op, const at::Tensor& x, const Weight& weight, int64_t n_out,
                    const c10::optional<at::Tensor>& bias) {
  const int64_t rows = x.size(0), k_len = x.size(1);
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({rows, n_out}, x.options());
  const float* xp = xc.const_data_ptr<float>();
  float* yp = y.data_ptr<float>();
  if (rows == 0) return y;  // an empty batch (a step with nothing to sample)
  // Blocks of 4 output rows; a thread's share is a contiguous run of the weight, one stream.
  const int64_t blocks = (n_out + kRowsPerBlock - 1) / kRowsPerBlock;
  at::parallel_for(0, blocks, 16, [&](int64_t b0, int64_t b1) {
    const int64_t n0 = b0 * kRowsPerBlock, n1 = std::min(n_out, b1 * kRowsPerBlock);
    switch (rows) {
      case 1: rows_range<1>(xp, weight, k_len, n0, n1, n_out, yp); break;
      case 2: rows_range<2>(xp, weight, k_len, n0, n1, n_out, yp); break;
      case 3: rows_range<3>(xp, weight, k_len, n0, n1, n_out, yp); break;
      default: rows_range<4>(xp, weight, k_len, n0, n1, n_out, yp); break;
    }
  });
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n_out && bias->scalar_type() == at::kFloat,
                op, ": bias must be float32 [", n_out, "], got ", bias->sizes());
    y.add_(*bias);
  }
  return y;
}

void check_x(const char* op, const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu(), op, ": CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kFloat, op, ": x must be float32, got ", x.scalar_type());
  TORCH_CHECK(x.dim() == 2 && x.size(0) <= kMaxRows, op, ": x must be [0..", kMaxRows, ", in_features], got ",
              x.sizes());
}

at::Tensor skinny_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  check_x("skinny_linear", x);
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == at::kFloat,
              "skinny_linear: float32 only, got weight ", weight.scalar_type());
  TORCH_CHECK(weight.dim() == 2 && weight.size(1) == x.size(1) && weight.is_contiguous(),
              "skinny_linear: weight must be a contiguous [out_features, ", x.size(1), "], got ", weight.sizes());
  return run_rows("skinny_linear", x, Float32Weight{weight.const_data_ptr<float>(), x.size(1)}, weight.size(0), bias);
}

// The fp8 weight as engine/model/fp8_linear.py holds it: its bytes (uint8 [out, in]) and a
// float32 scale per output row and block of `block_columns` columns ([out, ceil(in / block)]).
at::Tensor skinny_linear_fp8(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale,
                             int64_t block_columns, const c10::optional<at::Tensor>& bias) {
  check_x("skinny_linear_fp8", x);
  const int64_t k_len = x.size(1);
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == at::kByte && weight.dim() == 2 &&
                  weight.size(1) == k_len && weight.is_contiguous(),
              "skinny_linear_fp8: weight must be the contiguous uint8 bytes [out_features, ", k_len,
              "] of an e4m3fn weight, got ", weight.scalar_type(), " ", weight.sizes());
  TORCH_CHECK(block_columns >= 1 && (block_columns % 16 == 0 || block_columns >= k_len),
              "skinny_linear_fp8: block_columns must be a multiple of 16 or cover the row, got ", block_columns);
  const int64_t num_blocks = (k_len + block_columns - 1) / block_columns;
  TORCH_CHECK(scale.device().is_cpu() && scale.scalar_type() == at::kFloat && scale.is_contiguous() &&
                  scale.dim() == 2 && scale.size(0) == weight.size(0) && scale.size(1) == num_blocks,
              "skinny_linear_fp8: scale must be a contiguous float32 [", weight.size(0), ", ", num_blocks, "], got ",
              scale.scalar_type(), " ", scale.sizes());
  const Fp8Weight w{weight.const_data_ptr<uint8_t>(), scale.const_data_ptr<float>(), k_len, num_blocks, block_columns};
  return run_rows("skinny_linear_fp8", x, w, weight.size(0), bias);
}

// The float32 weight a quantized one stands for, row by row, written into out [n_out, k_len].
template <class Weight>
void dequantize_rows(const Weight& w, int64_t n_out, int64_t k_len, float* out) {
  at::parallel_for(0, n_out, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      float* row = out + n * k_len;
      int64_t k = 0;
#if defined(__AVX512F__)
      if constexpr (Weight::kLoadsBlocks) {  // whole 32-column blocks (checked)
        for (; k < k_len; k += 32) {
          __m512 lo, hi;
          w.load_block(n, k, lo, hi);
          _mm512_storeu_ps(row + k, lo);
          _mm512_storeu_ps(row + k + 16, hi);
        }
      }
      for (; k + 16 <= k_len; k += 16) _mm512_storeu_ps(row + k, w.load(n, k));
      if (k < k_len) {
        const __mmask16 mask = static_cast<__mmask16>((1u << (k_len - k)) - 1);
        _mm512_mask_storeu_ps(row + k, mask, w.load_tail(n, k, mask));
      }
#else
      for (; k < k_len; k += 16) {
        const int64_t width = std::min<int64_t>(16, k_len - k);
        const float* chunk = w.chunk(n, k, width, row + k);
        if (chunk != row + k) std::memcpy(row + k, chunk, static_cast<size_t>(width) * sizeof(float));
      }
#endif
    }
  });
}

void check_out(const char* op, const at::Tensor& out, int64_t n_out, int64_t k_len) {
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.dim() == 2 && out.size(0) == n_out &&
                  out.size(1) == k_len,
              op, ": out must be a contiguous float32 [", n_out, ", ", k_len, "], got ", out.scalar_type(), " ",
              out.sizes());
}

// The float32 weight an fp8 weight stands for, W8 x scale, written into `out` [out, in]: the
// bits torch's `w.to(float32) * scale` gives, about 20x faster than those torch ops on a
// 2-core Zen 4 (a 3072 x 576 weight: 0.2 ms against 3.9). For batches beyond skinny_linear_fp8's
// rows the layer multiplies by this with a float32 GEMM.
void dequantize_fp8(at::Tensor& out, const at::Tensor& weight, const at::Tensor& scale, int64_t block_columns) {
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == at::kByte && weight.dim() == 2 &&
                  weight.is_contiguous(),
              "dequantize_fp8: weight must be the contiguous uint8 bytes of an e4m3fn weight, got ",
              weight.scalar_type(), " ", weight.sizes());
  const int64_t n_out = weight.size(0), k_len = weight.size(1);
  TORCH_CHECK(block_columns >= 1 && (block_columns % 16 == 0 || block_columns >= k_len),
              "dequantize_fp8: block_columns must be a multiple of 16 or cover the row, got ", block_columns);
  const int64_t num_blocks = (k_len + block_columns - 1) / block_columns;
  TORCH_CHECK(scale.device().is_cpu() && scale.scalar_type() == at::kFloat && scale.is_contiguous() &&
                  scale.dim() == 2 && scale.size(0) == n_out && scale.size(1) == num_blocks,
              "dequantize_fp8: scale must be a contiguous float32 [", n_out, ", ", num_blocks, "], got ",
              scale.scalar_type(), " ", scale.sizes());
  check_out("dequantize_fp8", out, n_out, k_len);
  const Fp8Weight w{weight.const_data_ptr<uint8_t>(), scale.const_data_ptr<float>(), k_len, num_blocks, block_columns};
  dequantize_rows(w, n_out, k_len, out.data_ptr<float>());
}

// A GGUF weight's columns (in_features) from its bytes per row; checks the type and layout.
int64_t gguf_columns(const char* op, const at::Tensor& weight, int64_t ggml_type) {
  int64_t block_bytes = 0;
  switch (ggml_type) {
    case kQ4_0: block_bytes = GgufWeight<kQ4_0>::kBytes; break;
    case kQ4_1: block_bytes = GgufWeight<kQ4_1>::kBytes; break;
    case kQ8_0: block_bytes = GgufWeight<kQ8_0>::kBytes; break;
    default: TORCH_CHECK(false, op, ": ggml_type must be Q4_0 (2), Q4_1 (3) or Q8_0 (8), got ", ggml_type);
  }
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == at::kByte && weight.dim() == 2 &&
                  weight.is_contiguous() && weight.size(1) % block_bytes == 0,
              op, ": weight must be contiguous uint8 [out_features, blocks x ", block_bytes,
              " bytes] (whole blocks of ggml type ", ggml_type, "), got ", weight.scalar_type(), " ", weight.sizes());
  return weight.size(1) / block_bytes * kGgufBlock;
}

// Calls f with the GgufWeight of the given type over `weight`.
template <class F>
auto with_gguf_weight(const at::Tensor& weight, int64_t ggml_type, F&& f) {
  const uint8_t* w = weight.const_data_ptr<uint8_t>();
  const int64_t row_bytes = weight.size(1);
  switch (ggml_type) {
    case kQ4_0: return f(GgufWeight<kQ4_0>{w, row_bytes});
    case kQ4_1: return f(GgufWeight<kQ4_1>{w, row_bytes});
    default: return f(GgufWeight<kQ8_0>{w, row_bytes});
  }
}

// y = x W^T (+ b) for W in GGUF blocks of `ggml_type` (engine/model/gguf_linear.py's weight).
at::Tensor skinny_linear_gguf(const at::Tensor& x, const at::Tensor& weight, int64_t ggml_type,
                              const c10::optional<at::Tensor>& bias) {
  check_x("skinny_linear_gguf", x);
  const int64_t k_len = gguf_columns("skinny_linear_gguf", weight, ggml_type);
  TORCH_CHECK(k_len == x.size(1), "skinny_linear_gguf: the weight's rows hold ", k_len, " columns, x has ", x.size(1));
  return with_gguf_weight(weight, ggml_type, [&](const auto& w) {
    return run_rows("skinny_linear_gguf", x, w, weight.size(0), bias);
  });
}

// The float32 weight a GGUF one stands for, as gguf-py dequantizes it, into out [out, in]:
// for batches beyond skinny_linear_gguf's rows (a float32 GEMM over it) and embedding rows.
void dequantize_gguf(at::Tensor& out, const at::Tensor& weight, int64_t ggml_type) {
  const int64_t k_len = gguf_columns("dequantize_gguf", weight, ggml_type);
  check_out("dequantize_gguf", out, weight.size(0), k_len);
  with_gguf_weight(weight, ggml_type, [&](const auto& w) {
    dequantize_rows(w, weight.size(0), k_len, out.data_ptr<float>());
    return 0;
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pdserve, m) {
  m.def("skinny_linear(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor");
  m.def("skinny_linear_fp8(Tensor x, Tensor weight, Tensor scale, int block_columns, Tensor? bias=None) -> Tensor");
  m.def("dequantize_fp8(Tensor(a!) out, Tensor weight, Tensor scale, int block_columns) -> ()");
  m.def("skinny_linear_gguf(Tensor x, Tensor weight, int ggml_type, Tensor? bias=None) -> Tensor");
  m.def("dequantize_gguf(Tensor(a!) out, Tensor weight, int ggml_type) -> ()");
}

TORCH_LIBRARY_IMPL(pdserve, CPU, m) {
  m.impl("skinny_linear", &skinny_linear);
  m.impl("skinny_linear_fp8", &skinny_linear_fp8);
  m.impl("dequantize_fp8", &dequantize_fp8);
  m.impl("skinny_linear_gguf", &skinny_linear_gguf);
  m.impl("dequantize_gguf", &dequantize_gguf);
}
