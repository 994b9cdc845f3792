// A linear layer for the few rows of a decode step: fp32 or bf16 (widened to fp32 as it is
// loaded), the weight in its plain [out, in] layout, read from memory once per call whatever
// the number of rows.
//
// Why: MKL's sgemm copies (packs) the whole weight before multiplying once a batch has more
// than a row or two, so at 4-16 rows a decode step's matmuls read their weights twice and
// write them once; a step takes ~2x its 1-row time though it is bound by reading the weights
// either way. Here each pass takes a few weight rows (outputs) and runs every input row against
// them in tiles (shapes in `Lanes`), keeping the dot products in registers and prefetching the
// next pass's weight rows meanwhile, so the weights stream from memory once and the inputs stay
// in cache. Batches of more than `Lanes::MAX_ROWS` rows (prefill) are
// compute-bound: at::linear (MKL) runs them, bf16 ones in fp32 (the op takes bf16 only where
// oneDNN has no bf16 kernels, and there torch's own bf16 matmul is several times slower than
// widening the weight and running MKL's sgemm: README, measured on an AVX2 AMD Zen 3). Without AVX2 and FMA
// at build time every call goes to at::linear that way.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#define KVGRAPH_SMALL_BATCH 1
#endif

namespace {

#ifdef KVGRAPH_SMALL_BATCH
// The widest vector of floats this build has: loads (the last ones partial) and stores, bf16
// widened, fused multiply-adds, and sums of the lanes (the same order for every row, so a
// row's outputs have the same bits alone and in a batch).
#ifdef __AVX512F__
struct Lanes {
  using V = __m512;
  static constexpr int64_t WIDTH = 16;
  // Tiles of 4 input rows x 4 weight rows: 16 accumulators of 32 registers, any batch.
  static constexpr int FEW_INPUTS = 4, FEW_WEIGHTS = 4, MANY_INPUTS = 4, MANY_WEIGHTS = 4;
  // Rows past which a batch goes to at::linear: measured on a Xeon (README) up to 16 only.
  static constexpr int64_t MAX_ROWS = 16, FEW_ROWS = MAX_ROWS;
  static V zero() { return _mm512_setzero_ps(); }
  static V load(const float* p, int64_t left) {
    return _mm512_maskz_loadu_ps(left >= WIDTH ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1),
                                 p);
  }
  static V widen(const at::BFloat16* p) {  // WIDTH of them
    const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
  }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V in_register(V v) { return v; }
  static void sum4(V a, V b, V c, V d, float* out) {  // each vector's lanes added up
    out[0] = _mm512_reduce_add_ps(a);
    out[1] = _mm512_reduce_add_ps(b);
    out[2] = _mm512_reduce_add_ps(c);
    out[3] = _mm512_reduce_add_ps(d);
  }
};
#else
struct Lanes {
  using V = __m256;
  static constexpr int64_t WIDTH = 8;
  // Up to FEW_ROWS rows, bound by reading the weights: tiles of 2 input rows x 4 weight rows
  // (more weight rows streaming at once). More rows: 4 x 3, whose 12 accumulators, 3 weights and
  // an input take all 16 registers and do 12 FMAs per 7 loads, not 8 per 6 (measured on a Zen
  // 3 against 2 x 4: ~1.2-1.35x the speed at 12-16 rows, ~0.9x at 2-4).
  static constexpr int FEW_INPUTS = 2, FEW_WEIGHTS = 4, MANY_INPUTS = 4, MANY_WEIGHTS = 3;
  static constexpr int64_t FEW_ROWS = 8;
  // Rows past which a batch goes to at::linear (MKL, bf16 widened): on a Zen 3 the 4 x 3 tiles
  // took 0.7x MKL's time at 24 rows, 0.9x at 48, 0.96x at 64, 1.06x at 96 (README).
  static constexpr int64_t MAX_ROWS = 48;
  static V zero() { return _mm256_setzero_ps(); }
  static V load(const float* p, int64_t left) {
    if (left >= WIDTH) return _mm256_loadu_ps(p);
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_maskload_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32(int(left)), lanes));
  }
  static V widen(const at::BFloat16* p) {  // WIDTH of them
    const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
  }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  // v kept in a register: GCC would otherwise fold an input's (or a weight's) load into each of
  // the FMAs that use it, and 15 loads per 12 FMAs bound the tile at ~0.7x a Zen 3's FMA rate.
  static V in_register(V v) {
    __asm__("" : "+x"(v));
    return v;
  }
  // Each vector's lanes added up, the four at once: a tile against K = 512 has only 64 steps,
  // and a sum apiece costs a fair share of them.
  static void sum4(V a, V b, V c, V d, float* out) {
    const __m256 pairs = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(pairs), _mm256_extractf128_ps(pairs, 1)));
  }
};
#endif
// The first `left` of p's bf16 widened (WIDTH where there are as many; zeros after the rest).
Lanes::V load(const at::BFloat16* p, int64_t left) {
  if (left >= Lanes::WIDTH) return Lanes::widen(p);
  at::BFloat16 rest[Lanes::WIDTH] = {};
  std::copy(p, p + left, rest);
  return Lanes::widen(rest);
}

