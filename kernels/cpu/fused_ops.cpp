// The decoder's small per-token ops, each one call instead of the 5-12 torch ops of its
// reference (engine/model/decoder.py RMSNorm, engine/model/rope.py RotaryEmbedding): at a
// decode step the tensors are a few KB, so the torch versions cost their dispatch, not
// their arithmetic (~2.7 ms of a 47 ms SmolLM2 step at batch 32, 60 norms and 30 RoPEs).
//
//   rms_norm            out = norm(x)
//   fused_add_rms_norm  sum = x + h; out = norm(sum)             (vLLM's fused_add_rms_norm, not in place)
//   rotary_embedding    q, k rotated in place, rotate_half style, tables indexed by position
//
// Each rounds as its torch reference does, op by op: 16-bit dtypes compute every product and
// sum in float and round to the dtype where the reference's tensor op would (so a bf16 RoPE
// rounds x*cos, x*sin and their sum separately). Floating-point contraction is off in this
// file so a*b+c is never fused into one rounding. What differs from torch is the order of the
// norm's sum of squares (16 lanes, then across them), which moves its last bits as any two
// reduction orders do.
#pragma GCC optimize("fp-contract=off")

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>

namespace {

constexpr int64_t kLanes = 16;
constexpr int64_t kRowsPerTask = 16;  // decode batches below this run on one thread: no fork cost

template <typename T>
inline float rounded(float v) {
  return static_cast<float>(static_cast<T>(v));
}

template <typename T>
float inverse_rms(const T* x, int64_t d, float eps) {
  float acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= d; i += kLanes) {
    for (int64_t l = 0; l < kLanes; ++l) {
      const float v = static_cast<float>(x[i + l]);
      acc[l] += v * v;
    }
  }
  for (int64_t l = 0; i < d; ++i, ++l) {
    const float v = static_cast<float>(x[i]);
    acc[l] += v * v;
  }
  float sum = 0.f;
  for (int64_t l = 0; l < kLanes; ++l) sum += acc[l];
  return 1.f / std::sqrt(sum / static_cast<float>(d) + eps);
}

// reference: h = float(x) * r; offset: T(h * (1 + float(w))); else T(w * T(h))
template <typename T>
void normalize_row(T* out, const T* x, const T* w, int64_t d, float r, bool offset) {
  if (offset) {
    for (int64_t i = 0; i < d; ++i) {
      out[i] = static_cast<T>(static_cast<float>(x[i]) * r * (1.f + static_cast<float>(w[i])));
    }
  } else {
    for (int64_t i = 0; i < d; ++i) {
      out[i] = static_cast<T>(static_cast<float>(w[i]) * rounded<T>(static_cast<float>(x[i]) * r));
    }
  }
}

void check_rows(const at::Tensor& t, const char* name, int64_t d) {
  TORCH_CHECK(t.dim() == 2 && t.size(1) == d && t.stride(1) == 1, name,
              ": expected rows [n, ", d, "] with contiguous rows, got sizes ", t.sizes(), " strides ", t.strides());
}

at::Tensor rms_norm(at::Tensor out, const at::Tensor& x, const at::Tensor& weight, double eps, bool offset) {
  const int64_t d = weight.size(0);
  check_rows(x, "x", d);
  check_rows(out, "out", d);
  TORCH_CHECK(weight.is_contiguous() && x.scalar_type() == weight.scalar_type() && out.scalar_type() == x.scalar_type(),
              "rms_norm: x, out and weight share one dtype; weight contiguous");
  const int64_t n = x.size(0), xs = x.stride(0), os = out.stride(0);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* wp = weight.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, n, kRowsPerTask, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const scalar_t* row = xp + t * xs;
        normalize_row(op + t * os, row, wp, d, inverse_rms(row, d, static_cast<float>(eps)), offset);
      }
    });
  });
  return out;
}

at::Tensor fused_add_rms_norm(at::Tensor out, at::Tensor sum, const at::Tensor& x, const at::Tensor& h,
                              const at::Tensor& weight, double eps, bool offset) {
  const int64_t d = weight.size(0);
  check_rows(x, "x", d);
  check_rows(h, "h", d);
  check_rows(sum, "sum", d);
  check_rows(out, "out", d);
  const int64_t n = x.size(0);
  TORCH_CHECK(h.size(0) == n && sum.size(0) == n && out.size(0) == n, "fused_add_rms_norm: row counts differ");
  const auto dtype = weight.scalar_type();
  TORCH_CHECK(x.scalar_type() == dtype && h.scalar_type() == dtype && sum.scalar_type() == dtype &&
                  out.scalar_type() == dtype,
              "fused_add_rms_norm: x, h, sum, out and weight share one dtype");
  TORCH_CHECK(weight.is_contiguous(), "fused_add_rms_norm: weight must be contiguous");
  const int64_t xs = x.stride(0), hs = h.stride(0), ss = sum.stride(0), os = out.stride(0);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "fused_add_rms_norm", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* hp = h.data_ptr<scalar_t>();
    const scalar_t* wp = weight.data_ptr<scalar_t>();
    scalar_t* sp = sum.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, n, kRowsPerTask, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const scalar_t* a = xp + t * xs;
        const scalar_t* b = hp + t * hs;
        scalar_t* row = sp + t * ss;
        for (int64_t i = 0; i < d; ++i) {
          row[i] = static_cast<scalar_t>(static_cast<float>(a[i]) + static_cast<float>(b[i]));
        }
        normalize_row(op + t * os, row, wp, d, inverse_rms(row, d, static_cast<float>(eps)), offset);
      }
    });
  });
  return out;
}

