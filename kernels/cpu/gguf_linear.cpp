// skinny_linear_gguf and dequantize_gguf: y = x W^T (+ b) for a few float32 rows of x, and
// the float32 weight itself, for a weight kept in llama.cpp's GGUF blocks
// (engine/model/gguf_linear.py), each row its blocks as the file stores them:
//   Q4_0, Q4_1, Q8_0: 32 columns a block, an fp16 scale d (Q4_1: and an fp16 offset m), then
//     the quants; weight d (q - 8), d q + m, d q;
//   Q5_0, Q5_1: as Q4_0 and Q4_1 with a fifth bit per quant (32 high bits after the
//     scales); weight d (q - 16), d q + m;
//   Q4_K: 256 columns a block, fp16 d and dmin, 8 pairs of 6-bit scale and min packed in 12
//     bytes, then 4-bit quants; weight (d sc) q - (dmin m) for each 32 columns' sc and m;
//   Q6_K: 256 columns a block, 6-bit quants (low 4 bits, then high 2), an int8 scale per 16
//     columns, fp16 d last; weight (d sc) (q - 32).
// Each 16 or 32 columns are widened and scaled in registers into the float32 weight gguf-py's
// dequantizer gives (each product and sum rounded once, in its order), so the result is
// skinny_linear's over that weight, bit for bit (the row loop is skinny_rows.h's), reading
// 4.5-8.5 bits a weight.
#include "skinny_rows.h"

#include <cstring>

namespace {

using namespace skinny;

// llama.cpp's block formats, by their ggml type ids (gguf.GGMLQuantizationType).
enum GgufType : int64_t { kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ4_K = 12, kQ6_K = 14 };
constexpr int64_t kGgufBlock = 32;    // columns a Q4_0/Q4_1/Q8_0 block holds
constexpr int64_t kKQuantBlock = 256; // columns a Q4_K/Q6_K block holds

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
  static constexpr int64_t kColumns = kGgufBlock;
  struct Header {};  // a block is read whole in load_block
  void read_header(int64_t, int64_t, Header&) const {}
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
  void load_block(int64_t n, int64_t k, const Header&, __m512& lo, __m512& hi) const {
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

// A weight of Q5_0 / Q5_1 blocks, 32 columns a block: fp16 d (Q5_1: then fp16 m), 32 high
// bits (column j's in bit j of a little-endian uint32), then 16 bytes of low nibbles laid out
// as Q4_0's. Weight d (q - 16) or d q + m, as gguf-py rounds them.
template <GgufType T>
struct Q5Weight {
  static constexpr int64_t kBytes = T == kQ5_0 ? 22 : 24;
  static constexpr int64_t kHigh = T == kQ5_0 ? 2 : 4;  // the high bits' offset in a block
  const uint8_t* w;
  int64_t row_bytes;
  const uint8_t* block(int64_t n, int64_t k) const { return w + n * row_bytes + k / kGgufBlock * kBytes; }
  void prefetch(int64_t n, int64_t k) const {
    if (k % 64 == 0) prefetch_l2(block(n, k) + kPrefetchBytes);
  }
  static int quant(const uint8_t* b, int64_t j) {
    uint32_t high;
    std::memcpy(&high, b + kHigh, sizeof high);
    const uint8_t byte = b[kHigh + 4 + j % 16];
    return (j < 16 ? byte & 0x0F : byte >> 4) | static_cast<int>((high >> j) & 1) << 4;
  }
#if defined(__AVX512F__)
  static constexpr bool kLoadsBlocks = true;
  static constexpr int64_t kColumns = kGgufBlock;
  struct Header {};
  void read_header(int64_t, int64_t, Header&) const {}
  // The block's 32 possible weights as two 16-entry tables (the high bit picks the table:
  // vpermt2ps reads an index's low 5 bits), each quant looked up in them.
  void load_block(int64_t n, int64_t k, const Header&, __m512& lo, __m512& hi) const {
    const uint8_t* b = block(n, k);
    const __m512 d = _mm512_set1_ps(fp16_to_float(b));
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512 low_table, high_table;
    if constexpr (T == kQ5_0) {
      low_table = _mm512_mul_ps(d, _mm512_sub_ps(iota, _mm512_set1_ps(16)));
      high_table = _mm512_mul_ps(d, iota);
    } else {
      const __m512 m = _mm512_set1_ps(fp16_to_float(b + 2));
      low_table = _mm512_add_ps(opaque(_mm512_mul_ps(d, iota)), m);
      high_table = _mm512_add_ps(opaque(_mm512_mul_ps(d, _mm512_add_ps(iota, _mm512_set1_ps(16)))), m);
    }
    uint32_t high;
    std::memcpy(&high, b + kHigh, sizeof high);
    const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + kHigh + 4)));
    const __m512i sixteen = _mm512_set1_epi32(16);
    const __m512i nibbles_lo = _mm512_and_si512(q, _mm512_set1_epi32(0x0F)), nibbles_hi = _mm512_srli_epi32(q, 4);
    const __m512i qlo = _mm512_mask_or_epi32(nibbles_lo, static_cast<__mmask16>(high & 0xFFFF), nibbles_lo, sixteen);
    const __m512i qhi = _mm512_mask_or_epi32(nibbles_hi, static_cast<__mmask16>(high >> 16), nibbles_hi, sixteen);
    lo = _mm512_permutex2var_ps(low_table, qlo, high_table);
    hi = _mm512_permutex2var_ps(low_table, qhi, high_table);
  }
  __m512 load(int64_t n, int64_t k) const {
    __m512 lo, hi;
    load_block(n, k - k % 32, Header{}, lo, hi);
    return k % 32 ? hi : lo;
  }
  __m512 load_tail(int64_t n, int64_t k, __mmask16) const { return load(n, k); }
