// A linear layer for the few rows of a decode step: fp32, the weight in its plain [out, in]
// layout, read from memory once per call whatever the number of rows.
//
// Why: MKL's sgemm copies (packs) the whole weight before multiplying once a batch has more
// than a row or two, so at 4-16 rows a decode step's matmuls read their weights twice and
// write them once; a step takes ~2x its 1-row time though it is bound by reading the weights
// either way. Here each pass takes four weight rows (outputs) and a few input rows (four with
// AVX-512's 32 vector registers, two with AVX2's 16), keeps their dot products in registers,
// and prefetches the next four weight rows while it works, so the weights stream from memory
// once and the inputs stay in L1. Batches of more than MAX_ROWS rows (prefill) are
// compute-bound: at::linear (MKL) runs them. Without AVX2 and FMA at build time every call
// goes to at::linear.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <vector>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#define KVGRAPH_SMALL_BATCH 1
#endif

namespace {

// Rows past which a batch goes to at::linear: where the measured gain ends (README).
constexpr int64_t MAX_ROWS = 16;

#ifdef KVGRAPH_SMALL_BATCH
constexpr int64_t WEIGHT_ROWS = 4;  // outputs per pass

// The widest vector of floats this build has: loads (the last ones partial), fused
// multiply-adds, and a sum of the lanes (the same order for every row, so a row's outputs have
// the same bits alone and in a batch).
#ifdef __AVX512F__
struct Lanes {
  using V = __m512;
  static constexpr int64_t WIDTH = 16;
  static constexpr int64_t INPUT_ROWS = 4;  // 16 accumulators of 32 registers
  static V zero() { return _mm512_setzero_ps(); }
  static V load(const float* p, int64_t left) {
    return _mm512_maskz_loadu_ps(left >= WIDTH ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1),
                                 p);
  }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static float sum(V v) { return _mm512_reduce_add_ps(v); }
};
#else
struct Lanes {
  using V = __m256;
  static constexpr int64_t WIDTH = 8;
  static constexpr int64_t INPUT_ROWS = 2;  // 8 accumulators and 4 weights of 16 registers
  static V zero() { return _mm256_setzero_ps(); }
  static V load(const float* p, int64_t left) {
    if (left >= WIDTH) return _mm256_loadu_ps(p);
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_maskload_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32(int(left)), lanes));
  }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static float sum(V v) {
    __m128 half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    half = _mm_add_ps(half, _mm_movehl_ps(half, half));
    return _mm_cvtss_f32(_mm_add_ss(half, _mm_movehdup_ps(half)));
  }
};
#endif
constexpr int64_t INPUT_ROWS = Lanes::INPUT_ROWS;  // inputs per tile

// One input row's four dot products. Named members, not an array: GCC keeps an array of
// vectors in memory and stores every accumulator after every FMA.
struct RowSums {
  Lanes::V s0 = Lanes::zero(), s1 = Lanes::zero(), s2 = Lanes::zero(), s3 = Lanes::zero();

  void add(Lanes::V x, Lanes::V w0, Lanes::V w1, Lanes::V w2, Lanes::V w3) {
    s0 = Lanes::fma(x, w0, s0);
    s1 = Lanes::fma(x, w1, s1);
    s2 = Lanes::fma(x, w2, s2);
    s3 = Lanes::fma(x, w3, s3);
  }

  // Output j of this row (+ bias), for j < columns.
  void store(float* out, int64_t columns, const float* bias) const {
    const float sums[4] = {Lanes::sum(s0), Lanes::sum(s1), Lanes::sum(s2), Lanes::sum(s3)};
    for (int64_t j = 0; j < columns; ++j) out[j] = sums[j] + (bias != nullptr ? bias[j] : 0.f);
  }
};

