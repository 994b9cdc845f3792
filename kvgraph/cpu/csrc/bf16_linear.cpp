// A bf16 linear layer on the CPU over a weight packed once in kvgraph's own layout, for every
// batch size: AMX tiles where the processor has them, AVX512-BF16 dot products for the few rows
// of a decode step.
//
// Why: torch's oneDNN linear on a packed weight costs ~35 us per call before any arithmetic
// (measured on a 16x16 weight; a decode step of a small model makes dozens of calls), oneDNN's
// packed layout is opaque to anything else, and a plain bf16 weight is repacked
// on every call. The packed layout here is an ordinary bf16 tensor, [N / 16, K / 2, 16, 2]:
// element (b, p, j, t) is weight[16 b + j][2 p + t]. Sixteen outputs' pairs of
// inputs are one 64-byte row, which is what both AVX512-BF16's dot product (vdpbf16ps: pairs
// multiplied and summed into 16 fp32 lanes) and an AMX B tile (16 rows of such pairs) read, so
// one copy of the weight serves decode and prefill. N must be a multiple of 16 and K of 32 (an
// AMX tile's depth); Python packs only such weights.
//
// Up to DOT_ROWS rows: AVX512-BF16 dot products (tile_matmul.h); each pass streams four column
// blocks (64 outputs) once and applies them to every row, in registers. Up to 16 rows: one AMX
// tile of rows against the same four column blocks, weights prefetched. More rows (prefill):
// 32x32 output blocks in four AMX accumulator tiles. Without AMX (a Zen 4, or Linux refusing
// the tiles) every batch takes the dot products.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#define KVGRAPH_AMX 1
#endif
#if defined(__AVX512BF16__) || defined(KVGRAPH_AMX)
#include <immintrin.h>
#endif

#include "tile_matmul.h"

namespace {

constexpr int64_t BLOCK = 16;      // outputs per column block (one 64-byte row of pairs)
constexpr int64_t DEPTH = 32;      // inputs per AMX tile row: K is a multiple of it
// Rows up to which the dot-product path runs where AMX is usable: past it, AVX512-BF16's
// arithmetic (not reading the weight) limits, and an AMX tile does 16 rows for the price of one.
constexpr int64_t DOT_ROWS = 4;

// out[m][0:columns] = bf16(c[m][0:columns] + bias) for m < rows (c rows ldc apart), rounded to
// nearest even, 16 at a time where the processor converts.
void store_rows(const float* c, int64_t ldc, int64_t rows, int64_t columns, const float* bias,
                at::BFloat16* out, int64_t ldo) {
  for (int64_t m = 0; m < rows; ++m) {
    const float* cm = c + m * ldc;
    at::BFloat16* om = out + m * ldo;
    int64_t j = 0;
#if defined(__AVX512BF16__)
    for (; j < columns; j += 16) {
      const __mmask16 mask = columns - j >= 16 ? __mmask16(0xFFFF)
                                               : __mmask16((1u << (columns - j)) - 1);
      __m512 v = _mm512_maskz_loadu_ps(mask, cm + j);
      if (bias != nullptr) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, bias + j));
      _mm256_mask_storeu_epi16(om + j, mask, (__m256i)_mm512_cvtneps_pbh(v));
    }
#endif
    for (; j < columns; ++j) om[j] = at::BFloat16(cm[j] + (bias != nullptr ? bias[j] : 0.f));
  }
}

#if defined(__AVX512BF16__)
// out[M, N] = x[M, K] . w (packed) + bias by the dot products of tile_matmul.h.
void dot_matmul(const uint16_t* x, int64_t ldx, int64_t M, const uint16_t* w, int64_t N,
                int64_t K, const float* bias, at::BFloat16* out, int64_t ldo) {
  kvgraph_tiles::tile_matmul<kvgraph_tiles::Bf16Step>(
      x, ldx, M, w, N, K / 2,
      [&](const float* sums, int64_t rows, int64_t m0, int64_t n0, int64_t columns) {
        store_rows(sums, kvgraph_tiles::PASS_OUTPUTS, rows, columns,
                   bias != nullptr ? bias + n0 : nullptr, out + m0 * ldo + n0, ldo);
      });
}
#endif

#ifdef KVGRAPH_AMX
constexpr int64_t TILE_ROWS = 16;
constexpr int64_t M_CHUNK = 256;  // input rows whose tiles stay in L2 while every block passes
constexpr int64_t PREFETCH_DEPTH = 4 * DEPTH;  // inputs ahead whose weights are prefetched