#else
  const float* chunk(int64_t n, int64_t k, int64_t, float* buf) const {
    const uint8_t* b = block(n, k);
    const float d = fp16_to_float(b);
    const int64_t first = k % kGgufBlock;
    for (int64_t i = 0; i < 16; ++i) {
      const int q = quant(b, first + i);
      buf[i] = T == kQ5_0 ? d * static_cast<float>(q - 16) : opaque(d * static_cast<float>(q)) + fp16_to_float(b + 2);
    }
    return buf;
  }
#endif
};

// Q4_K's 6-bit scale and min of 32-column group j (0-7), from the 12 bytes that pack them
// (ggml's get_scale_min_k4).
inline void q4k_scale_min(const uint8_t* packed, int j, int& sc, int& m) {
  if (j < 4) {
    sc = packed[j] & 63;
    m = packed[j + 4] & 63;
  } else {
    sc = (packed[j + 4] & 0x0F) | ((packed[j - 4] >> 6) << 4);
    m = (packed[j + 4] >> 4) | ((packed[j] >> 6) << 4);
  }
}

// Where the quants of the 32 columns of a K-quant block at column k are (k rounded down to
// 32). Q4_K: the low nibbles of 32 bytes for even groups, the high nibbles for odd ones.
// Q6_K: in each half of 128 columns, group s takes its low 4 bits from 32 of the half's 64
// low-bit bytes (s odd: the second 32), the low nibbles for s < 2 and the high ones after,
// and its top 2 bits from bits 2s of the half's 32 high-bit bytes.
struct KQuants {
  const uint8_t* low;
  const uint8_t* high;  // Q6_K only
  int low_shift, high_shift;
};

inline KQuants q4k_quants(const uint8_t* b, int64_t k) {
  const int j = static_cast<int>(k % kKQuantBlock / 32);
  return {b + 16 + 32 * (j / 2), nullptr, 4 * (j % 2), 0};
}

inline KQuants q6k_quants(const uint8_t* b, int64_t k) {
  const int64_t col = k % kKQuantBlock / 32 * 32, half = col / 128, s = col % 128 / 32;
  return {b + 64 * half + 32 * (s % 2), b + 128 + 32 * half, static_cast<int>(4 * (s / 2)),
          static_cast<int>(2 * s)};
}

// Q4_K group j's float32 scale d sc and offset dmin m; Q6_K's scale of the 16 columns at
// `group16`, d sc. Each a product rounded once, as gguf-py's `d * sc`.
inline void q4k_group_scale(const uint8_t* b, int j, float& scale, float& min) {
  int sc, m;
  q4k_scale_min(b + 4, j, sc, m);
  scale = fp16_to_float(b) * static_cast<float>(sc);
  min = fp16_to_float(b + 2) * static_cast<float>(m);
}

inline float q6k_scale(const uint8_t* b, int64_t group16) {
  return fp16_to_float(b + 208) * static_cast<float>(reinterpret_cast<const int8_t*>(b + 192)[group16]);
}

