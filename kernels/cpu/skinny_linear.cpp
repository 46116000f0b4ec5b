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
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>

namespace {

constexpr int64_t kMaxRows = 4;           // kernels/cpu/__init__.py: SKINNY_MAX_ROWS; beyond, oneDNN is as fast
constexpr int64_t kRowsPerBlock = 4;      // weight rows streamed together
constexpr int64_t kPrefetchBytes = 8192;  // how far ahead of each weight row's read

inline void prefetch_l2(const float* p) { __builtin_prefetch(p, 0, 2); }  // read, prefetcht1

#if defined(__AVX512F__)
template <int M, int R>
void rows_block(const float* x, const float* w, int64_t k_len, int64_t n, int64_t n_out, float* y) {
  __m512 acc[M][R];
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = _mm512_setzero_ps();
  const float* wr[R];
  for (int r = 0; r < R; ++r) wr[r] = w + (n + r) * k_len;
  constexpr int64_t ahead = kPrefetchBytes / sizeof(float);
  int64_t k = 0;
  for (; k + 16 <= k_len; k += 16) {
    __m512 wv[R];
    for (int r = 0; r < R; ++r) {
      prefetch_l2(wr[r] + k + ahead);
      wv[r] = _mm512_loadu_ps(wr[r] + k);
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
      for (int r = 0; r < R; ++r) acc[m][r] = _mm512_fmadd_ps(xv, _mm512_maskz_loadu_ps(mask, wr[r] + k), acc[m][r]);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) y[m * n_out + n + r] = _mm512_reduce_add_ps(acc[m][r]);
}
#else
// Without AVX-512: the same order of operations in plain loops (16 partial sums), which the
// compiler vectorizes for the machine it builds on (-march=native: AVX2 FMAs as two halves).
template <int M, int R>
void rows_block(const float* x, const float* w, int64_t k_len, int64_t n, int64_t n_out, float* y) {
  float acc[M][R][16] = {};
  const float* wr[R];
  for (int r = 0; r < R; ++r) wr[r] = w + (n + r) * k_len;
  constexpr int64_t ahead = kPrefetchBytes / sizeof(float);
  for (int64_t k = 0; k < k_len; k += 16) {
    const int64_t width = std::min<int64_t>(16, k_len - k);
    for (int r = 0; r < R; ++r) prefetch_l2(wr[r] + k + ahead);
    for (int m = 0; m < M; ++m)
      for (int r = 0; r < R; ++r)
#pragma omp simd
        for (int64_t i = 0; i < width; ++i) acc[m][r][i] += x[m * k_len + k + i] * wr[r][k + i];
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

template <int M>
void rows_range(const float* x, const float* w, int64_t k_len, int64_t n0, int64_t n1, int64_t n_out, float* y) {
  int64_t n = n0;
  for (; n + kRowsPerBlock <= n1; n += kRowsPerBlock) rows_block<M, kRowsPerBlock>(x, w, k_len, n, n_out, y);
  for (; n < n1; ++n) rows_block<M, 1>(x, w, k_len, n, n_out, y);
}

at::Tensor skinny_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "skinny_linear: CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat,
              "skinny_linear: float32 only, got x ", x.scalar_type(), " and weight ", weight.scalar_type());
  TORCH_CHECK(x.dim() == 2 && x.size(0) <= kMaxRows, "skinny_linear: x must be [0..", kMaxRows,
              ", in_features], got ", x.sizes());
  TORCH_CHECK(weight.dim() == 2 && weight.size(1) == x.size(1) && weight.is_contiguous(),
              "skinny_linear: weight must be a contiguous [out_features, ", x.size(1), "], got ", weight.sizes());
  const int64_t rows = x.size(0), k_len = x.size(1), n_out = weight.size(0);
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({rows, n_out}, x.options());
  const float* xp = xc.const_data_ptr<float>();
  const float* wp = weight.const_data_ptr<float>();
  float* yp = y.data_ptr<float>();
  if (rows == 0) return y;  // an empty batch (a step with nothing to sample)
  // Blocks of 4 output rows; a thread's share is a contiguous run of the weight, one stream.
  const int64_t blocks = (n_out + kRowsPerBlock - 1) / kRowsPerBlock;
  at::parallel_for(0, blocks, 16, [&](int64_t b0, int64_t b1) {
    const int64_t n0 = b0 * kRowsPerBlock, n1 = std::min(n_out, b1 * kRowsPerBlock);
    switch (rows) {
      case 1: rows_range<1>(xp, wp, k_len, n0, n1, n_out, yp); break;
      case 2: rows_range<2>(xp, wp, k_len, n0, n1, n_out, yp); break;
      case 3: rows_range<3>(xp, wp, k_len, n0, n1, n_out, yp); break;
      default: rows_range<4>(xp, wp, k_len, n0, n1, n_out, yp); break;
    }
  });
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n_out && bias->scalar_type() == at::kFloat,
                "skinny_linear: bias must be float32 [", n_out, "], got ", bias->sizes());
    y.add_(*bias);
  }
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pdserve, m) {
  m.def("skinny_linear(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(pdserve, CPU, m) { m.impl("skinny_linear", &skinny_linear); }
