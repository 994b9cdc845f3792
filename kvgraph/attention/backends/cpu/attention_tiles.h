// The arithmetic of one tile of paged attention on the CPU: scores of R query rows against a
// tile of keys, the online-softmax update, and the weighted sum of values. Rows are processed R
// at a time so each key and value loaded from memory serves R rows; fixed widths (N keys,
// VALUE_CHUNK dims) keep the accumulators in vector registers. Included by paged_attention.cpp.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace kvgraph_cpu {

constexpr int64_t VALUE_CHUNK = 32;  // output dims kept in registers while keys stream past

// exp(x) for x <= 0 in plain arithmetic, so a loop of it vectorises (std::exp does not):
// 2^n * e^r with |r| <= ln2/2 and a degree-6 Taylor polynomial (relative error < 2e-7).
__attribute__((always_inline)) inline float exp_nonpositive(float x) {
  x = std::max(x, -87.f);  // e^-87 ~ 1.6e-38: below it a weight is as good as zero
  const float n = std::floor(x * 1.44269504f + 0.5f);
  const float r = x - n * 0.693145752f - n * 1.42860677e-06f;  // ln2 in two parts
  float p = 1.f / 720;
  p = p * r + 1.f / 120;
  p = p * r + 1.f / 24;
  p = p * r + 1.f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// s[r][k] = q[r] . keys_t[:, k] for r < R, k < N; q rows are kdim apart, keys_t is [kdim][N].
template <int R, int64_t N>
inline void score_rows(const float* q, const float* keys_t, int64_t kdim, float* s) {
  float sums[R][N] = {};
  for (int64_t d = 0; d < kdim; ++d) {
    const float* kt = keys_t + d * N;
    for (int r = 0; r < R; ++r) {
      const float qd = q[r * kdim + d];
#pragma omp simd
      for (int64_t k = 0; k < N; ++k) sums[r][k] += qd * kt[k];
    }
  }
  std::memcpy(s, sums, sizeof(sums));
}

// The same for a partial tile of n < N keys (keys_t is [kdim][n]; s rows stay N apart).
template <int R, int64_t N>
inline void score_rows_partial(const float* q, const float* keys_t, int64_t kdim, int64_t n,
                               float* s) {
  for (int r = 0; r < R; ++r) std::fill(s + r * N, s + r * N + n, 0.f);
  for (int64_t d = 0; d < kdim; ++d) {
    const float* kt = keys_t + d * n;
    for (int r = 0; r < R; ++r) {
      const float qd = q[r * kdim + d];
      float* sr = s + r * N;
#pragma omp simd
      for (int64_t k = 0; k < n; ++k) sr[k] += qd * kt[k];
    }
  }
}

// Online softmax of one row over scores s[lo, hi): s becomes the weights e^(s - max), and the
// row's running max, sum and accumulator acc[:vdim] are rescaled to the new max.
inline void softmax_update(float* s, int64_t lo, int64_t hi, float& row_max, float& row_sum,
                           float* acc, int64_t vdim) {
  float tile_max = s[lo];
  for (int64_t k = lo + 1; k < hi; ++k) tile_max = std::max(tile_max, s[k]);
  const float new_max = std::max(row_max, tile_max);
  const float correction = std::exp(row_max - new_max);  // exp(-inf) = 0 at the first tile
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

// acc[r][:vdim] += sum over k in [lo, hi) of p[r][k] * values[k, :] for r < R (p rows
// p_stride apart, acc rows vdim apart).
template <int R>
inline void accumulate_rows(const float* p, int64_t p_stride, const float* values, int64_t lo,
                            int64_t hi, int64_t vdim, float* acc) {
  int64_t d0 = 0;
  for (; d0 + VALUE_CHUNK <= vdim; d0 += VALUE_CHUNK) {
    float sums[R][VALUE_CHUNK];
    for (int r = 0; r < R; ++r) std::memcpy(sums[r], acc + r * vdim + d0, sizeof(sums[r]));
    for (int64_t k = lo; k < hi; ++k) {
      const float* vk = values + k * vdim + d0;
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
      for (int64_t d = d0; d < vdim; ++d) acc[r * vdim + d] += pk * values[k * vdim + d];
    }
  }
}

}  // namespace kvgraph_cpu