// out[i][j] = x[i] . w[j] (+ bias[j]) for i < rows <= R, j < columns: an R x 4 tile (R is
// INPUT_ROWS, or 1 for a batch of one row), the missing input and weight rows read as copies of
// the last real one (their sums are dropped). Each sum is added up in the same order either
// way, so a row's outputs have the same bits alone and in a batch.
// Meanwhile it fetches into cache the rows of `next` (the next pass's weights, or null)
// numbered `first`, `first + stride`, ...: each tile of a pass fetches its share, so the
// weights stream from memory all through the pass, not only while its first tile runs.
template <int R>
void dot_tile(const float* x, int64_t ldx, int64_t rows, const float* w, int64_t columns,
              int64_t K, const float* bias, float* out, int64_t ldo, const float* next,
              int64_t first, int64_t stride) {
  static_assert(R >= 1 && R <= 4, "a tile has one to four input rows");
  const float* xr[4];
  const float* wr[4];
  for (int64_t i = 0; i < 4; ++i) {
    xr[i] = x + std::min(i, rows - 1) * ldx;
    wr[i] = w + std::min(i, columns - 1) * K;
  }
  RowSums r0, r1, r2, r3;
  for (int64_t k = 0; k < K; k += Lanes::WIDTH) {
    const int64_t left = K - k;
    const Lanes::V w0 = Lanes::load(wr[0] + k, left), w1 = Lanes::load(wr[1] + k, left),
                   w2 = Lanes::load(wr[2] + k, left), w3 = Lanes::load(wr[3] + k, left);
    if (next != nullptr && k % 16 == 0)  // one prefetch per 64-byte line
      for (int64_t j = first; j < WEIGHT_ROWS; j += stride)
        _mm_prefetch(reinterpret_cast<const char*>(next + j * K + k), _MM_HINT_T0);
    r0.add(Lanes::load(xr[0] + k, left), w0, w1, w2, w3);
    if constexpr (R > 1) r1.add(Lanes::load(xr[1] + k, left), w0, w1, w2, w3);
    if constexpr (R > 2) r2.add(Lanes::load(xr[2] + k, left), w0, w1, w2, w3);
    if constexpr (R > 3) r3.add(Lanes::load(xr[3] + k, left), w0, w1, w2, w3);
  }
  // By name: an array of their addresses would keep them in memory all along, as above.
  r0.store(out, columns, bias);
  if (rows > 1) r1.store(out + ldo, columns, bias);
  if (rows > 2) r2.store(out + 2 * ldo, columns, bias);
  if (rows > 3) r3.store(out + 3 * ldo, columns, bias);
}

// Every input row against up to four weight rows, INPUT_ROWS at a time (the later tiles read
// the same weight rows, by then in L1).
void weight_rows(const float* x, int64_t ldx, int64_t M, const float* w, int64_t columns,
                 int64_t K, const float* bias, float* out, int64_t ldo, const float* next) {
  if (M == 1) {  // a fraction of a full tile's FMAs
    dot_tile<1>(x, ldx, 1, w, columns, K, bias, out, ldo, next, 0, 1);
    return;
  }
  const int64_t tiles = (M + INPUT_ROWS - 1) / INPUT_ROWS;
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t m = t * INPUT_ROWS;
    dot_tile<INPUT_ROWS>(x + m * ldx, ldx, std::min(INPUT_ROWS, M - m), w, columns, K, bias,
                         out + m * ldo, ldo, next, t, tiles);
  }
}

void small_batch_matmul(const float* x, int64_t ldx, int64_t M, const float* w, int64_t N,
                        int64_t K, const float* bias, float* out) {
  const int64_t passes = (N + WEIGHT_ROWS - 1) / WEIGHT_ROWS;
  // Grain: a thread's share is at least 64 passes (256 outputs), so one thread is one loop.
  at::parallel_for(0, passes, 64, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const int64_t n = p * WEIGHT_ROWS, rows = std::min(WEIGHT_ROWS, N - n);
      const float* b = bias != nullptr ? bias + n : nullptr;
      const float* next = p + 1 < end && n + 2 * WEIGHT_ROWS <= N ? w + (n + WEIGHT_ROWS) * K
                                                                  : nullptr;
      weight_rows(x, ldx, M, w + n * K, rows, K, b, out + n, N, next);
    }
  });
}
#endif

bool runs_here(const at::Tensor& x2d, const at::Tensor& weight,
               const std::optional<at::Tensor>& bias) {
#ifdef KVGRAPH_SMALL_BATCH
  return x2d.size(0) <= MAX_ROWS && x2d.scalar_type() == at::kFloat &&
         weight.scalar_type() == at::kFloat && weight.is_contiguous() &&
         x2d.stride(1) == 1 && !x2d.is_mkldnn() && !weight.is_mkldnn() &&
         (!bias.has_value() || (bias->scalar_type() == at::kFloat && bias->is_contiguous()));
#else
  return false;
#endif
}

at::Tensor small_batch_linear(const at::Tensor& x, const at::Tensor& weight,
                              const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(weight.dim() == 2 && x.dim() >= 1 && x.size(-1) == weight.size(1),
              "small_batch_linear: x [..., in] and weight [out, in] disagree: x ", x.sizes(),
              ", weight ", weight.sizes());
  const int64_t K = weight.size(1), N = weight.size(0);
  const at::Tensor x2d = x.reshape({-1, K});
  if (!runs_here(x2d, weight, bias)) return at::linear(x, weight, bias);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  at::Tensor out = at::empty(shape, x.options());
#ifdef KVGRAPH_SMALL_BATCH
  small_batch_matmul(x2d.data_ptr<float>(), x2d.stride(0), x2d.size(0),
                     weight.data_ptr<float>(), N, K,
                     bias.has_value() ? bias->data_ptr<float>() : nullptr,
                     out.data_ptr<float>());
#endif
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvgraph_cpu, m) {
  m.def("small_batch_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvgraph_cpu, CPU, m) {
  m.impl("small_batch_linear", &small_batch_linear);
}
