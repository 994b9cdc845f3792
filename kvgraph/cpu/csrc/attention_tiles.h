// The arithmetic of one tile of paged attention on the CPU: scores of R query rows against a
// tile of keys, the online-softmax update, and the weighted sum of values. Rows are processed R
// at a time so each key and value loaded from memory serves R rows; fixed widths (N keys,
// VALUE_CHUNK dims) keep the accumulators in vector registers. Scores are computed against
// transposed keys, so every inner loop is a vector over keys with no horizontal sums (one dot
// product per key, each ending in a horizontal sum, was much slower in a micro-benchmark,
// transpose included). Included by
// paged_attention.cpp.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include <type_traits>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace kvgraph_cpu {

// A cache element as fp32 (the cache is read in place, in its own dtype).
inline float widen(float x) { return x; }
inline float widen(c10::BFloat16 x) { return static_cast<float>(x); }
inline float widen(c10::Half x) { return static_cast<float>(x); }
inline float widen(double x) { return static_cast<float>(x); }  // a float64 cache: tests

#ifdef __AVX512F__
// 16 consecutive cache elements as fp32 lanes.
inline __m512 widen16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 widen16(const c10::BFloat16* p) {  // bf16 is fp32's upper half
  const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}
inline __m512 widen16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512 widen16(const double* p) {
  alignas(64) float f[16];
  for (int i = 0; i < 16; ++i) f[i] = widen(p[i]);
  return _mm512_load_ps(f);
}
#elif defined(__AVX2__)
// 8 consecutive cache elements as fp32 lanes.
inline __m256 widen8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 widen8(const c10::BFloat16* p) {
  const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
}
inline __m256 widen8(const c10::Half* p) {
#ifdef __F16C__
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  alignas(32) float f[8];
  for (int i = 0; i < 8; ++i) f[i] = widen(p[i]);
  return _mm256_load_ps(f);
#endif
}
inline __m256 widen8(const double* p) {
  alignas(32) float f[8];
  for (int i = 0; i < 8; ++i) f[i] = widen(p[i]);
  return _mm256_load_ps(f);
}
#endif

// The bits of `from` as a `To`: GCC >= 11 and Clang have a builtin the vectoriser sees through;
// older compilers get memcpy (correct, but the loops using it stay scalar).
template <typename To, typename From>
__attribute__((always_inline)) inline To bit_cast(From from) {
#if defined(__has_builtin)
#if __has_builtin(__builtin_bit_cast)
  return __builtin_bit_cast(To, from);
#endif
#endif
  To to;
  std::memcpy(&to, &from, sizeof(to));
  return to;
}

// Output dims kept in registers while keys stream past: for ROW_BLOCK (4) rows, 16 vectors of
// accumulators, each broadcast weight feeding four multiply-adds with AVX-512 (32 registers),
// two with AVX2 (16).
#ifdef __AVX512F__
constexpr int64_t VALUE_CHUNK = 64;
#else
constexpr int64_t VALUE_CHUNK = 32;
#endif
constexpr int64_t KEY_STEP = 16;  // a tile's keys are scored in multiples of this many

// exp(x) for x <= 0 in plain arithmetic, so a loop of it vectorises (std::exp does not):
// 2^n * e^r with |r| <= ln2/2 and a degree-6 Taylor polynomial (relative error < 2e-7). n is
// rounded by adding 1.5 * 2^23, which leaves it in the low mantissa bits: std::floor and a
// float-to-int conversion would keep GCC from vectorising without -fno-trapping-math.
__attribute__((always_inline)) inline float exp_nonpositive(float x) {
  constexpr float ROUND = 12582912.f;  // 1.5 * 2^23
  x = std::max(x, -87.f);  // e^-87 ~ 1.6e-38: below it a weight is as good as zero
  const float shifted = x * 1.44269504f + ROUND;
  const float n = shifted - ROUND;
  const float r = x - n * 0.693145752f - n * 1.42860677e-06f;  // ln2 in two parts
  float p = 1.f / 720;
  p = p * r + 1.f / 120;
  p = p * r + 1.f / 24;
  p = p * r + 1.f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const int32_t bits = (bit_cast<int32_t>(shifted) - bit_cast<int32_t>(ROUND) + 127) << 23;
  return p * bit_cast<float>(bits);  // 2^n
}