struct TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Linux hands out AMX's tile registers only to a process that asks (once).
bool amx_usable() {
  static const bool usable = [] {
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }();
  return usable;
}

// Tiles 0-3: C (fp32), 4-5: A (rows of 32 bf16 inputs), 6-7: B (16 pairs x 16 columns). C and A
// tiles have `rows` rows: 16 in the 32-row blocks, fewer for a small batch.
void configure_tiles(int64_t rows) {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.rows[t] = t < 6 ? rows : TILE_ROWS;
    config.colsb[t] = 64;
  }
  _tile_loadconfig(&config);
}

// c[0:32][0:32] = x rows [a0: 16, a1: 16] times column blocks w0, w1 over K (c rows 32 apart).
void amx_block(const uint16_t* a0, const uint16_t* a1, int64_t lda, const uint16_t* w0,
               const uint16_t* w1, int64_t K, float* c) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t k = 0; k < K; k += DEPTH) {
    _tile_loadd(4, a0 + k, lda * 2);
    _tile_loadd(5, a1 + k, lda * 2);
    _tile_loadd(6, w0 + k * BLOCK, 64);
    _tile_loadd(7, w1 + k * BLOCK, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, c, 128);
  _tile_stored(1, c + 16, 128);
  _tile_stored(2, c + 16 * 32, 128);
  _tile_stored(3, c + 16 * 32 + 16, 128);
}

// c[0:rows][0:64] = x (one tile of rows <= 16, configured) times four column blocks over K
// (c rows 64 apart): the weights stream past one A tile, as in a decode step.
void amx_row_tile(const uint16_t* a, int64_t lda, const uint16_t* const* w, int64_t K,
                  float* c) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t k = 0; k < K; k += DEPTH) {
    // The weights come from memory once: ask for a later step's ahead of the tile loads.
    if (k + PREFETCH_DEPTH < K)
      for (int j = 0; j < 4; ++j)
        for (int64_t line = 0; line < DEPTH * BLOCK; line += 32)
          _mm_prefetch(reinterpret_cast<const char*>(w[j] + (k + PREFETCH_DEPTH) * BLOCK + line),
                       _MM_HINT_T0);
    _tile_loadd(4, a + k, lda * 2);
    _tile_loadd(6, w[0] + k * BLOCK, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_loadd(7, w[1] + k * BLOCK, 64);
    _tile_dpbf16ps(1, 4, 7);
    _tile_loadd(6, w[2] + k * BLOCK, 64);
    _tile_dpbf16ps(2, 4, 6);
    _tile_loadd(7, w[3] + k * BLOCK, 64);
    _tile_dpbf16ps(3, 4, 7);
  }
  _tile_stored(0, c, 256);
  _tile_stored(1, c + 16, 256);
  _tile_stored(2, c + 32, 256);
  _tile_stored(3, c + 48, 256);
}

// Up to 16 rows: each pass of four column blocks streams its weights once.
void amx_small_matmul(const uint16_t* x, int64_t ldx, int64_t M, const uint16_t* w, int64_t N,
                      int64_t K, const float* bias, at::BFloat16* out, int64_t ldo) {
  const int64_t num_blocks = (N + BLOCK - 1) / BLOCK, block_elems = K / 2 * 32;
  const int64_t passes = (num_blocks + 3) / 4;
  at::parallel_for(0, passes, 16, [&](int64_t begin, int64_t end) {
    configure_tiles(M);
    alignas(64) float c[TILE_ROWS * 64];
    for (int64_t pass = begin; pass < end; ++pass) {
      const uint16_t* blocks[4];
      for (int64_t j = 0; j < 4; ++j)
        blocks[j] = w + std::min(4 * pass + j, num_blocks - 1) * block_elems;
      amx_row_tile(x, ldx, blocks, K, c);
      const int64_t n0 = 4 * pass * BLOCK, columns = std::min<int64_t>(4 * BLOCK, N - n0);
      store_rows(c, 64, M, columns, bias != nullptr ? bias + n0 : nullptr, out + n0, ldo);
    }
    _tile_release();
  });
}

