// Paged attention on the CPU that reads kvgraph's block-table cache in place.
//
// Two ops in the `kvgraph_cpu` library (their fake kernels are registered from Python):
//   write_cache(rows [T, R], cache [N, B, ...], slot_mapping [T]): rows[t] -> slot t; -1 skips;
//   paged_attention(...): causal attention of each request's new tokens over its cached keys.
// Work is split over (request, block of QUERY_TILE query tokens, KV head) with at::parallel_for.
// Each item keeps one row per (token, query head of the KV head's group) and walks the keys it
// needs once, KEY_TILE at a time, with an online softmax: a tile's keys (gathered across blocks
// through the block table) are converted to fp32 and transposed once, then shared by every row
// (GQA and prefill reuse each key that way), and scores are computed across the tile's keys so
// the inner loops vectorise without horizontal sums (the tile arithmetic: attention_tiles.h).
// Accumulation is fp32 whatever the cache dtype. Only a request's real keys are read: stale rows
// past a sequence's end (which may hold NaN) never enter a sum.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "attention_tiles.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

using namespace kvgraph_cpu;

constexpr int64_t QUERY_TILE = 16;  // query tokens per work item: rows share each key tile
constexpr int64_t KEY_TILE = 64;  // keys converted and transposed at once, across blocks
constexpr int64_t NO_WINDOW = -1;

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }
inline float to_float(c10::Half x) { return static_cast<float>(x); }

// One operand's rows: element (token, head, d) lives at data[token * s0 + head * s1 + d].
struct Rows {
  const float* data;
  int64_t s0, s1, dim;
};

// One cache tensor [num_blocks, block_size, heads, dim], last dim contiguous.
template <typename T>
struct Cache {
  const T* data;
  int64_t s_block, s_slot, s_head, dim;
  const T* row(int64_t block, int64_t slot, int64_t head) const {
    return data + block * s_block + slot * s_slot + head * s_head;
  }
};

template <typename T>
Cache<T> cache_of(const at::Tensor& t) {
  return {t.data_ptr<T>(), t.stride(0), t.stride(1), t.stride(2), t.size(3)};
}

struct Work {
  int64_t request, first_token, num_tokens;
};

// What one batch is: requests, their lengths and blocks, and the attention parameters.
struct Batch {
  const int32_t* block_table;
  int64_t block_table_stride, block_table_columns, num_blocks;
  const int32_t* seq_lens;
  const int32_t* query_start_loc;
  int64_t block_size, num_heads, num_kv_heads, window;
  float scale;
};

template <typename T>
struct Kernel {
  Batch batch;
  Rows q1, q2;  // q2.dim == 0 without a second key part (MLA's rope part)
  Cache<T> k1, k2, v;
  float* out;
  int64_t out_s0, out_s1;

  // Keys [lo, lo + n) of request r, kv head h, into keys_t [kdim][n] and values [n][vdim].
  void gather(int64_t r, int64_t h, int64_t lo, int64_t n, float* keys_t, float* values) const {
    const int64_t bs = batch.block_size, vdim = v.dim;
    const int32_t* table = batch.block_table + r * batch.block_table_stride;
    for (int64_t k = 0; k < n; ++k) {
      const int64_t block = table[(lo + k) / bs], slot = (lo + k) % bs;
      TORCH_CHECK(block >= 0 && block < batch.num_blocks, "kvgraph_cpu.paged_attention: request ",
                  r, " reads block ", block, " of a cache with ", batch.num_blocks, " blocks");
      const T* a = k1.row(block, slot, h);
      for (int64_t d = 0; d < k1.dim; ++d) keys_t[d * n + k] = to_float(a[d]);
      if (q2.dim) {
        const T* b = k2.row(block, slot, h);
        for (int64_t d = 0; d < k2.dim; ++d) keys_t[(k1.dim + d) * n + k] = to_float(b[d]);
      }
      const T* c = v.row(block, slot, h);
      for (int64_t d = 0; d < vdim; ++d) values[k * vdim + d] = to_float(c[d]);
    }
  }

  // R rows of one token over a tile of n keys, of which it sees [see_lo, see_hi). Every
  // gathered key is a real one (< seq_len), so scoring the whole tile is safe.
  template <int R>
  void attend_rows(const float* q_rows, int64_t kdim, const float* keys_t, int64_t n,
                   const float* values, float* scores, int64_t see_lo, int64_t see_hi,
                   float* row_max, float* row_sum, float* acc) const {
    if (n == KEY_TILE) {
      score_rows<R, KEY_TILE>(q_rows, keys_t, kdim, scores);
    } else {
      score_rows_partial<R, KEY_TILE>(q_rows, keys_t, kdim, n, scores);
    }
    for (int r = 0; r < R; ++r) {
      softmax_update(scores + r * KEY_TILE, see_lo, see_hi, row_max[r], row_sum[r],
                     acc + r * v.dim, v.dim);
    }
    accumulate_rows<R>(scores, KEY_TILE, values, see_lo, see_hi, v.dim, acc);
  }