// A weight of K-quant blocks, [out, in / 256 blocks of kBytes], read 32 columns at a time.
// Per block and row its Header holds Q6_K's 16 scales (d sc) or Q4_K's d and dmin: read
// once, not per group (measured: Q6_K 1.6-2.2x faster so; Q4_K's 8 scale/min pairs unpacked
// up front as well made it slower, so they are unpacked per group).
template <GgufType T>
struct KQuantWeight {
  static constexpr int64_t kBytes = T == kQ4_K ? 144 : 210;
  const uint8_t* w;
  int64_t row_bytes;
  const uint8_t* block(int64_t n, int64_t k) const { return w + n * row_bytes + k / kKQuantBlock * kBytes; }
  void prefetch(int64_t n, int64_t k) const {
    if (k % 64 == 0) prefetch_l2(w + n * row_bytes + k * kBytes / kKQuantBlock + kPrefetchBytes);
  }
#if defined(__AVX512F__)
  static constexpr bool kLoadsBlocks = true;
  static constexpr int64_t kColumns = kKQuantBlock;
  struct Header {
    alignas(64) float scale[16];  // Q6_K: per 16 columns
    float d, dmin;                // Q4_K (its 6-bit scales and mins are unpacked per group)
  };
  void read_header(int64_t n, int64_t k, Header& h) const {
    const uint8_t* b = block(n, k);
    if constexpr (T == kQ4_K) {
      h.d = fp16_to_float(b);
      h.dmin = fp16_to_float(b + 2);
    } else {  // d times the 16 int8 scales, as q6k_scale computes each
      const __m512 sc = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192))));
      _mm512_store_ps(h.scale, _mm512_mul_ps(_mm512_set1_ps(fp16_to_float(b + 208)), sc));
    }
  }
  // Q4_K as Q4_1: the group's 16 possible weights, each quant looked up in them. Q6_K: each
  // 16 quants put together in bytes (a 16-bit shift pulls the next byte's bits in at the top,
  // the masks drop them; the top bits shifted up stay in their byte), widened and scaled.
  void load_block(int64_t n, int64_t k, const Header& h, __m512& lo, __m512& hi) const {
    const uint8_t* b = block(n, k);
    if constexpr (T == kQ4_K) {
      int sc, m;
      q4k_scale_min(b + 4, static_cast<int>(k % kKQuantBlock / 32), sc, m);
      const KQuants q = q4k_quants(b, k);
      const __m512 scaled = _mm512_mul_ps(_mm512_set1_ps(h.d * static_cast<float>(sc)),
                                          _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
      const __m512 table = _mm512_sub_ps(opaque(scaled), _mm512_set1_ps(h.dmin * static_cast<float>(m)));
      const __m128i count = _mm_cvtsi32_si128(q.low_shift);
      const __m512i qlo = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q.low)));
      const __m512i qhi = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q.low + 16)));
      lo = _mm512_permutexvar_ps(_mm512_srl_epi32(qlo, count), table);
      hi = _mm512_permutexvar_ps(_mm512_srl_epi32(qhi, count), table);
    } else {
      const KQuants q = q6k_quants(b, k);
      const int64_t group16 = k % kKQuantBlock / 16;
      const __m128i low_count = _mm_cvtsi32_si128(q.low_shift), high_count = _mm_cvtsi32_si128(q.high_shift);
      auto part = [&](int offset, float scale) {
        const __m128i l = _mm_and_si128(_mm_srl_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q.low + offset)),
                                                      low_count), _mm_set1_epi8(0x0F));
        const __m128i t = _mm_and_si128(_mm_srl_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q.high + offset)),
                                                      high_count), _mm_set1_epi8(3));
        const __m128i v = _mm_sub_epi8(_mm_or_si128(l, _mm_slli_epi16(t, 4)), _mm_set1_epi8(32));
        return _mm512_mul_ps(_mm512_set1_ps(scale), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(v)));
      };
      lo = part(0, h.scale[group16]);
      hi = part(16, h.scale[group16 + 1]);
    }
  }
  __m512 load(int64_t n, int64_t k) const {
    Header h;
    __m512 lo, hi;
    read_header(n, k, h);
    load_block(n, k - k % 32, h, lo, hi);
    return k % 32 ? hi : lo;
  }
  __m512 load_tail(int64_t n, int64_t k, __mmask16) const { return load(n, k); }