// s[r][k] = q[r] . keys_t[:, k] for r < R, k < N; q rows are kdim apart, keys_t is [kdim][N],
// s rows s_stride apart. N is fixed (a tile's keys rounded up to KEY_STEP) so the sums stay in
// registers: with a run-time width GCC kept them in memory, each a chain of loads and stores
// (a quarter of a short decode's attention went to its last, partial tile).
template <int R, int64_t N>
inline void score_rows(const float* q, const float* keys_t, int64_t kdim, float* s,
                       int64_t s_stride) {
  float sums[R][N] = {};
  for (int64_t d = 0; d < kdim; ++d) {
    const float* kt = keys_t + d * N;
    for (int r = 0; r < R; ++r) {
      const float qd = q[r * kdim + d];
#pragma omp simd
      for (int64_t k = 0; k < N; ++k) sums[r][k] += qd * kt[k];
    }
  }
  for (int r = 0; r < R; ++r) std::memcpy(s + r * s_stride, sums[r], sizeof(sums[r]));
}

#ifdef __AVX512F__
// dst[j][i] = rows[i][d0 + j] (as fp32) for a 16x16 block, in registers: pairs of rows
// interleave, then groups of four, then 128-bit lanes move into place (dst rows ld_dst apart).
template <typename E>
inline void transpose_16x16(const E* const* rows, int64_t d0, float* dst, int64_t ld_dst) {
  __m512 r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = widen16(rows[i] + d0);
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  // u[4g + c], lane L: column 4L + c of rows 4g..4g+3.
  for (int g = 0; g < 16; g += 4) {
    r[g] = _mm512_shuffle_ps(t[g], t[g + 2], 0x44);
    r[g + 1] = _mm512_shuffle_ps(t[g], t[g + 2], 0xEE);
    r[g + 2] = _mm512_shuffle_ps(t[g + 1], t[g + 3], 0x44);
    r[g + 3] = _mm512_shuffle_ps(t[g + 1], t[g + 3], 0xEE);
  }
  for (int c = 0; c < 4; ++c) {
    const __m512 even01 = _mm512_shuffle_f32x4(r[c], r[4 + c], 0x88);  // lanes 0, 2 of g0, g1
    const __m512 odd01 = _mm512_shuffle_f32x4(r[c], r[4 + c], 0xDD);
    const __m512 even23 = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0x88);
    const __m512 odd23 = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0xDD);
    _mm512_storeu_ps(dst + (c) * ld_dst, _mm512_shuffle_f32x4(even01, even23, 0x88));
    _mm512_storeu_ps(dst + (4 + c) * ld_dst, _mm512_shuffle_f32x4(odd01, odd23, 0x88));
    _mm512_storeu_ps(dst + (8 + c) * ld_dst, _mm512_shuffle_f32x4(even01, even23, 0xDD));
    _mm512_storeu_ps(dst + (12 + c) * ld_dst, _mm512_shuffle_f32x4(odd01, odd23, 0xDD));
  }
}
#elif defined(__AVX2__)
// dst[j][i] = rows[i][d0 + j] (as fp32) for an 8x8 block, in registers: pairs of rows
// interleave, then groups of four, then the 128-bit halves swap into place.
template <typename E>
inline void transpose_8x8(const E* const* rows, int64_t d0, float* dst, int64_t ld_dst) {
  __m256 r[8], t[8];
  for (int i = 0; i < 8; ++i) r[i] = widen8(rows[i] + d0);
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  // r[g + c]: column c of rows g..g+3 in its low half, column c + 4 in its high half.
  for (int g = 0; g < 8; g += 4) {
    r[g] = _mm256_shuffle_ps(t[g], t[g + 2], 0x44);
    r[g + 1] = _mm256_shuffle_ps(t[g], t[g + 2], 0xEE);
    r[g + 2] = _mm256_shuffle_ps(t[g + 1], t[g + 3], 0x44);
    r[g + 3] = _mm256_shuffle_ps(t[g + 1], t[g + 3], 0xEE);
  }
  for (int c = 0; c < 4; ++c) {
    _mm256_storeu_ps(dst + c * ld_dst, _mm256_permute2f128_ps(r[c], r[4 + c], 0x20));
    _mm256_storeu_ps(dst + (4 + c) * ld_dst, _mm256_permute2f128_ps(r[c], r[4 + c], 0x31));
  }
}
#endif