  void run(const Work& work, int64_t kv_head) const {
    const int64_t group = batch.num_heads / batch.num_kv_heads;
    const int64_t rows = work.num_tokens * group;
    const int64_t kdim = q1.dim + q2.dim, vdim = v.dim;
    const int64_t r = work.request;
    const int64_t seq_len = batch.seq_lens[r];
    const int64_t query_len = batch.query_start_loc[r + 1] - batch.query_start_loc[r];
    const int64_t first_pos = seq_len - query_len + work.first_token;  // of this item's token 0
    const int64_t token0 = batch.query_start_loc[r] + work.first_token;

    std::vector<float> q(rows * kdim), acc(rows * vdim, 0.f), keys_t(kdim * KEY_TILE),
        values(KEY_TILE * vdim), scores(2 * KEY_TILE);
    std::vector<float> row_max(rows, -std::numeric_limits<float>::infinity()), row_sum(rows, 0.f);
    for (int64_t i = 0; i < work.num_tokens; ++i) {
      for (int64_t g = 0; g < group; ++g) {
        const int64_t head = kv_head * group + g;
        float* dst = q.data() + (i * group + g) * kdim;
        const float* a = q1.data + (token0 + i) * q1.s0 + head * q1.s1;
        for (int64_t d = 0; d < q1.dim; ++d) dst[d] = a[d] * batch.scale;
        if (q2.dim) {
          const float* b = q2.data + (token0 + i) * q2.s0 + head * q2.s1;
          for (int64_t d = 0; d < q2.dim; ++d) dst[q1.dim + d] = b[d] * batch.scale;
        }
      }
    }

    int64_t first_key = 0;
    if (batch.window != NO_WINDOW) first_key = std::max<int64_t>(0, first_pos - batch.window + 1);
    const int64_t end_key = std::min(seq_len, first_pos + work.num_tokens);
    TORCH_CHECK(end_key <= batch.block_table_columns * batch.block_size,
                "kvgraph_cpu.paged_attention: request ", r, " has ", seq_len, " keys but its "
                "block table row holds ", batch.block_table_columns, " blocks of ",
                batch.block_size);
    for (int64_t lo = first_key; lo < end_key; lo += KEY_TILE) {
      const int64_t n = std::min(KEY_TILE, end_key - lo);
      gather(r, kv_head, lo, n, keys_t.data(), values.data());
      for (int64_t i = 0; i < work.num_tokens; ++i) {
        const int64_t pos = first_pos + i;
        // Keys this token sees in the tile: [see_lo, see_hi) relative to lo.
        int64_t see_lo = 0;
        const int64_t see_hi = std::min(n, pos - lo + 1);
        if (batch.window != NO_WINDOW) see_lo = std::max<int64_t>(0, pos - batch.window + 1 - lo);
        if (see_hi <= see_lo) continue;
        // Two rows (query heads) at a time: each key and value loaded serves both.
        for (int64_t g = 0; g < group; g += 2) {
          const int64_t row = i * group + g;
          if (g + 1 < group) {
            attend_rows<2>(q.data() + row * kdim, kdim, keys_t.data(), n, values.data(),
                           scores.data(), see_lo, see_hi, &row_max[row], &row_sum[row],
                           acc.data() + row * vdim);
          } else {
            attend_rows<1>(q.data() + row * kdim, kdim, keys_t.data(), n, values.data(),
                           scores.data(), see_lo, see_hi, &row_max[row], &row_sum[row],
                           acc.data() + row * vdim);
          }
        }
      }
    }

    for (int64_t i = 0; i < work.num_tokens; ++i) {
      for (int64_t g = 0; g < group; ++g) {
        const int64_t row = i * group + g;
        float* dst = out + (token0 + i) * out_s0 + (kv_head * group + g) * out_s1;
        // A row that sees no key (an empty request) comes out as zeros, as in torch_native.
        const float inv = row_sum[row] > 0.f ? 1.f / row_sum[row] : 0.f;
        for (int64_t d = 0; d < vdim; ++d) dst[d] = acc[row * vdim + d] * inv;
      }
    }
  }
};

Rows rows_of(const at::Tensor& t) {
  return {t.data_ptr<float>(), t.stride(0), t.stride(1), t.size(2)};
}

void check_index(const at::Tensor& t, const char* name, at::ScalarType dtype) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == dtype && t.stride(-1) == 1,
              "kvgraph_cpu: ", name, " must be a CPU ", c10::toString(dtype),
              " tensor with a contiguous last dim, got ", t.scalar_type(), " on ", t.device());
}