#else
  const float* chunk(int64_t n, int64_t k, int64_t, float* buf) const {
    const uint8_t* b = block(n, k);
    const int64_t first = k % 32;
    if constexpr (T == kQ4_K) {
      const KQuants q = q4k_quants(b, k);
      float scale, min;
      q4k_group_scale(b, static_cast<int>(k % kKQuantBlock / 32), scale, min);
      for (int64_t i = 0; i < 16; ++i) {
        const int v = (q.low[first + i] >> q.low_shift) & 0x0F;
        buf[i] = opaque(scale * static_cast<float>(v)) - min;
      }
    } else {
      const KQuants q = q6k_quants(b, k);
      const float scale = q6k_scale(b, k % kKQuantBlock / 16);
      for (int64_t i = 0; i < 16; ++i) {
        const int v = ((q.low[first + i] >> q.low_shift) & 0x0F) | (((q.high[first + i] >> q.high_shift) & 3) << 4);
        buf[i] = scale * static_cast<float>(v - 32);
      }
    }
    return buf;
  }
#endif
};

// A GGUF weight's columns (in_features) from its bytes per row; checks the type and layout.
int64_t gguf_columns(const char* op, const at::Tensor& weight, int64_t ggml_type) {
  int64_t block_bytes = 0, block_columns = kGgufBlock;
  switch (ggml_type) {
    case kQ4_0: block_bytes = GgufWeight<kQ4_0>::kBytes; break;
    case kQ4_1: block_bytes = GgufWeight<kQ4_1>::kBytes; break;
    case kQ8_0: block_bytes = GgufWeight<kQ8_0>::kBytes; break;
    case kQ5_0: block_bytes = Q5Weight<kQ5_0>::kBytes; break;
    case kQ5_1: block_bytes = Q5Weight<kQ5_1>::kBytes; break;
    case kQ4_K: block_bytes = KQuantWeight<kQ4_K>::kBytes, block_columns = kKQuantBlock; break;
    case kQ6_K: block_bytes = KQuantWeight<kQ6_K>::kBytes, block_columns = kKQuantBlock; break;
    default:
      TORCH_CHECK(false, op, ": ggml_type must be Q4_0 (2), Q4_1 (3), Q5_0 (6), Q5_1 (7), Q8_0 (8), Q4_K (12) or ",
                  "Q6_K (14), got ", ggml_type);
  }
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == at::kByte && weight.dim() == 2 &&
                  weight.is_contiguous() && weight.size(1) % block_bytes == 0,
              op, ": weight must be contiguous uint8 [out_features, blocks x ", block_bytes,
              " bytes] (whole blocks of ggml type ", ggml_type, "), got ", weight.scalar_type(), " ", weight.sizes());
  return weight.size(1) / block_bytes * block_columns;
}

// Calls f with the weight policy (GgufWeight, Q5Weight, KQuantWeight) of the given type over `weight`.
template <class F>
auto with_gguf_weight(const at::Tensor& weight, int64_t ggml_type, F&& f) {
  const uint8_t* w = weight.const_data_ptr<uint8_t>();
  const int64_t row_bytes = weight.size(1);
  switch (ggml_type) {
    case kQ4_0: return f(GgufWeight<kQ4_0>{w, row_bytes});
    case kQ4_1: return f(GgufWeight<kQ4_1>{w, row_bytes});
    case kQ8_0: return f(GgufWeight<kQ8_0>{w, row_bytes});
    case kQ5_0: return f(Q5Weight<kQ5_0>{w, row_bytes});
    case kQ5_1: return f(Q5Weight<kQ5_1>{w, row_bytes});
    case kQ4_K: return f(KQuantWeight<kQ4_K>{w, row_bytes});
    default: return f(KQuantWeight<kQ6_K>{w, row_bytes});
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
  m.def("skinny_linear_gguf(Tensor x, Tensor weight, int ggml_type, Tensor? bias=None) -> Tensor");
  m.def("dequantize_gguf(Tensor(a!) out, Tensor weight, int ggml_type) -> ()");
}

TORCH_LIBRARY_IMPL(pdserve, CPU, m) {
  m.impl("skinny_linear_gguf", &skinny_linear_gguf);
  m.impl("dequantize_gguf", &dequantize_gguf);
}
