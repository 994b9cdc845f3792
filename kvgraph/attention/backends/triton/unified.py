"""Causal paged attention (MHA/GQA/MQA, sliding window) for any batch, with split-KV."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvgraph.attention.backends.triton.paged import (
    block_q,
    key_slots,
    keys_per_tile,
    load_rows,
    merge_splits,
    num_kv_splits,
    program_rows,
    rows_contiguous,
    softmax_tile,
    split_buffers,
    store_rows,
)
from kvgraph.attention.metadata import AttentionMetadata


@triton.jit
def _unified_attention_kernel(
    out_ptr, query_ptr, key_cache_ptr, value_cache_ptr, block_table_ptr, seq_lens_ptr,
    query_start_loc_ptr, scale, num_tokens, num_reqs, block_table_stride, sliding_window,
    q_token_stride, q_head_stride, out_token_stride, out_head_stride,
    partial_ptr, partial_stats_ptr,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_SIZE: tl.constexpr,
    HEAD_BLOCK: tl.constexpr, BLOCK_SIZE: tl.constexpr, KEYS: tl.constexpr,
    REQS: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_Q: tl.constexpr, ROWS: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """One program per (block of one request's query tokens, KV head, key split): causal
    attention of every query head of the KV head's group, as `ROWS` = tokens x group rows,
    with tensor-core dots over tiles of `KEYS` cached keys. With one split it writes `out`;
    with several, each writes its part of the keys' partial softmax for `_merge_splits_kernel`
    (flash-decoding). Programs past every request's blocks write zeros for padding tokens."""
    GROUP: tl.constexpr = NUM_HEADS // NUM_KV_HEADS
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    request, tokens, heads, row_valid, positions, first_key, last_key = program_rows(
        tl.program_id(0), kv_head, split, query_start_loc_ptr, seq_lens_ptr, num_tokens,
        num_reqs, sliding_window, NUM_HEADS, GROUP, NUM_SPLITS, BLOCK_Q, ROWS, REQS)
    dims = tl.arange(0, HEAD_BLOCK)
    dim_mask = dims < HEAD_SIZE
    query = load_rows(query_ptr, tokens, heads, q_token_stride, q_head_stride, row_valid,
                      HEAD_SIZE, HEAD_BLOCK)
    row_max = tl.full((ROWS,), float("-inf"), tl.float32)
    row_sum = tl.zeros((ROWS,), tl.float32)
    acc = tl.zeros((ROWS, HEAD_BLOCK), tl.float32)
    offsets = tl.arange(0, KEYS)
    for start in range(first_key, last_key + 1, KEYS):
        key_positions = start + offsets
        in_range = key_positions <= last_key
        slots = (key_slots(block_table_ptr, request, block_table_stride, key_positions,
                           in_range, BLOCK_SIZE) * NUM_KV_HEADS + kv_head)
        kv_mask = in_range[:, None] & dim_mask[None, :]
        keys = tl.load(key_cache_ptr + slots[:, None] * HEAD_SIZE + dims[None, :], mask=kv_mask,
                       other=0.0).to(tl.float32)
        values = tl.load(value_cache_ptr + slots[:, None] * HEAD_SIZE + dims[None, :],
                         mask=kv_mask, other=0.0).to(tl.float32)
        scores = tl.dot(query, tl.trans(keys), input_precision=PRECISION) * scale
        distance = positions[:, None] - key_positions[None, :]
        visible = (row_valid[:, None] & in_range[None, :] & (distance >= 0)
                   & (distance < sliding_window))
        row_max, row_sum, acc = softmax_tile(scores, visible, values, row_max, row_sum, acc,
                                             PRECISION)
    store_rows(out_ptr, partial_ptr, partial_stats_ptr, acc, row_max, row_sum, tokens, heads,
               row_valid, out_token_stride, out_head_stride, split, NUM_HEADS, NUM_SPLITS,
               HEAD_SIZE, HEAD_BLOCK)


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
    group = num_heads // num_kv_heads
    tokens_per_program = block_q(metadata.max_query_len, group)
    # Enough programs for every request's blocks and the padding after them, from shapes only.
    programs = triton.cdiv(num_tokens, tokens_per_program) + num_reqs + 1
    splits = num_splits or num_kv_splits(
        triton.cdiv(num_tokens, tokens_per_program) * num_kv_heads, query.device)
    head_block = max(16, triton.next_power_of_2(head_size))  # tensor-core dots need 16
    partial, partial_stats = split_buffers(out, splits, head_block, metadata.workspace)
    query = rows_contiguous(query)
    _unified_attention_kernel[(programs, num_kv_heads, splits)](
        out, query, key_cache, value_cache, metadata.block_table, metadata.seq_lens,
        metadata.query_start_loc, scale, num_tokens, num_reqs, metadata.block_table.stride(0),
        sliding_window or 2**30, *query.stride()[:2], *out.stride()[:2], partial, partial_stats,
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_SIZE=head_size,
        HEAD_BLOCK=head_block, BLOCK_SIZE=block_size, KEYS=keys_per_tile(head_block),
        REQS=triton.next_power_of_2(num_reqs), NUM_SPLITS=splits, BLOCK_Q=tokens_per_program,
        ROWS=max(16, triton.next_power_of_2(tokens_per_program * group)),
        # fp32 dots: exact for an fp32 cache; TF32 holds a bf16 or fp16 cache's values exactly.
        PRECISION="ieee" if key_cache.dtype == torch.float32 else "tf32",
    )
    if splits > 1:
        merge_splits(out, partial, partial_stats)