// query_rope/key_rope_cache: MLA's second key part (undefined for standard attention).
void paged_attention(const at::Tensor& query, const std::optional<at::Tensor>& query_rope,
                     const at::Tensor& key_cache, const std::optional<at::Tensor>& key_rope_cache,
                     const at::Tensor& value_cache, const at::Tensor& out,
                     const at::Tensor& block_table, const at::Tensor& seq_lens,
                     const at::Tensor& query_start_loc, double scale, int64_t sliding_window) {
  TORCH_CHECK(query.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat,
              "kvgraph_cpu.paged_attention: query and out must be float32, got ",
              query.scalar_type(), " and ", out.scalar_type());
  TORCH_CHECK(key_cache.dim() == 4 && value_cache.dim() == 4,
              "kvgraph_cpu.paged_attention: caches must be [num_blocks, block_size, heads, dim]");
  TORCH_CHECK(value_cache.scalar_type() == key_cache.scalar_type() &&
                  query_rope.has_value() == key_rope_cache.has_value() &&
                  (!key_rope_cache.has_value() ||
                   key_rope_cache->scalar_type() == key_cache.scalar_type()),
              "kvgraph_cpu.paged_attention: every cache must have the key cache's dtype ",
              key_cache.scalar_type(), ", and a rope query comes with a rope cache");
  check_index(block_table, "block_table", at::kInt);
  check_index(seq_lens, "seq_lens", at::kInt);
  check_index(query_start_loc, "query_start_loc", at::kInt);
  const int64_t num_tokens = query.size(0), num_reqs = seq_lens.size(0);
  Batch batch{block_table.data_ptr<int32_t>(), block_table.stride(0), block_table.size(1),
              key_cache.size(0), seq_lens.data_ptr<int32_t>(), query_start_loc.data_ptr<int32_t>(),
              key_cache.size(1), query.size(1), key_cache.size(2),
              sliding_window > 0 ? sliding_window : NO_WINDOW, static_cast<float>(scale)};

  std::vector<Work> work;
  for (int64_t r = 0; r < num_reqs; ++r) {
    const int64_t query_len = batch.query_start_loc[r + 1] - batch.query_start_loc[r];
    for (int64_t t = 0; t < query_len; t += QUERY_TILE) {
      work.push_back({r, t, std::min(QUERY_TILE, query_len - t)});
    }
  }
  // Padding tokens past the last request get zeros.
  const int64_t real_tokens = num_reqs ? batch.query_start_loc[num_reqs] : 0;
  float* out_data = out.data_ptr<float>();
  for (int64_t t = real_tokens; t < num_tokens; ++t) {
    for (int64_t h = 0; h < out.size(1); ++h) {
      std::fill_n(out_data + t * out.stride(0) + h * out.stride(1), out.size(2), 0.f);
    }
  }

  const int64_t items = static_cast<int64_t>(work.size()) * batch.num_kv_heads;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, key_cache.scalar_type(),
                                  "kvgraph_cpu.paged_attention", [&] {
    Rows rope{nullptr, 0, 0, 0};
    Cache<scalar_t> k2{nullptr, 0, 0, 0, 0};
    if (query_rope.has_value()) {
      rope = rows_of(*query_rope);
      k2 = cache_of<scalar_t>(*key_rope_cache);
    }
    Kernel<scalar_t> kernel{batch, rows_of(query), rope, cache_of<scalar_t>(key_cache), k2,
                            cache_of<scalar_t>(value_cache), out_data,
                            out.stride(0), out.stride(1)};
    at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
      for (int64_t item = begin; item < end; ++item) {
        kernel.run(work[item / batch.num_kv_heads], item % batch.num_kv_heads);
      }
    });
  });
}

void write_cache(const at::Tensor& rows, const at::Tensor& cache, const at::Tensor& slot_mapping) {
  check_index(slot_mapping, "slot_mapping", at::kLong);
  TORCH_CHECK(rows.dim() == 2 && rows.stride(1) == 1 && cache.is_contiguous() &&
                  rows.scalar_type() == cache.scalar_type() &&
                  rows.size(1) * cache.size(0) * cache.size(1) == cache.numel(),
              "kvgraph_cpu.write_cache: expected rows [T, row] of the cache's dtype and a "
              "contiguous cache [num_blocks, block_size, ...] of such rows");
  const int64_t row_bytes = rows.size(1) * rows.element_size();
  const int64_t num_slots = cache.size(0) * cache.size(1);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const char* src = static_cast<const char*>(rows.data_ptr());
  char* dst = static_cast<char*>(cache.data_ptr());
  const int64_t src_stride = rows.stride(0) * rows.element_size();
  for (int64_t t = 0; t < rows.size(0); ++t) {
    const int64_t slot = slots[t];
    if (slot < 0) continue;  // padding: nothing is written
    TORCH_CHECK(slot < num_slots, "kvgraph_cpu.write_cache: slot ", slot, " of token ", t,
                " is past the cache's ", num_slots, " slots");
    std::memcpy(dst + slot * row_bytes, src + t * src_stride, row_bytes);
  }
}

}  // namespace

TORCH_LIBRARY(kvgraph_cpu, m) {
  m.def("write_cache(Tensor rows, Tensor(a!) cache, Tensor slot_mapping) -> ()");
  m.def("paged_attention(Tensor query, Tensor? query_rope, Tensor key_cache, "
        "Tensor? key_rope_cache, Tensor value_cache, Tensor(a!) out, Tensor block_table, "
        "Tensor seq_lens, Tensor query_start_loc, float scale, int sliding_window) -> ()");
}

TORCH_LIBRARY_IMPL(kvgraph_cpu, CPU, m) {
  m.impl("write_cache", &write_cache);
  m.impl("paged_attention", &paged_attention);
}
