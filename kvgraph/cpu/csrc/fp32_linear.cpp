// An fp32 linear layer on the CPU over a weight packed once in kvgraph's tile layout, for every
// batch size, by AVX-512 fused multiply-adds (tile_matmul.h).
//
// Why: on an AMD Zen 4, oneDNN's packed fp32 linear (the fastest of torch's) reads a decode
// step's weights at half the speed memory allows (one row: 8.4 ms for the small Llama's 98 MB,
// this kernel 4.1 ms; README, "fp32 linears"), and torch's call into it costs ~15 us before any
// arithmetic. The layout is an ordinary fp32 tensor [N / 16, K, 16]: element (b, k, j) is
// weight[16 b + j][k], so each input's weights for 16 outputs are one 64-byte row. N must be a
// multiple of 16; Python packs only such weights.

#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>
#include <vector>

#include "tile_matmul.h"

namespace {

constexpr int64_t BLOCK = 16;  // outputs per column block (one 64-byte weight row)

// Which paths this build has: 1 = AVX-512 fused multiply-adds, 0 = none (Python then leaves
// fp32 weights to oneDNN or plain).
int64_t fp32_linear_level() {
#if defined(__AVX512F__)
  return 1;
#else
  return 0;
#endif
}

#if defined(__AVX512F__)
// out[m0 + r][n0 : n0 + columns] = sums[r] + bias for r < rows (sums rows PASS_OUTPUTS apart).
void store_rows(const float* sums, int64_t rows, int64_t columns, const float* bias, float* out,
                int64_t ldo) {
  const __mmask16 all = 0xFFFF;
  for (int64_t r = 0; r < rows; ++r) {
    const float* s = sums + r * kvgraph_tiles::PASS_OUTPUTS;
    float* o = out + r * ldo;
    for (int64_t j = 0; j < columns; j += 16) {
      const __mmask16 mask = columns - j >= 16 ? all : __mmask16((1u << (columns - j)) - 1);
      __m512 v = _mm512_maskz_loadu_ps(mask, s + j);
      if (bias != nullptr) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, bias + j));
      _mm512_mask_storeu_ps(o + j, mask, v);
    }
  }
}
#endif

at::Tensor fp32_linear(const at::Tensor& x, const at::Tensor& packed,
                       const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(fp32_linear_level() > 0, "kvgraph_cpu.fp32_linear: this build has no AVX-512 "
              "(kvgraph packs fp32 weights this way only where it has)");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == BLOCK &&
                  packed.scalar_type() == at::kFloat && packed.is_contiguous(),
              "kvgraph_cpu.fp32_linear: expected a packed fp32 weight [N / 16, K, 16], got ",
              packed.scalar_type(), " ", packed.sizes());
  const int64_t K = packed.size(1), N = packed.size(0) * BLOCK;
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() >= 1 && x.size(-1) == K,
              "kvgraph_cpu.fp32_linear: expected fp32 x [..., ", K, "], got ", x.scalar_type(),
              " ", x.sizes());
  at::Tensor x2d = x.reshape({-1, K});
  if (x2d.stride(1) != 1) x2d = x2d.contiguous();
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  at::Tensor out = at::empty(shape, x.options());
  at::Tensor bias32;
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N, "kvgraph_cpu.fp32_linear: expected a "
                "bias [", N, "], got ", bias->sizes());
    bias32 = bias->to(at::kFloat).contiguous();
  }
#if defined(__AVX512F__)
  const float* b = bias32.defined() ? bias32.data_ptr<float>() : nullptr;
  float* o = out.data_ptr<float>();
  kvgraph_tiles::tile_matmul<kvgraph_tiles::Fp32Step>(
      x2d.data_ptr<float>(), x2d.stride(0), x2d.size(0), packed.data_ptr<float>(), N, K,
      [&](const float* sums, int64_t rows, int64_t m0, int64_t n0, int64_t columns) {
        store_rows(sums, rows, columns, b != nullptr ? b + n0 : nullptr, o + m0 * N + n0, N);
      });
#endif
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvgraph_cpu, m) {
  m.def("fp32_linear(Tensor x, Tensor packed, Tensor? bias) -> Tensor");
  m.def("fp32_linear_level() -> int");
}

TORCH_LIBRARY_IMPL(kvgraph_cpu, CPU, m) {
  m.impl("fp32_linear", &fp32_linear);
}

TORCH_LIBRARY_IMPL(kvgraph_cpu, CompositeExplicitAutograd, m) {
  m.impl("fp32_linear_level", &fp32_linear_level);
}
