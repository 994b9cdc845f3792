"""Causal paged attention (MHA/GQA/MQA, sliding window) for any batch, with split-KV."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvgraph.attention.backends.triton.paged import (
    keys_per_tile,
    load_head_row,
    online_softmax_step,
    request_of,
    rows_contiguous,
    softmax_start,
    store_head_row,
)
from kvgraph.attention.metadata import AttentionMetadata


@triton.jit
def _unified_attention_kernel(
    out_ptr, query_ptr, key_cache_ptr, value_cache_ptr, block_table_ptr, seq_lens_ptr,
    query_start_loc_ptr, scale, num_reqs, block_table_stride, sliding_window,
    q_token_stride, q_head_stride, out_token_stride, out_head_stride,
    partial_ptr, partial_stats_ptr,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_SIZE: tl.constexpr,
    HEAD_BLOCK: tl.constexpr, BLOCK_SIZE: tl.constexpr, KEYS: tl.constexpr,
    REQS: tl.constexpr, NUM_SPLITS: tl.constexpr,
):
    """One program per (token, query head, key split): causal attention over its request's
    cached keys. With one split it writes `out`; with several, each writes its part of the
    keys' partial softmax for `_merge_splits_kernel` (flash-decoding)."""
    token = tl.program_id(0)
    head = tl.program_id(1)
    split = tl.program_id(2)
    kv_head = head // (NUM_HEADS // NUM_KV_HEADS)
    request, real, query_start, query_len = request_of(token, query_start_loc_ptr, num_reqs,
                                                        REQS)
    seq_len = tl.load(seq_lens_ptr + request)
    position = seq_len - query_len + (token - query_start)  # this token's place in its sequence
    # Scalar arithmetic, not tl.where: Triton 3.6's interpreter cannot loop to a tl.where.
    first_key = tl.maximum(position - sliding_window + 1, 0)
    last_key = position * real + real - 1  # inclusive; -1 (no key at all) for padding
    split_len = (tl.maximum(last_key - first_key + 1, 0) + NUM_SPLITS - 1) // NUM_SPLITS
    first_key = first_key + split * split_len
    last_key = tl.minimum(first_key + split_len - 1, last_key)

    dims = tl.arange(0, HEAD_BLOCK)
    dim_mask = dims < HEAD_SIZE
    query = load_head_row(query_ptr, token, head, q_token_stride, q_head_stride, HEAD_SIZE,
                          HEAD_BLOCK)
    row_max, row_sum, acc = softmax_start(HEAD_BLOCK)
    offsets = tl.arange(0, KEYS)
    for start in range(first_key, last_key + 1, KEYS):
        positions = start + offsets
        visible = positions <= last_key
        blocks = tl.load(block_table_ptr + request * block_table_stride + positions // BLOCK_SIZE,
                         mask=visible, other=0).to(tl.int64)
        rows = (blocks * BLOCK_SIZE + positions % BLOCK_SIZE) * NUM_KV_HEADS + kv_head
        kv_mask = visible[:, None] & dim_mask[None, :]
        keys = tl.load(key_cache_ptr + rows[:, None] * HEAD_SIZE + dims[None, :], mask=kv_mask,
                       other=0.0).to(tl.float32)
        scores = tl.where(visible, tl.sum(keys * query[None, :], axis=1) * scale, float("-inf"))
        values = tl.load(value_cache_ptr + rows[:, None] * HEAD_SIZE + dims[None, :], mask=kv_mask,
                         other=0.0).to(tl.float32)
        row_max, row_sum, acc = online_softmax_step(scores, values, row_max, row_sum, acc)
    if NUM_SPLITS == 1:
        result = acc / tl.maximum(row_sum, 1e-30)  # no visible key: zeros, never NaN
        store_head_row(out_ptr, result, token, head, out_token_stride, out_head_stride,
                       HEAD_SIZE, HEAD_BLOCK)
    else:
        part = (token * NUM_HEADS + head) * NUM_SPLITS + split
        tl.store(partial_ptr + part * HEAD_BLOCK + dims, acc)
        tl.store(partial_stats_ptr + part * 2, row_max)
        tl.store(partial_stats_ptr + part * 2 + 1, row_sum)


