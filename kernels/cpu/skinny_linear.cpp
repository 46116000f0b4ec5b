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
// The row loop itself is skinny_rows.h's.
#include "skinny_rows.h"

#include <cstring>

namespace {

using namespace skinny;

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

}  // namespace

TORCH_LIBRARY_FRAGMENT(pdserve, m) {
  m.def("skinny_linear(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor");
  m.def("skinny_linear_fp8(Tensor x, Tensor weight, Tensor scale, int block_columns, Tensor? bias=None) -> Tensor");
  m.def("dequantize_fp8(Tensor(a!) out, Tensor weight, Tensor scale, int block_columns) -> ()");
}

TORCH_LIBRARY_IMPL(pdserve, CPU, m) {
  m.impl("skinny_linear", &skinny_linear);
  m.impl("skinny_linear_fp8", &skinny_linear_fp8);
  m.impl("dequantize_fp8", &dequantize_fp8);
}
