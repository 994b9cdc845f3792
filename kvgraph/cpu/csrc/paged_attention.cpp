// Paged attention on the CPU that reads kvgraph's block-table cache in place.
//
// Two ops in the `kvgraph_cpu` library (their fake kernels are registered from Python):
//   write_cache(rows [T, R], cache [N, B, ...], slot_mapping [T]): rows[t] -> slot t; -1 skips;
//   paged_attention(...): causal attention of each request's new tokens over its cached keys.
// Work is split over (request, block of QUERY_TILE query tokens, KV head) with at::parallel_for.
// Each item keeps one row per (token, query head of the KV head's group) and walks the keys it
// needs once, KEY_TILE at a time, with an online softmax: a tile's keys and values are read
// in place (a row pointer per key and key part, through the block table), widened to fp32 as
// they are loaded; the keys are transposed (MLA's two parts into one fp32 block), then
// shared by every row, ROW_BLOCK rows per pass (GQA's heads and prefill's tokens reuse
// each key that way); scores are computed across the tile's keys so the inner loops vectorise
// without horizontal sums (the tile arithmetic: attention_tiles.h). Queries and outputs are
// fp32 or the cache's dtype.
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
#include <type_traits>
#include <utility>
#include <vector>

namespace {

using namespace kvgraph_cpu;

constexpr int64_t QUERY_TILE = 16;  // query tokens per work item: rows share each key tile
constexpr int64_t KEY_TILE = 64;  // keys converted and transposed at once, across blocks
constexpr int ROW_BLOCK = 4;  // rows (query heads, tokens) sharing each key and value loaded
constexpr int64_t NO_WINDOW = -1;

template <typename T>
inline T from_float(float x) { return static_cast<T>(x); }

// One operand's rows: element (token, head, d) lives at data[token * s0 + head * s1 + d].
template <typename Q>
struct Rows {
  const Q* data;
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

// Asks for the cache lines of n elements at p: a later read finds them in cache.
template <typename T>
inline void prefetch_row(const T* p, int64_t n) {
  const char* bytes = reinterpret_cast<const char*>(p);
  const int64_t size = n * static_cast<int64_t>(sizeof(T));
  for (int64_t b = 0; b < size; b += 64) __builtin_prefetch(bytes + b);
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

// A tile's keys (and MLA's second key part, its rope keys) and values, a row each, where the
// cache holds them; keys past the tile's real ones (up to its width) point at zeros.
template <typename E>
struct TileRows {
  const E* keys[KEY_TILE];
  const E* keys2[KEY_TILE];
  const E* values[KEY_TILE];
  std::vector<E> zeros;
};

// A work item's fp32 buffers (its rows' queries and softmax state, one key tile) and a tile's
// rows, kept by a thread across its items so each item does not allocate its own.
template <typename T>
struct Scratch {
  std::vector<float> q, acc, row_max, row_sum, keys_t, scores;
  TileRows<T> tile;
};

// T: the caches' dtype; Q: the queries' and output's (float, or T itself).
template <typename T, typename Q>
struct Kernel {
  Batch batch;
  Rows<Q> q1, q2;  // q2.dim == 0 without a second key part (MLA's rope part)
  Cache<T> k1, k2, v;
  Q* out;
  int64_t out_s0, out_s1;

  // visit(k, block, slot) for the keys [lo, lo + n) of request r, k counted from lo.
  template <typename Visit>
  void for_each_slot(int64_t r, int64_t lo, int64_t n, Visit&& visit) const {
    const int64_t bs = batch.block_size;
    const int32_t* table = batch.block_table + r * batch.block_table_stride;
    for (int64_t k = 0; k < n;) {
      const int64_t block = table[(lo + k) / bs], first_slot = (lo + k) % bs;
      TORCH_CHECK(block >= 0 && block < batch.num_blocks, "kvgraph_cpu.paged_attention: request ",
                  r, " reads block ", block, " of a cache with ", batch.num_blocks, " blocks");
      const int64_t end = std::min(n, k + bs - first_slot);
      for (int64_t slot = first_slot; k < end; ++k, ++slot) visit(k, block, slot);
    }
  }

  // The rows of the tile [lo, lo + n) of request r, kv head h, `width` keys wide, in s.tile.
  void tile_rows(int64_t r, int64_t h, int64_t lo, int64_t n, int64_t width,
                 Scratch<T>& s) const {
    TileRows<T>& tile = s.tile;
    for_each_slot(r, lo, n, [&](int64_t k, int64_t block, int64_t slot) {
      tile.keys[k] = k1.row(block, slot, h);
      if (k2.dim) tile.keys2[k] = k2.row(block, slot, h);
      tile.values[k] = v.row(block, slot, h);
    });
    for (int64_t k = n; k < width; ++k) tile.keys[k] = tile.keys2[k] = tile.zeros.data();
  }

  // Prefetches what tile_rows(r, h, lo, n, ...) reads, so the next tile's rows arrive while this
  // one is computed (a decode step's cache comes from memory, each block from a new place).
  void prefetch(int64_t r, int64_t h, int64_t lo, int64_t n) const {
    const int64_t bs = batch.block_size;
    const int32_t* table = batch.block_table + r * batch.block_table_stride;
    for (int64_t k = lo; k < lo + n; ++k) {
      const int64_t block = table[k / bs], slot = k % bs;
      if (block < 0 || block >= batch.num_blocks) return;  // tile_rows reports it
      prefetch_row(k1.row(block, slot, h), k1.dim);
      if (k2.dim) prefetch_row(k2.row(block, slot, h), k2.dim);
      prefetch_row(v.row(block, slot, h), v.dim);
    }
  }

  // The position of the item's first token and the keys it reads, [first_key, end_key).
  struct Span {
    int64_t first_pos, first_key, end_key;
  };
  Span span(const Work& work) const {
    const int64_t r = work.request, seq_len = batch.seq_lens[r];
    const int64_t query_len = batch.query_start_loc[r + 1] - batch.query_start_loc[r];
    const int64_t first_pos = seq_len - query_len + work.first_token;
    int64_t first_key = 0;
    if (batch.window != NO_WINDOW) first_key = std::max<int64_t>(0, first_pos - batch.window + 1);
    return {first_pos, first_key, std::min(seq_len, first_pos + work.num_tokens)};
  }

  // R rows over the keys [see_lo, see_hi) of a tile `width` keys wide (its keys rounded up to
  // KEY_STEP with zeros; only real keys are ever visible).
  template <int R>
  void attend_rows(const float* q_rows, int64_t kdim, Scratch<T>& s, const T* const* values,
                   int64_t width, int64_t see_lo, int64_t see_hi, float* row_max, float* row_sum,
                   float* acc) const {
    static_assert(KEY_TILE == 4 * KEY_STEP, "the widths below are a tile's");
    float* scores = s.scores.data();
    const float* keys_t = s.keys_t.data();
    switch (width) {
      case KEY_STEP: score_rows<R, KEY_STEP>(q_rows, keys_t, kdim, scores, KEY_TILE); break;
      case 2 * KEY_STEP: score_rows<R, 2 * KEY_STEP>(q_rows, keys_t, kdim, scores, KEY_TILE); break;
      case 3 * KEY_STEP: score_rows<R, 3 * KEY_STEP>(q_rows, keys_t, kdim, scores, KEY_TILE); break;
      default: score_rows<R, KEY_TILE>(q_rows, keys_t, kdim, scores, KEY_TILE);
    }
    for (int r = 0; r < R; ++r) {
      softmax_update(scores + r * KEY_TILE, see_lo, see_hi, row_max[r], row_sum[r],
                     acc + r * v.dim, v.dim);
    }
    accumulate_rows<R>(scores, KEY_TILE, values, see_lo, see_hi, v.dim, acc);
  }

  // Rows [lo, hi), which all see the tile's keys [see_lo, see_hi): ROW_BLOCK at a time, so
  // each key and value loaded serves that many rows.
  void attend_run(int64_t lo, int64_t hi, int64_t kdim, Scratch<T>& s, const T* const* values,
                  int64_t width, int64_t see_lo, int64_t see_hi) const {
    const int64_t vdim = v.dim;
    auto rows = [&](auto block, int64_t row) {
      attend_rows<decltype(block)::value>(s.q.data() + row * kdim, kdim, s, values, width, see_lo,
                                          see_hi, &s.row_max[row], &s.row_sum[row],
                                          s.acc.data() + row * vdim);
    };
    int64_t row = lo;
    for (; row + ROW_BLOCK <= hi; row += ROW_BLOCK) {
      rows(std::integral_constant<int, ROW_BLOCK>{}, row);
    }
    if (row + 2 <= hi) rows(std::integral_constant<int, 2>{}, row), row += 2;
    if (row < hi) rows(std::integral_constant<int, 1>{}, row);
  }

  void load_queries(const Work& work, int64_t kv_head, int64_t group, int64_t token0,
                    float* q) const {
    const int64_t kdim = q1.dim + q2.dim;
    for (int64_t i = 0; i < work.num_tokens; ++i) {
      for (int64_t g = 0; g < group; ++g) {
        const int64_t head = kv_head * group + g;
        float* dst = q + (i * group + g) * kdim;
        const Q* a = q1.data + (token0 + i) * q1.s0 + head * q1.s1;
        for (int64_t d = 0; d < q1.dim; ++d) dst[d] = widen(a[d]) * batch.scale;
        if (q2.dim) {
          const Q* b = q2.data + (token0 + i) * q2.s0 + head * q2.s1;
          for (int64_t d = 0; d < q2.dim; ++d) dst[q1.dim + d] = widen(b[d]) * batch.scale;
        }
      }
    }
  }

  // One work item; `next` (or null) is the item this thread runs after it, whose first tile
  // is prefetched during this one's last.
  void run(const Work& work, int64_t kv_head, Scratch<T>& s, const Work* next,
           int64_t next_head) const {
    const int64_t group = batch.num_heads / batch.num_kv_heads;
    const int64_t rows = work.num_tokens * group;
    const int64_t kdim = q1.dim + q2.dim, vdim = v.dim;
    const int64_t r = work.request;
    const int64_t seq_len = batch.seq_lens[r];
    const auto [first_pos, first_key, end_key] = span(work);  // first_pos: token 0's
    const int64_t token0 = batch.query_start_loc[r] + work.first_token;

    s.q.resize(rows * kdim);
    s.acc.assign(rows * vdim, 0.f);
    s.row_max.assign(rows, -std::numeric_limits<float>::infinity());
    s.row_sum.assign(rows, 0.f);
    s.keys_t.resize(KEY_TILE * kdim);
    s.scores.resize(ROW_BLOCK * KEY_TILE);
    s.tile.zeros.assign(std::max(k1.dim, k2.dim), T(0.f));
    load_queries(work, kv_head, group, token0, s.q.data());

    TORCH_CHECK(end_key <= batch.block_table_columns * batch.block_size,
                "kvgraph_cpu.paged_attention: request ", r, " has ", seq_len, " keys but its "
                "block table row holds ", batch.block_table_columns, " blocks of ",
                batch.block_size);
    for (int64_t lo = first_key; lo < end_key; lo += KEY_TILE) {
      const int64_t n = std::min(KEY_TILE, end_key - lo);
      const int64_t width = (n + KEY_STEP - 1) / KEY_STEP * KEY_STEP;
      tile_rows(r, kv_head, lo, n, width, s);
      if (lo + KEY_TILE < end_key) {
        prefetch(r, kv_head, lo + KEY_TILE, std::min(KEY_TILE, end_key - lo - KEY_TILE));
      } else if (next != nullptr) {
        const Span after = span(*next);
        prefetch(next->request, next_head, after.first_key,
                 std::min(KEY_TILE, after.end_key - after.first_key));
      }
      attend_tile(s, work.num_tokens, group, first_pos, lo, n, width, kdim);
    }

    for (int64_t i = 0; i < work.num_tokens; ++i) {
      for (int64_t g = 0; g < group; ++g) {
        const int64_t row = i * group + g;
        Q* dst = out + (token0 + i) * out_s0 + (kv_head * group + g) * out_s1;
        // A row that sees no key (an empty request) comes out as zeros, as in torch_native.
        const float inv = s.row_sum[row] > 0.f ? 1.f / s.row_sum[row] : 0.f;
        for (int64_t d = 0; d < vdim; ++d) dst[d] = from_float<Q>(s.acc[row * vdim + d] * inv);
      }
    }
  }

  // An item's rows (`tokens` tokens from position first_pos) over the tile [lo, lo + n), `width`
  // keys wide: the keys transposed (a second key part below the first), then consecutive
  // tokens that see the same keys of the tile (all of it, before the causal diagonal) as one
  // run of rows (token i's: [i * group, (i + 1) * group)).
  void attend_tile(Scratch<T>& s, int64_t tokens, int64_t group, int64_t first_pos, int64_t lo,
                   int64_t n, int64_t width, int64_t kdim) const {
    const TileRows<T>& tile = s.tile;
    transpose_keys(tile.keys, width, k1.dim, s.keys_t.data());
    if (k2.dim) transpose_keys(tile.keys2, width, k2.dim, s.keys_t.data() + k1.dim * width);
    for (int64_t i = 0; i < tokens;) {
      const auto [see_lo, see_hi] = visible(first_pos + i, lo, n);
      int64_t j = i + 1;
      while (j < tokens && visible(first_pos + j, lo, n) == std::pair{see_lo, see_hi}) ++j;
      if (see_lo < see_hi) {
        attend_run(i * group, j * group, kdim, s, tile.values, width, see_lo, see_hi);
      }
      i = j;
    }
  }

  // The keys of the tile [lo, lo + n) the token at `pos` sees, relative to lo: causal, and
  // within the window if there is one.
  std::pair<int64_t, int64_t> visible(int64_t pos, int64_t lo, int64_t n) const {
    int64_t see_lo = 0;
    const int64_t see_hi = std::min(n, pos - lo + 1);
    if (batch.window != NO_WINDOW) see_lo = std::max<int64_t>(0, pos - batch.window + 1 - lo);
    return {see_lo, see_hi};
  }
};

template <typename Q>
Rows<Q> rows_of(const at::Tensor& t) {
  return {t.data_ptr<Q>(), t.stride(0), t.stride(1), t.size(2)};
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
  TORCH_CHECK((query.scalar_type() == at::kFloat ||
               query.scalar_type() == key_cache.scalar_type()) &&
                  out.scalar_type() == query.scalar_type() &&
                  (!query_rope.has_value() || query_rope->scalar_type() == query.scalar_type()),
              "kvgraph_cpu.paged_attention: query, query_rope and out must share one dtype, "
              "float32 or the cache's ", key_cache.scalar_type(), "; got ", query.scalar_type(),
              " and ", out.scalar_type());
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
  if (real_tokens < num_tokens) out.narrow(0, real_tokens, num_tokens - real_tokens).zero_();

  const int64_t items = static_cast<int64_t>(work.size()) * batch.num_kv_heads;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, key_cache.scalar_type(),
                                  "kvgraph_cpu.paged_attention", [&] {
    auto launch = [&](auto query_type) {
      using Q = decltype(query_type);
      Rows<Q> rope{nullptr, 0, 0, 0};
      Cache<scalar_t> k2{nullptr, 0, 0, 0, 0};
      if (query_rope.has_value()) {
        rope = rows_of<Q>(*query_rope);
        k2 = cache_of<scalar_t>(*key_rope_cache);
      }
      Kernel<scalar_t, Q> kernel{batch, rows_of<Q>(query), rope, cache_of<scalar_t>(key_cache),
                                 k2, cache_of<scalar_t>(value_cache), out.data_ptr<Q>(),
                                 out.stride(0), out.stride(1)};
      at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
        Scratch<scalar_t> scratch;  // one per thread's share: buffers reused across its items
        const int64_t heads = batch.num_kv_heads;
        for (int64_t item = begin; item < end; ++item) {
          const Work* next = item + 1 < end ? &work[(item + 1) / heads] : nullptr;
          kernel.run(work[item / heads], item % heads, scratch, next, (item + 1) % heads);
        }
      });
    };
    if (query.scalar_type() == at::kFloat) {
      launch(float{});
    } else if constexpr (!std::is_same_v<scalar_t, float>) {
      launch(scalar_t{});
    }
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
