// Matmuls over a weight in kvgraph's tile layout by broadcast multiply-adds in AVX-512
// registers: the dot-product path shared by the fp32 and bf16 linears (fp32_linear.cpp,
// bf16_linear.cpp).
//
// The layout: the weight's outputs in column blocks of 16, each block a run of 64-byte weight
// rows, one per input (fp32: 16 outputs' weights for that input) or per pair of inputs (bf16:
// 16 outputs' pairs, what vdpbf16ps reads). A step broadcasts one input (or pair) of a row of
// x and multiply-adds it into 16 outputs' sums per block.
//
// A work item is up to PASS_ROWS rows of x against one pass of four column blocks (64 outputs),
// in chunks of CHUNK_STEPS weight rows (128 KB of a pass in fp32, read from L2 by each group of
// rows after the first); MICRO_ROWS rows at a time keep 24 sums in registers, each weight load
// feeding six multiply-adds. Measured against oneDNN's packed fp32 linear on a Zen 4 (README,
// "fp32 linears"): 4 rows a group with 64-row chunks and 16-row items took 1.25x oneDNN's time
// at 1024 rows; six, 256 and 24 ~1.02x; six, 512 and 48 (each chunk's sums stored and reloaded
// half as often, each pass's weights read from L2 by twice the rows) 0.98x the 256-and-24 time
// in fp32 and bf16 (A/B, one thread, the small Llama's weights; level at 4096-wide weights).
// While the second group of rows works from L2, the next chunk's weights are asked for, so a
// decode step's first group does not wait on memory alone (items of up to PASS_ROWS rows; A/B
// on the Zen 4, one thread, 16 rows over the small Llama's weights: fp32 0.90x the time, bf16
// 0.87x).

#pragma once

