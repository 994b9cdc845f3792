"""Causal paged attention (MHA/GQA/MQA, sliding window) for any batch, with split-KV."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvgraph.attention.backends.triton.launch import LaunchPlan, dot_precision, step_launch_plan
from kvgraph.attention.backends.triton.paged import (
    NO_WINDOW,
    key_slots,
    load_rows,
    program_rows,
    rows_contiguous,
    softmax_tile,
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
                      sliding_window: int | None, *, plan: LaunchPlan | None = None,
                      num_splits: int | None = None) -> None:
    """Causal paged attention of `query` `[T, H, D]` over the caches, into `out`.

    `plan` is the step's launch plan (default: the Triton backend's `step_plan(metadata)`).
    `num_splits` (a power of two) forces how many ranges each query's keys are split into,
    computed in parallel and merged after (flash-decoding); by default the plan chooses.
    """
    num_tokens, num_heads, head_size = query.shape
    if num_tokens == 0 or metadata.seq_lens.shape[0] == 0:
        out.zero_()
        return
    plan = plan or step_launch_plan(metadata)
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    launch = plan.unified(query, num_kv_heads, num_splits)
    query = rows_contiguous(query)
    _unified_attention_kernel[launch.grid](
        out, query, key_cache, value_cache, metadata.block_table, metadata.seq_lens,
        metadata.query_start_loc, scale, num_tokens, metadata.seq_lens.shape[0],
        metadata.block_table.stride(0), sliding_window or NO_WINDOW.value, *query.stride()[:2],
        *out.stride()[:2], *launch.partials(out),
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_SIZE=head_size,
        HEAD_BLOCK=launch.row_block, BLOCK_SIZE=block_size,
        PRECISION=dot_precision(key_cache.dtype), **launch.constexprs(),
    )
    launch.finish(out)