// reference (rotate_half): x1' = T(T(x1*c) + T(-x2*s)), x2' = T(T(x2*c') + T(x1*s')), where
// c, s are the first half of the position's table row and c', s' its second half
template <typename T>
void rotate_heads(T* x, int64_t heads, int64_t head_stride, int64_t half, const T* __restrict cos,
                  const T* __restrict sin) {
  for (int64_t h = 0; h < heads; ++h) {
    // two pointers, restrict: the halves never overlap, so the loop vectorizes
    T* __restrict lo = x + h * head_stride;
    T* __restrict hi = lo + half;
    for (int64_t i = 0; i < half; ++i) {
      const float x1 = static_cast<float>(lo[i]), x2 = static_cast<float>(hi[i]);
      const float a = rounded<T>(x1 * static_cast<float>(cos[i])) + rounded<T>(-x2 * static_cast<float>(sin[i]));
      const float b = rounded<T>(x2 * static_cast<float>(cos[half + i])) +
                      rounded<T>(x1 * static_cast<float>(sin[half + i]));
      lo[i] = static_cast<T>(a);
      hi[i] = static_cast<T>(b);
    }
  }
}

void check_heads(const at::Tensor& t, const char* name, int64_t tokens, int64_t rotary_dim) {
  TORCH_CHECK(t.dim() == 3 && t.size(0) == tokens && t.stride(2) == 1 && t.size(2) >= rotary_dim, name,
              ": expected [tokens, heads, head_dim >= ", rotary_dim, "] with contiguous heads, got sizes ", t.sizes(),
              " strides ", t.strides());
}

void rotary_embedding(at::Tensor q, at::Tensor k, const at::Tensor& positions, const at::Tensor& cos_table,
                      const at::Tensor& sin_table) {
  const int64_t tokens = positions.size(0), rotary_dim = cos_table.size(1), half = rotary_dim / 2;
  check_heads(q, "q", tokens, rotary_dim);
  check_heads(k, "k", tokens, rotary_dim);
  TORCH_CHECK(positions.dim() == 1 && positions.scalar_type() == at::kLong && positions.is_contiguous(),
              "positions: expected a contiguous int64 vector");
  TORCH_CHECK(cos_table.is_contiguous() && sin_table.is_contiguous() && sin_table.sizes() == cos_table.sizes() &&
                  cos_table.scalar_type() == q.scalar_type() && k.scalar_type() == q.scalar_type() &&
                  sin_table.scalar_type() == q.scalar_type() && rotary_dim % 2 == 0,
              "rotary_embedding: q, k and the tables share one dtype; tables contiguous [positions, even rotary_dim]");
  const int64_t max_pos = cos_table.size(0);
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(pos[t] >= 0 && pos[t] < max_pos, "positions: ", pos[t], " is outside the tables' [0, ", max_pos, ")");
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "rotary_embedding", [&] {
    scalar_t* qp = q.data_ptr<scalar_t>();
    scalar_t* kp = k.data_ptr<scalar_t>();
    const scalar_t* cp = cos_table.data_ptr<scalar_t>();
    const scalar_t* sp = sin_table.data_ptr<scalar_t>();
    at::parallel_for(0, tokens, kRowsPerTask, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const scalar_t* c = cp + pos[t] * rotary_dim;
        const scalar_t* s = sp + pos[t] * rotary_dim;
        rotate_heads(qp + t * q.stride(0), q.size(1), q.stride(1), half, c, s);
        rotate_heads(kp + t * k.stride(0), k.size(1), k.stride(1), half, c, s);
      }
    });
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pdserve, m) {
  m.def("rms_norm(Tensor(a!) out, Tensor x, Tensor weight, float eps, bool offset) -> Tensor(a!)");
  m.def(
      "fused_add_rms_norm(Tensor(a!) out, Tensor(b!) sum, Tensor x, Tensor h, Tensor weight, float eps, bool offset) "
      "-> Tensor(a!)");
  m.def("rotary_embedding(Tensor(a!) q, Tensor(b!) k, Tensor positions, Tensor cos_table, Tensor sin_table) -> ()");
}

TORCH_LIBRARY_IMPL(pdserve, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("fused_add_rms_norm", &fused_add_rms_norm);
  m.impl("rotary_embedding", &rotary_embedding);
}