#if defined(__AVX512F__)
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace kvgraph_tiles {

constexpr int64_t BLOCK = 16;        // outputs per column block
constexpr int64_t PASS_BLOCKS = 4;   // column blocks streamed together
constexpr int64_t PASS_OUTPUTS = PASS_BLOCKS * BLOCK;
constexpr int64_t PASS_ROWS = 48;    // rows of x in one work item (its sums' buffer)
constexpr int MICRO_ROWS = 6;        // rows of x whose sums stay in registers together
constexpr int64_t CHUNK_STEPS = 512;  // weight rows per chunk

// fp32: one input per weight row.
struct Fp32Step {
  using Input = float;
  using Weights = __m512;
  static constexpr int64_t INPUTS = 1;
  static Weights load(const float* w) { return _mm512_loadu_ps(w); }
  static __m512 broadcast(const float* x) { return _mm512_set1_ps(*x); }
  static __m512 madd(__m512 sums, __m512 x, Weights w) { return _mm512_fmadd_ps(x, w, sums); }
};

#if defined(__AVX512BF16__)
// bf16: a pair of inputs per weight row, multiplied pairwise and summed into fp32 lanes.
struct Bf16Step {
  using Input = uint16_t;
  using Weights = __m512bh;
  static constexpr int64_t INPUTS = 2;
  static Weights load(const uint16_t* w) { return (__m512bh)_mm512_loadu_si512(w); }
  static __m512bh broadcast(const uint16_t* x) {
    int32_t pair;
    std::memcpy(&pair, x, sizeof(pair));
    return (__m512bh)_mm512_set1_epi32(pair);
  }
  static __m512 madd(__m512 sums, __m512bh x, Weights w) { return _mm512_dpbf16_ps(sums, x, w); }
};
#endif

// One row of x's sums against a pass's four column blocks. Named members, not an array: GCC
// keeps an array of vectors in memory and stores it after every instruction.
template <class Step>
struct PassSums {
  __m512 s0, s1, s2, s3;

  void start(const float* sums, bool first) {
    if (first) {
      s0 = s1 = s2 = s3 = _mm512_setzero_ps();
      return;
    }
    s0 = _mm512_loadu_ps(sums);
    s1 = _mm512_loadu_ps(sums + 16);
    s2 = _mm512_loadu_ps(sums + 32);
    s3 = _mm512_loadu_ps(sums + 48);
  }
  void store(float* sums) const {
    _mm512_storeu_ps(sums, s0);
    _mm512_storeu_ps(sums + 16, s1);
    _mm512_storeu_ps(sums + 32, s2);
    _mm512_storeu_ps(sums + 48, s3);
  }
  void add(const typename Step::Input* x, typename Step::Weights w0, typename Step::Weights w1,
           typename Step::Weights w2, typename Step::Weights w3) {
    const auto b = Step::broadcast(x);
    s0 = Step::madd(s0, b, w0);
    s1 = Step::madd(s1, b, w1);
    s2 = Step::madd(s2, b, w2);
    s3 = Step::madd(s3, b, w3);
  }
};

// sums[r][0:64] (+)= x[r] . blocks over weight rows [lo, hi), for r < R (sums rows 64 apart;
// `first`: start from zero). Missing blocks (a pass at the end of N) read the last real one;
// their sums are dropped. With `ahead`, each step also asks for one weight row of each of its
// four blocks into L2.
template <class Step, int R>
void pass_rows(const typename Step::Input* x, int64_t ldx,
               const typename Step::Input* const* blocks, int64_t lo, int64_t hi, float* sums,
               bool first, const typename Step::Input* const* ahead) {
  using Input = typename Step::Input;
  constexpr int64_t ROW = 64 / sizeof(Input);  // elements per 64-byte weight row
  PassSums<Step> r0, r1, r2, r3, r4, r5;
  r0.start(sums, first);
  if constexpr (R > 1) r1.start(sums + 64, first);
  if constexpr (R > 2) r2.start(sums + 128, first);
  if constexpr (R > 3) r3.start(sums + 192, first);
  if constexpr (R > 4) r4.start(sums + 256, first);
  if constexpr (R > 5) r5.start(sums + 320, first);
  for (int64_t p = lo; p < hi; ++p) {
    if (ahead != nullptr) {
      for (int j = 0; j < 4; ++j)
        _mm_prefetch(reinterpret_cast<const char*>(ahead[j] + (p - lo) * ROW), _MM_HINT_T1);
    }
    const auto w0 = Step::load(blocks[0] + p * ROW);
    const auto w1 = Step::load(blocks[1] + p * ROW);
    const auto w2 = Step::load(blocks[2] + p * ROW);
    const auto w3 = Step::load(blocks[3] + p * ROW);
    const Input* xp = x + Step::INPUTS * p;
    r0.add(xp, w0, w1, w2, w3);
    if constexpr (R > 1) r1.add(xp + ldx, w0, w1, w2, w3);
    if constexpr (R > 2) r2.add(xp + 2 * ldx, w0, w1, w2, w3);
    if constexpr (R > 3) r3.add(xp + 3 * ldx, w0, w1, w2, w3);
    if constexpr (R > 4) r4.add(xp + 4 * ldx, w0, w1, w2, w3);
    if constexpr (R > 5) r5.add(xp + 5 * ldx, w0, w1, w2, w3);
  }
  r0.store(sums);
  if constexpr (R > 1) r1.store(sums + 64);
  if constexpr (R > 2) r2.store(sums + 128);
  if constexpr (R > 3) r3.store(sums + 192);
  if constexpr (R > 4) r4.store(sums + 256);
  if constexpr (R > 5) r5.store(sums + 320);
}

// Every row of an item over one chunk, MICRO_ROWS at a time, the rest together. The first
// group reads the chunk from memory; the second, reading it from L2, asks for the next
// chunk's weights (`next`: its four blocks' first rows, or null) meanwhile, so the next first
// group finds them there.
template <class Step>
void item_chunk(const typename Step::Input* x, int64_t ldx, int64_t rows,
                const typename Step::Input* const* blocks, int64_t lo, int64_t hi, float* sums,
                const typename Step::Input* const* next) {
  const bool first = lo == 0;
  int64_t r = 0;
  for (; r + MICRO_ROWS <= rows; r += MICRO_ROWS)
    pass_rows<Step, MICRO_ROWS>(x + r * ldx, ldx, blocks, lo, hi, sums + r * 64, first,
                                r == MICRO_ROWS ? next : nullptr);
  const auto* xr = x + r * ldx;
  float* sr = sums + r * 64;
  const auto* ahead = r == MICRO_ROWS ? next : nullptr;
  switch (rows - r) {
    case 5: pass_rows<Step, 5>(xr, ldx, blocks, lo, hi, sr, first, ahead); break;
    case 4: pass_rows<Step, 4>(xr, ldx, blocks, lo, hi, sr, first, ahead); break;
    case 3: pass_rows<Step, 3>(xr, ldx, blocks, lo, hi, sr, first, ahead); break;
    case 2: pass_rows<Step, 2>(xr, ldx, blocks, lo, hi, sr, first, ahead); break;
    case 1: pass_rows<Step, 1>(xr, ldx, blocks, lo, hi, sr, first, ahead); break;
    default: break;
  }
}

// x[M, steps * INPUTS] times the tiled weight w (N outputs, `steps` weight rows a block), every
// item in one parallel region, pass by pass, so a thread's consecutive items reuse one pass's
// weights (in L2) over every group of rows. `store(sums, rows, m0, n0, columns)` writes an
// item's sums (rows 64 apart) to rows m0.. and columns n0.. of the output.
template <class Step, class Store>
void tile_matmul(const typename Step::Input* x, int64_t ldx, int64_t M,
                 const typename Step::Input* w, int64_t N, int64_t steps, const Store& store) {
  using Input = typename Step::Input;
  if (M == 0) return;
  constexpr int64_t ROW_ELEMS = 64 / sizeof(Input);
  const int64_t block_elems = steps * ROW_ELEMS;
  const int64_t num_blocks = (N + BLOCK - 1) / BLOCK;
  const int64_t passes = (num_blocks + PASS_BLOCKS - 1) / PASS_BLOCKS;
  const int64_t groups = (M + PASS_ROWS - 1) / PASS_ROWS;
  // A thread's share: 16 passes (1024 outputs) of one row, fewer as rows add work, so that a
  // prefill's 512-output matmuls (8 passes) run on every thread too.
  const int64_t grain = std::max<int64_t>(1, 16 / std::min(M, PASS_ROWS));
  at::parallel_for(0, passes * groups, grain, [&](int64_t begin, int64_t end) {
    alignas(64) float sums[PASS_ROWS * PASS_OUTPUTS];
    auto pass_blocks = [&](int64_t pass, const Input** blocks) {
      for (int64_t j = 0; j < PASS_BLOCKS; ++j)
        blocks[j] = w + std::min(pass * PASS_BLOCKS + j, num_blocks - 1) * block_elems;
    };
    for (int64_t item = begin; item < end; ++item) {
      const int64_t pass = item / groups, m0 = item % groups * PASS_ROWS;
      const int64_t rows = std::min(PASS_ROWS, M - m0);
      const int64_t b0 = pass * PASS_BLOCKS;
      const Input *blocks[PASS_BLOCKS], *next[PASS_BLOCKS];
      pass_blocks(pass, blocks);
      // Only a decode step's few rows (one group of items) ask ahead: with more, a pass's later
      // items find its weights in L2 already. After the last chunk comes the next pass.
      const bool ask_ahead = groups == 1, next_pass = ask_ahead && item + 1 < end;
      if (next_pass) pass_blocks(item + 1, next);
      for (int64_t lo = 0; lo < steps; lo += CHUNK_STEPS) {
        const int64_t hi = std::min(steps, lo + CHUNK_STEPS);
        const Input* following[PASS_BLOCKS];
        const Input* const* ahead = nullptr;
        if (ask_ahead && hi < steps) {
          for (int64_t j = 0; j < PASS_BLOCKS; ++j) following[j] = blocks[j] + hi * ROW_ELEMS;
          ahead = following;
        } else if (next_pass) {
          ahead = next;
        }
        item_chunk<Step>(x + m0 * ldx, ldx, rows, blocks, lo, hi, sums, ahead);
      }
      const int64_t n0 = b0 * BLOCK;
      store(sums, rows, m0, n0, std::min(PASS_OUTPUTS, N - n0));
    }
  });
}

}  // namespace kvgraph_tiles
#endif