@triton.jit
def _merge_splits_kernel(out_ptr, partial_ptr, partial_stats_ptr, out_token_stride,
                         out_head_stride, NUM_HEADS: tl.constexpr, HEAD_SIZE: tl.constexpr,
                         HEAD_BLOCK: tl.constexpr, NUM_SPLITS: tl.constexpr):
    """One program per (token, head): the softmax over all keys from its splits' parts."""
    token = tl.program_id(0)
    head = tl.program_id(1)
    parts = (token * NUM_HEADS + head) * NUM_SPLITS + tl.arange(0, NUM_SPLITS)
    maxima = tl.load(partial_stats_ptr + parts * 2)
    sums = tl.load(partial_stats_ptr + parts * 2 + 1)
    top = tl.max(maxima, axis=0)
    top = tl.where(top == float("-inf"), 0.0, top)  # no key in any split: all weights 0
    weights = tl.exp(maxima - top)
    dims = tl.arange(0, HEAD_BLOCK)
    accs = tl.load(partial_ptr + parts[:, None] * HEAD_BLOCK + dims[None, :])
    total = tl.sum(weights * sums, axis=0)
    result = tl.sum(weights[:, None] * accs, axis=0) / tl.maximum(total, 1e-30)
    store_head_row(out_ptr, result, token, head, out_token_stride, out_head_stride, HEAD_SIZE,
                   HEAD_BLOCK)


def num_kv_splits(num_tokens: int, num_heads: int, device: torch.device) -> int:
    """How many key ranges each (token, head) is split into: on a GPU several when the batch
    alone cannot fill it (long-context decode), else one; on the interpreter one (splits buy
    parallelism it does not have). Shapes only, so a captured graph keeps its choice."""
    if device.type != "cuda" or num_tokens * num_heads >= 1024:
        return 1
    return 8


def unified_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                      out: torch.Tensor, metadata: AttentionMetadata, scale: float,
                      sliding_window: int | None, num_splits: int | None = None) -> None:
    """Causal paged attention of `query` `[T, H, D]` over the caches, into `out`.

    `num_splits` (a power of two; default `num_kv_splits`) splits each query's keys into
    ranges computed in parallel and merged after (flash-decoding).
    """
    num_tokens, num_heads, head_size = query.shape
    num_reqs = metadata.seq_lens.shape[0]
    if num_tokens == 0 or num_reqs == 0:
        out.zero_()
        return
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    block_table = metadata.block_table
    query = rows_contiguous(query)
    splits = num_splits or num_kv_splits(num_tokens, num_heads, query.device)
    head_block = triton.next_power_of_2(head_size)
    partial = partial_stats = out  # unused with one split
    if splits > 1:
        partial = torch.empty(num_tokens, num_heads, splits, head_block, dtype=torch.float32,
                              device=query.device)
        partial_stats = torch.empty(num_tokens, num_heads, splits, 2, dtype=torch.float32,
                                    device=query.device)
    _unified_attention_kernel[(num_tokens, num_heads, splits)](
        out, query, key_cache, value_cache, block_table, metadata.seq_lens,
        metadata.query_start_loc, scale, num_reqs, block_table.stride(0),
        sliding_window or 2**30, *query.stride()[:2], *out.stride()[:2], partial, partial_stats,
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_SIZE=head_size,
        HEAD_BLOCK=head_block, BLOCK_SIZE=block_size, KEYS=keys_per_tile(block_size),
        REQS=triton.next_power_of_2(num_reqs), NUM_SPLITS=splits,
    )
    if splits > 1:
        _merge_splits_kernel[(num_tokens, num_heads)](
            out, partial, partial_stats, *out.stride()[:2], NUM_HEADS=num_heads,
            HEAD_SIZE=head_size, HEAD_BLOCK=head_block, NUM_SPLITS=splits,
        )