Lanes::V load(const float* p, int64_t left) { return Lanes::load(p, left); }

// dst[0:n] = src[0:n] as floats (exactly: a bf16 is a float's upper half).
void widen(const at::BFloat16* src, int64_t n, float* dst) {
  int64_t i = 0;
  for (; i + Lanes::WIDTH <= n; i += Lanes::WIDTH) Lanes::store(dst + i, Lanes::widen(src + i));
  for (; i < n; ++i) dst[i] = float(src[i]);
}

// One input row's C (3 or 4) dot products. Named members, not an array: GCC keeps an array of
// vectors in memory and stores every accumulator after every FMA.
template <int C>
struct RowSums {
  static_assert(C == 3 || C == 4, "a tile has three or four weight rows");
  Lanes::V s0 = Lanes::zero(), s1 = Lanes::zero(), s2 = Lanes::zero(), s3 = Lanes::zero();

  void add(Lanes::V x, Lanes::V w0, Lanes::V w1, Lanes::V w2, Lanes::V w3) {
    s0 = Lanes::fma(x, w0, s0);
    s1 = Lanes::fma(x, w1, s1);
    s2 = Lanes::fma(x, w2, s2);
    if constexpr (C > 3) s3 = Lanes::fma(x, w3, s3);
  }

  // Output j of this row (+ bias), for j < columns (a bf16 output rounded to nearest even).
  template <typename Out>
  void store(Out* out, int64_t columns, const float* bias) const {
    float sums[4];
    // With three weight rows s3 is never used: passing it would keep a zero in a register.
    Lanes::sum4(s0, s1, s2, C > 3 ? s3 : s2, sums);
    for (int64_t j = 0; j < columns; ++j)
      out[j] = Out(sums[j] + (bias != nullptr ? bias[j] : 0.f));
  }
};

// out[i][j] = x[i] . w[j] (+ bias[j]) for i < R, j < columns <= C: an R x C tile, the missing
// weight rows read as copies of the last real one (their sums are dropped). Each sum is added
// up in the same order whatever the tile, so a row's outputs have the same bits alone and in a
// batch.
// Meanwhile it fetches into cache the rows of `next` (the next pass's weights, or null)
// numbered `first`, `first + stride`, ...: each tile of a pass fetches its share, so the
// weights stream from memory all through the pass, not only while its first tile runs.
template <int R, int C, typename W, typename Out>
void dot_tile(const float* x, int64_t ldx, const W* w, int64_t columns, int64_t K,
              const float* bias, Out* out, int64_t ldo, const W* next, int64_t first,
              int64_t stride) {
  static_assert(R >= 1 && R <= 4, "a tile has one to four input rows");
  const W* wr[4];
  for (int64_t j = 0; j < 4; ++j) wr[j] = w + std::min(j, columns - 1) * K;
  RowSums<C> r0, r1, r2, r3;
  // One step of WIDTH along K (`left` < WIDTH only in the last, whose loads are partial).
  const auto step = [&](int64_t k, int64_t left) __attribute__((always_inline)) {
    const Lanes::V w0 = Lanes::in_register(load(wr[0] + k, left)),
                   w1 = Lanes::in_register(load(wr[1] + k, left)),
                   w2 = Lanes::in_register(load(wr[2] + k, left)),
                   w3 = C > 3 ? Lanes::in_register(load(wr[3] + k, left)) : w2;
    if (next != nullptr && k * int64_t(sizeof(W)) % 64 == 0)  // one prefetch per 64-byte line
      for (int64_t j = first; j < C; j += stride)
        _mm_prefetch(reinterpret_cast<const char*>(next + j * K + k), _MM_HINT_T0);
    r0.add(Lanes::in_register(Lanes::load(x + k, left)), w0, w1, w2, w3);
    if constexpr (R > 1) r1.add(Lanes::in_register(Lanes::load(x + ldx + k, left)), w0, w1, w2, w3);
    if constexpr (R > 2)
      r2.add(Lanes::in_register(Lanes::load(x + 2 * ldx + k, left)), w0, w1, w2, w3);
    if constexpr (R > 3)
      r3.add(Lanes::in_register(Lanes::load(x + 3 * ldx + k, left)), w0, w1, w2, w3);
  };
  int64_t k = 0;
  for (; k + Lanes::WIDTH <= K; k += Lanes::WIDTH) step(k, Lanes::WIDTH);
  if (k < K) step(k, K - k);  // apart: partial loads in every step kept a sum in memory
  // By name: an array of their addresses would keep them in memory all along, as above.
  r0.store(out, columns, bias);
  if constexpr (R > 1) r1.store(out + ldo, columns, bias);
  if constexpr (R > 2) r2.store(out + 2 * ldo, columns, bias);
  if constexpr (R > 3) r3.store(out + 3 * ldo, columns, bias);
}