// Any rows: 32x32 output blocks, M_CHUNK rows at a time.
void amx_matmul(const uint16_t* x, int64_t ldx, int64_t M, const uint16_t* w, int64_t N,
                int64_t K, const float* bias, at::BFloat16* out, int64_t ldo) {
  const int64_t num_blocks = (N + BLOCK - 1) / BLOCK, block_elems = K / 2 * 32;
  const int64_t block_pairs = (num_blocks + 1) / 2;
  // The last partial 32-row block, zero-padded (a tile reads 16 whole rows).
  const int64_t full = M / 32 * 32, tail = M - full;
  std::vector<uint16_t> pad(tail ? 32 * K : 0, 0);
  for (int64_t m = 0; m < tail; ++m)
    std::memcpy(pad.data() + m * K, x + (full + m) * ldx, K * 2);
  for (int64_t m_lo = 0; m_lo < M; m_lo += M_CHUNK) {
    const int64_t m_hi = std::min(M, m_lo + M_CHUNK);
    at::parallel_for(0, block_pairs, 1, [&](int64_t begin, int64_t end) {
      configure_tiles(TILE_ROWS);
      alignas(64) float c[32 * 32];
      for (int64_t bp = begin; bp < end; ++bp) {
        const int64_t b = 2 * bp, b1 = std::min(b + 1, num_blocks - 1);
        const int64_t n0 = b * BLOCK, columns = std::min<int64_t>(2 * BLOCK, N - n0);
        for (int64_t m0 = m_lo; m0 < m_hi; m0 += 32) {
          const bool padded = m0 >= full;
          const uint16_t* a = padded ? pad.data() : x + m0 * ldx;
          const int64_t lda = padded ? K : ldx;
          amx_block(a, a + 16 * lda, lda, w + b * block_elems, w + b1 * block_elems, K, c);
          store_rows(c, 32, std::min<int64_t>(32, M - m0), columns,
                     bias != nullptr ? bias + n0 : nullptr, out + m0 * ldo + n0, ldo);
        }
      }
      _tile_release();
    });
  }
}
#endif

// Which paths this build has: 2 = AMX and AVX512-BF16, 1 = AVX512-BF16 only, 0 = neither.
int64_t bf16_linear_level() {
#if defined(KVGRAPH_AMX) && defined(__AVX512BF16__)
  if (amx_usable()) return 2;
#endif
#if defined(__AVX512BF16__)
  return 1;
#else
  return 0;
#endif
}

at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& packed,
                       const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(bf16_linear_level() > 0, "kvgraph_cpu.bf16_linear: this build has no "
              "AVX512-BF16 (kvgraph packs bf16 weights this way only where it has)");
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == BLOCK && packed.size(3) == 2 &&
                  packed.scalar_type() == at::kBFloat16 && packed.is_contiguous() &&
                  packed.size(1) * 2 % DEPTH == 0,
              "kvgraph_cpu.bf16_linear: expected a packed bf16 weight [N / 16, K / 2, 16, 2] "
              "with K a multiple of 32, got ", packed.scalar_type(), " ", packed.sizes());
  const int64_t K = packed.size(1) * 2, N = packed.size(0) * BLOCK;
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() >= 1 && x.size(-1) == K,
              "kvgraph_cpu.bf16_linear: expected bf16 x [..., ", K, "], got ", x.scalar_type(),
              " ", x.sizes());
  at::Tensor x2d = x.reshape({-1, K});
  if (x2d.stride(1) != 1) x2d = x2d.contiguous();
  const int64_t M = x2d.size(0);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  at::Tensor out = at::empty(shape, x.options());
  at::Tensor bias32;
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N, "kvgraph_cpu.bf16_linear: expected a "
                "bias [", N, "], got ", bias->sizes());
    bias32 = bias->to(at::kFloat).contiguous();
  }
  const float* b = bias32.defined() ? bias32.data_ptr<float>() : nullptr;
  const auto* xs = reinterpret_cast<const uint16_t*>(x2d.data_ptr<at::BFloat16>());
  const auto* ws = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  at::BFloat16* o = out.data_ptr<at::BFloat16>();
  const int64_t ldx = x2d.stride(0);
#ifdef KVGRAPH_AMX
  if (M > DOT_ROWS && bf16_linear_level() == 2) {
    if (M <= TILE_ROWS) {
      amx_small_matmul(xs, ldx, M, ws, N, K, b, o, N);
    } else {
      amx_matmul(xs, ldx, M, ws, N, K, b, o, N);
    }
    return out;
  }
#endif
#if defined(__AVX512BF16__)
  dot_matmul(xs, ldx, M, ws, N, K, b, o, N);
#endif
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvgraph_cpu, m) {
  m.def("bf16_linear(Tensor x, Tensor packed, Tensor? bias) -> Tensor");
  m.def("bf16_linear_level() -> int");
}

TORCH_LIBRARY_IMPL(kvgraph_cpu, CPU, m) {
  m.impl("bf16_linear", &bf16_linear);
}

TORCH_LIBRARY_IMPL(kvgraph_cpu, CompositeExplicitAutograd, m) {
  m.impl("bf16_linear_level", &bf16_linear_level);
}
