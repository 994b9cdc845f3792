// A linear layer for the few rows of a decode step: fp32, the weight in its plain [out, in]
// layout, read from memory once per call whatever the number of rows.
//
// Why: MKL's sgemm copies (packs) the whole weight before multiplying once a batch has more
// than a row or two, so at 4-16 rows a decode step's matmuls read their weights twice and
// write them once; a step takes ~2x its 1-row time though it is bound by reading the weights
// either way. Here each pass takes four weight rows (outputs) and up to four input rows,
// keeps the 16 dot products in AVX-512 registers, and prefetches the next four weight rows
// while it works, so the weights stream from memory once and the inputs stay in L1.
// Batches of more than MAX_ROWS rows (prefill) are compute-bound: at::linear (MKL) runs them.
// Without AVX-512 at build time every call goes to at::linear.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace {

// Rows past which a batch goes to at::linear: where the measured gain ends (README).
constexpr int64_t MAX_ROWS = 16;

#ifdef __AVX512F__
constexpr int64_t WEIGHT_ROWS = 4;  // outputs per pass
constexpr int64_t INPUT_ROWS = 4;   // inputs per pass: 16 accumulators with WEIGHT_ROWS

// out[i][j] = x[i] . w[j] (+ bias[j]) for R input rows and C weight rows; `next` (or null) is
// the next pass's weight rows, fetched into cache meanwhile.
template <int64_t R, int64_t C>
void dot_tile(const float* x, int64_t ldx, const float* w, int64_t K, const float* bias,
              float* out, int64_t ldo, const float* next) {
  __m512 acc[R][C];
  for (int64_t i = 0; i < R; ++i)
    for (int64_t j = 0; j < C; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) {
    const __mmask16 mask = K - k >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (K - k)) - 1);
    __m512 wv[C];
    for (int64_t j = 0; j < C; ++j) wv[j] = _mm512_maskz_loadu_ps(mask, w + j * K + k);
    if (next != nullptr)
      for (int64_t j = 0; j < WEIGHT_ROWS; ++j)
        _mm_prefetch(reinterpret_cast<const char*>(next + j * K + k), _MM_HINT_T0);
    for (int64_t i = 0; i < R; ++i) {
      const __m512 xv = _mm512_maskz_loadu_ps(mask, x + i * ldx + k);
      for (int64_t j = 0; j < C; ++j) acc[i][j] = _mm512_fmadd_ps(xv, wv[j], acc[i][j]);
    }
  }
  for (int64_t i = 0; i < R; ++i)
    for (int64_t j = 0; j < C; ++j)
      out[i * ldo + j] = _mm512_reduce_add_ps(acc[i][j]) + (bias != nullptr ? bias[j] : 0.f);
}

// Every input row against C weight rows; only the first pass prefetches (the later ones read
// the same weight rows, by then in L1).
template <int64_t C>
void weight_rows(const float* x, int64_t ldx, int64_t M, const float* w, int64_t K,
                 const float* bias, float* out, int64_t ldo, const float* next) {
  int64_t m = 0;
  for (; m + INPUT_ROWS <= M; m += INPUT_ROWS, next = nullptr)
    dot_tile<INPUT_ROWS, C>(x + m * ldx, ldx, w, K, bias, out + m * ldo, ldo, next);
  x += m * ldx;
  out += m * ldo;
  switch (M - m) {
    case 3: dot_tile<3, C>(x, ldx, w, K, bias, out, ldo, next); break;
    case 2: dot_tile<2, C>(x, ldx, w, K, bias, out, ldo, next); break;
    case 1: dot_tile<1, C>(x, ldx, w, K, bias, out, ldo, next); break;
    default: break;
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
      switch (rows) {
        case 4: weight_rows<4>(x, ldx, M, w + n * K, K, b, out + n, N, next); break;
        case 3: weight_rows<3>(x, ldx, M, w + n * K, K, b, out + n, N, next); break;
        case 2: weight_rows<2>(x, ldx, M, w + n * K, K, b, out + n, N, next); break;
        default: weight_rows<1>(x, ldx, M, w + n * K, K, b, out + n, N, next); break;
      }
    }
  });
}
#endif

bool runs_here(const at::Tensor& x2d, const at::Tensor& weight,
               const c10::optional<at::Tensor>& bias) {
#ifdef __AVX512F__
  return x2d.size(0) <= MAX_ROWS && x2d.scalar_type() == at::kFloat &&
         weight.scalar_type() == at::kFloat && weight.is_contiguous() &&
         x2d.stride(1) == 1 && !x2d.is_mkldnn() && !weight.is_mkldnn() &&
         (!bias.has_value() || (bias->scalar_type() == at::kFloat && bias->is_contiguous()));
#else
  return false;
#endif
}

at::Tensor small_batch_linear(const at::Tensor& x, const at::Tensor& weight,
                              const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(weight.dim() == 2 && x.dim() >= 1 && x.size(-1) == weight.size(1),
              "small_batch_linear: x [..., in] and weight [out, in] disagree: x ", x.sizes(),
              ", weight ", weight.sizes());
  const int64_t K = weight.size(1), N = weight.size(0);
  const at::Tensor x2d = x.reshape({-1, K});
  if (!runs_here(x2d, weight, bias)) return at::linear(x, weight, bias);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  at::Tensor out = at::empty(shape, x.options());
#ifdef __AVX512F__
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