// Every input row against up to C weight rows, IR at a time and the rest in one smaller tile
// (the later tiles read the same weight rows, by then in L1).
template <int IR, int C, typename W, typename Out>
void weight_rows(const float* x, int64_t ldx, int64_t M, const W* w, int64_t columns, int64_t K,
                 const float* bias, Out* out, int64_t ldo, const W* next) {
  const int64_t tiles = (M + IR - 1) / IR;
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t m = t * IR;
    const float* xt = x + m * ldx;
    Out* ot = out + m * ldo;
    const int64_t rows = std::min<int64_t>(IR, M - m);
    if (rows == IR)
      dot_tile<IR, C>(xt, ldx, w, columns, K, bias, ot, ldo, next, t, tiles);
    else if (rows == 1)
      dot_tile<1, C>(xt, ldx, w, columns, K, bias, ot, ldo, next, t, tiles);
    else if (rows == 2)
      dot_tile<std::min(IR, 2), C>(xt, ldx, w, columns, K, bias, ot, ldo, next, t, tiles);
    else
      dot_tile<std::min(IR, 3), C>(xt, ldx, w, columns, K, bias, ot, ldo, next, t, tiles);
  }
}

// out = x w^T (+ bias), C weight rows per pass, tiles of IR input rows. bf16 weights are read
// as they are with one input row; with more, each pass's weight rows are widened into an L1
// buffer the tiles read as in fp32 (widening them in every tile would cost more than the FMAs).
template <int IR, int C, typename W, typename Out>
void pass_by_pass(const float* x, int64_t ldx, int64_t M, const W* w, int64_t N, int64_t K,
                  const float* bias, Out* out) {
  const int64_t passes = (N + C - 1) / C;
  // Grain: a thread's share is at least 64 passes (192-256 outputs), so one thread is one loop.
  at::parallel_for(0, passes, 64, [&](int64_t begin, int64_t end) {
    constexpr bool widens = !std::is_same_v<W, float>;
    std::vector<float> wf(widens && M > 1 ? C * K : 0);
    for (int64_t p = begin; p < end; ++p) {
      const int64_t n = p * C, columns = std::min<int64_t>(C, N - n);
      const float* b = bias != nullptr ? bias + n : nullptr;
      const W* next = p + 1 < end && n + 2 * C <= N ? w + (n + C) * K : nullptr;
      if constexpr (widens) {
        if (M > 1) {
          widen(w + n * K, columns * K, wf.data());
          weight_rows<IR, C>(x, ldx, M, wf.data(), columns, K, b, out + n, N,
                             static_cast<const float*>(nullptr));
          continue;
        }
      }
      weight_rows<IR, C>(x, ldx, M, w + n * K, columns, K, b, out + n, N, next);
    }
  });
}

