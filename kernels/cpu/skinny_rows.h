// The row loop the skinny linear kernels share (skinny_linear.cpp: float32 and fp8 weights;
// gguf_linear.cpp: GGUF blocks): y = x W^T for a few rows of x, W read through a weight
// policy that yields its float32 values 16 columns (load) or one 32-column block (load_block)
// at a time, 4 weight rows streamed together and each prefetched ahead into L2.
//
// A policy provides kLoadsBlocks, prefetch(n, k), and with AVX-512 load(n, k) and
// load_tail(n, k, mask); without AVX-512, chunk(n, k, width, buf), which returns columns
// k..k+width of row n as float32. A policy that loads blocks (kLoadsBlocks) also provides
// kColumns (a block's columns), a Header type, read_header(n, k, header) (what a row's block
// at k holds for all its columns: read once per block and row) and load_block(n, k, header,
// lo, hi) for the 32 columns at k.
#pragma once

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

namespace skinny {

constexpr int64_t kMaxRows = 4;           // kernels/cpu/__init__.py: SKINNY_MAX_ROWS; beyond, oneDNN is as fast
constexpr int64_t kRowsPerBlock = 4;      // weight rows streamed together
constexpr int64_t kPrefetchBytes = 8192;  // how far ahead of each weight row's read

inline void prefetch_l2(const void* p) { __builtin_prefetch(p, 0, 2); }  // read, prefetcht1

#if defined(__AVX512F__)
// rows_block for weights read a 32-column block at a time (GGUF): the same sums in the same
// order (each lane adds columns k, k + 16, k + 32, ... in turn), so the same bits.
template <int M, int R, class Weight>
void rows_block_of_blocks(const float* x, const Weight& weight, int64_t k_len, int64_t n, int64_t n_out, float* y) {
  __m512 acc[M][R];
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = _mm512_setzero_ps();
  typename Weight::Header header[R];
  for (int64_t k = 0; k < k_len; k += 32) {
    __m512 lo[R], hi[R];
    for (int r = 0; r < R; ++r) {
      weight.prefetch(n + r, k);
      if (k % Weight::kColumns == 0) weight.read_header(n + r, k, header[r]);
      weight.load_block(n + r, k, header[r], lo[r], hi[r]);
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

inline void check_x(const char* op, const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu(), op, ": CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kFloat, op, ": x must be float32, got ", x.scalar_type());
  TORCH_CHECK(x.dim() == 2 && x.size(0) <= kMaxRows, op, ": x must be [0..", kMaxRows, ", in_features], got ",
              x.sizes());
}

// The float32 weight a quantized one stands for, row by row, written into out [n_out, k_len].
template <class Weight>
void dequantize_rows(const Weight& w, int64_t n_out, int64_t k_len, float* out) {
  at::parallel_for(0, n_out, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      float* row = out + n * k_len;
      int64_t k = 0;
#if defined(__AVX512F__)
      if constexpr (Weight::kLoadsBlocks) {  // whole blocks (checked)
        typename Weight::Header header;
        for (; k < k_len; k += 32) {
          __m512 lo, hi;
          if (k % Weight::kColumns == 0) w.read_header(n, k, header);
          w.load_block(n, k, header, lo, hi);
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

inline void check_out(const char* op, const at::Tensor& out, int64_t n_out, int64_t k_len) {
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.dim() == 2 && out.size(0) == n_out &&
                  out.size(1) == k_len,
              op, ": out must be a contiguous float32 [", n_out, ", ", k_len, "], got ", out.scalar_type(), " ",
              out.sizes());
}

}  // namespace skinny