// keys_t[d][k] = keys[k][d] (as fp32) for n keys of kdim, each key a row of its own (where the
// cache holds it): blocks in registers (16x16 with AVX-512, 8x8 with AVX2), element by
// element for the rest (and elsewhere).
template <typename E>
inline void transpose_keys(const E* const* keys, int64_t n, int64_t kdim, float* keys_t) {
  int64_t k_done = 0, d_done = 0;
#if defined(__AVX512F__) || defined(__AVX2__)
#ifdef __AVX512F__
  constexpr int64_t B = 16;
#else
  constexpr int64_t B = 8;
#endif
  k_done = n / B * B;
  d_done = kdim / B * B;
  for (int64_t k0 = 0; k0 < k_done; k0 += B) {
    for (int64_t d0 = 0; d0 < d_done; d0 += B) {
#ifdef __AVX512F__
      transpose_16x16(keys + k0, d0, keys_t + d0 * n + k0, n);
#else
      transpose_8x8(keys + k0, d0, keys_t + d0 * n + k0, n);
#endif
    }
  }
#endif
  for (int64_t k = 0; k < n; ++k) {
    for (int64_t d = k < k_done ? d_done : 0; d < kdim; ++d) keys_t[d * n + k] = widen(keys[k][d]);
  }
}

// The largest of s[0, n), n >= 1. GCC leaves `omp simd reduction(max)` over std::max scalar
// (a chain of dependent maxss: an eighth of a decode step's attention), so vectors by hand.
inline float max_of(const float* s, int64_t n) {
  int64_t k = 0;
  float m = s[0];
#ifdef __AVX512F__
  __m512 v = _mm512_set1_ps(s[0]);
  for (; k + 16 <= n; k += 16) v = _mm512_max_ps(v, _mm512_loadu_ps(s + k));
  m = _mm512_reduce_max_ps(v);
#elif defined(__AVX2__)
  __m256 v = _mm256_set1_ps(s[0]);
  for (; k + 8 <= n; k += 8) v = _mm256_max_ps(v, _mm256_loadu_ps(s + k));
  __m128 half = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  half = _mm_max_ps(half, _mm_movehl_ps(half, half));
  m = _mm_cvtss_f32(_mm_max_ss(half, _mm_movehdup_ps(half)));
#endif
  for (; k < n; ++k) m = std::max(m, s[k]);
  return m;
}

// Online softmax of one row over scores s[lo, hi): s becomes the weights e^(s - max), and the
// row's running max, sum and accumulator acc[:vdim] are rescaled to the new max.
inline void softmax_update(float* s, int64_t lo, int64_t hi, float& row_max, float& row_sum,
                           float* acc, int64_t vdim) {
  const float new_max = std::max(row_max, max_of(s + lo, hi - lo));
  // At the first tile row_max is -inf: the correction is ~0 and multiplies zeros.
  const float correction = exp_nonpositive(row_max - new_max);
  row_max = new_max;
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t k = lo; k < hi; ++k) {
    s[k] = exp_nonpositive(s[k] - new_max);
    sum += s[k];
  }
  row_sum = row_sum * correction + sum;
  if (correction != 1.f) {
#pragma omp simd
    for (int64_t d = 0; d < vdim; ++d) acc[d] *= correction;
  }
}

// acc[r][:vdim] += sum over k in [lo, hi) of p[r][k] * values[k][:] for r < R (p rows
// p_stride apart, acc rows vdim apart, each value a row of its own, widened to fp32 once for
// the R rows).
template <int R, typename E>
inline void accumulate_rows(const float* p, int64_t p_stride, const E* const* values,
                            int64_t lo, int64_t hi, int64_t vdim, float* acc) {
  int64_t d0 = 0;
  for (; d0 + VALUE_CHUNK <= vdim; d0 += VALUE_CHUNK) {
    float sums[R][VALUE_CHUNK];
    for (int r = 0; r < R; ++r) std::memcpy(sums[r], acc + r * vdim + d0, sizeof(sums[r]));
    for (int64_t k = lo; k < hi; ++k) {
      const float* vk;
      float widened[VALUE_CHUNK];
      if constexpr (std::is_same_v<E, float>) {
        vk = values[k] + d0;
      } else {
#pragma omp simd
        for (int64_t j = 0; j < VALUE_CHUNK; ++j) widened[j] = widen(values[k][d0 + j]);
        vk = widened;
      }
      for (int r = 0; r < R; ++r) {
        const float pk = p[r * p_stride + k];
#pragma omp simd
        for (int64_t j = 0; j < VALUE_CHUNK; ++j) sums[r][j] += pk * vk[j];
      }
    }
    for (int r = 0; r < R; ++r) std::memcpy(acc + r * vdim + d0, sums[r], sizeof(sums[r]));
  }
  for (int r = 0; r < R; ++r) {
    for (int64_t k = lo; k < hi; ++k) {
      const float pk = p[r * p_stride + k];
      for (int64_t d = d0; d < vdim; ++d) acc[r * vdim + d] += pk * widen(values[k][d]);
    }
  }
}

}  // namespace kvgraph_cpu