template <typename W, typename Out>
void small_batch_matmul(const float* x, int64_t ldx, int64_t M, const W* w, int64_t N, int64_t K,
                        const float* bias, Out* out) {
  if (M <= Lanes::FEW_ROWS)
    pass_by_pass<Lanes::FEW_INPUTS, Lanes::FEW_WEIGHTS>(x, ldx, M, w, N, K, bias, out);
  else
    pass_by_pass<Lanes::MANY_INPUTS, Lanes::MANY_WEIGHTS>(x, ldx, M, w, N, K, bias, out);
}

// The same in bf16, the weights streaming from memory at half the bytes: the input rows
// widened to floats once.
void small_batch_matmul(const at::BFloat16* x, int64_t ldx, int64_t M, const at::BFloat16* w,
                        int64_t N, int64_t K, const float* bias, at::BFloat16* out) {
  std::vector<float> xf(M * K);
  for (int64_t m = 0; m < M; ++m) widen(x + m * ldx, K, xf.data() + m * K);
  small_batch_matmul(xf.data(), K, M, w, N, K, bias, out);
}
#endif

bool runs_here(const at::Tensor& x2d, const at::Tensor& weight) {
#ifdef KVGRAPH_SMALL_BATCH
  const auto dtype = weight.scalar_type();
  return x2d.size(0) <= Lanes::MAX_ROWS && (dtype == at::kFloat || dtype == at::kBFloat16) &&
         x2d.scalar_type() == dtype && weight.is_contiguous() && x2d.stride(1) == 1 &&
         !x2d.is_mkldnn() && !weight.is_mkldnn();
#else
  return false;
#endif
}

// at::linear, bf16 in fp32 (see the top of the file).
at::Tensor widened_linear(const at::Tensor& x, const at::Tensor& weight,
                          const std::optional<at::Tensor>& bias) {
  if (x.scalar_type() != at::kBFloat16 || weight.scalar_type() != at::kBFloat16 ||
      weight.is_mkldnn())
    return at::linear(x, weight, bias);
  const std::optional<at::Tensor> bias32 =
      bias.has_value() ? std::optional<at::Tensor>(bias->to(at::kFloat)) : std::nullopt;
  return at::linear(x.to(at::kFloat), weight.to(at::kFloat), bias32).to(at::kBFloat16);
}

at::Tensor small_batch_linear(const at::Tensor& x, const at::Tensor& weight,
                              const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(weight.dim() == 2 && x.dim() >= 1 && x.size(-1) == weight.size(1),
              "small_batch_linear: x [..., in] and weight [out, in] disagree: x ", x.sizes(),
              ", weight ", weight.sizes());
  const int64_t K = weight.size(1), N = weight.size(0);
  const at::Tensor x2d = x.reshape({-1, K});
  if (!runs_here(x2d, weight)) return widened_linear(x, weight, bias);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  at::Tensor out = at::empty(shape, x.options());
#ifdef KVGRAPH_SMALL_BATCH
  at::Tensor bias32;
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N, "small_batch_linear: expected a bias [",
                N, "], got ", bias->sizes());
    bias32 = bias->to(at::kFloat).contiguous();
  }
  const float* b = bias32.defined() ? bias32.data_ptr<float>() : nullptr;
  if (weight.scalar_type() == at::kFloat) {
    small_batch_matmul(x2d.data_ptr<float>(), x2d.stride(0), x2d.size(0),
                       weight.data_ptr<float>(), N, K, b, out.data_ptr<float>());
  } else {
    small_batch_matmul(x2d.data_ptr<at::BFloat16>(), x2d.stride(0), x2d.size(0),
                       weight.data_ptr<at::BFloat16>(), N, K, b, out.data_ptr<at::BFloat16>());
  }
#endif
  return out;
}

// The most rows a call runs here (0: built without AVX2 and FMA, every call goes to at::linear).
int64_t small_batch_linear_max_rows() {
#ifdef KVGRAPH_SMALL_BATCH
  return Lanes::MAX_ROWS;
#else
  return 0;
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvgraph_cpu, m) {
  m.def("small_batch_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def("small_batch_linear_max_rows() -> int");
}

TORCH_LIBRARY_IMPL(kvgraph_cpu, CPU, m) {
  m.impl("small_batch_linear", &small_batch_linear);
}

TORCH_LIBRARY_IMPL(kvgraph_cpu, CompositeExplicitAutograd, m) {
  m.impl("small_batch_linear_max_rows", &small_batch_linear_max_rows);
}
