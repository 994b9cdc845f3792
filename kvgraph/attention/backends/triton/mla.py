"""Causal paged multi-head latent attention over `(kv_c_cache, k_pe_cache)`, with split-KV.

Every query head reads the same latent cache, so a program serves a block of heads at once:
each cached row is read once per head block, not once per head.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvgraph.attention.backends.triton.launch import (
    LaunchPlan,
    dot_block,
    dot_precision,
    step_launch_plan,
)
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
def _mla_attention_kernel(
    out_ptr, q_latent_ptr, q_pe_ptr, kv_c_cache_ptr, k_pe_cache_ptr, block_table_ptr,
    seq_lens_ptr, query_start_loc_ptr, scale, num_tokens, num_reqs, block_table_stride,
    q_token_stride, q_head_stride, pe_token_stride, pe_head_stride, out_token_stride,
    out_head_stride, partial_ptr, partial_stats_ptr,
    NUM_HEADS: tl.constexpr, HEADS: tl.constexpr, LATENT: tl.constexpr,
    LATENT_BLOCK: tl.constexpr, ROPE: tl.constexpr, ROPE_BLOCK: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, KEYS: tl.constexpr, REQS: tl.constexpr,
    NUM_SPLITS: tl.constexpr, BLOCK_Q: tl.constexpr, ROWS: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """One program per (block of one request's query tokens, block of HEADS heads, key split):
    causal MLA with scores `q_latent·kv_c + q_pe·k_pe` and output `softmax · kv_c` (in the
    latent space), as tensor-core dots over tiles of KEYS cached rows. With several splits
    each writes its part for the merge; programs past every request write zeros."""
    split = tl.program_id(2)
    request, tokens, heads, row_valid, positions, first_key, last_key = program_rows(
        tl.program_id(0), tl.program_id(1), split, query_start_loc_ptr, seq_lens_ptr,
        num_tokens, num_reqs, NO_WINDOW, NUM_HEADS, HEADS, NUM_SPLITS, BLOCK_Q, ROWS, REQS)
    q_latent = load_rows(q_latent_ptr, tokens, heads, q_token_stride, q_head_stride, row_valid,
                          LATENT, LATENT_BLOCK)
    q_pe = load_rows(q_pe_ptr, tokens, heads, pe_token_stride, pe_head_stride, row_valid, ROPE,
                      ROPE_BLOCK)
    latent = tl.arange(0, LATENT_BLOCK)
    rope = tl.arange(0, ROPE_BLOCK)
    row_max = tl.full((ROWS,), float("-inf"), tl.float32)
    row_sum = tl.zeros((ROWS,), tl.float32)
    acc = tl.zeros((ROWS, LATENT_BLOCK), tl.float32)
    offsets = tl.arange(0, KEYS)
    for start in range(first_key, last_key + 1, KEYS):
        key_positions = start + offsets
        in_range = key_positions <= last_key
        slots = key_slots(block_table_ptr, request, block_table_stride, key_positions, in_range,
                          BLOCK_SIZE)
        kv_c = tl.load(kv_c_cache_ptr + slots[:, None] * LATENT + latent[None, :],
                       mask=in_range[:, None] & (latent < LATENT)[None, :],
                       other=0.0).to(tl.float32)
        k_pe = tl.load(k_pe_cache_ptr + slots[:, None] * ROPE + rope[None, :],
                       mask=in_range[:, None] & (rope < ROPE)[None, :], other=0.0).to(tl.float32)
        scores = (tl.dot(q_latent, tl.trans(kv_c), input_precision=PRECISION)
                  + tl.dot(q_pe, tl.trans(k_pe), input_precision=PRECISION)) * scale
        visible = (row_valid[:, None] & in_range[None, :]
                   & (key_positions[None, :] <= positions[:, None]))
        row_max, row_sum, acc = softmax_tile(scores, visible, kv_c, row_max, row_sum, acc,
                                             PRECISION)
    store_rows(out_ptr, partial_ptr, partial_stats_ptr, acc, row_max, row_sum, tokens, heads,
               row_valid, out_token_stride, out_head_stride, split, NUM_HEADS, NUM_SPLITS,
               LATENT, LATENT_BLOCK)


def mla_attention(q_latent: torch.Tensor, q_pe: torch.Tensor, kv_c_cache: torch.Tensor,
                  k_pe_cache: torch.Tensor, out: torch.Tensor, metadata: AttentionMetadata,
                  scale: float, *, plan: LaunchPlan | None = None,
                  num_splits: int | None = None) -> None:
    """Causal paged MLA of `q_latent` `[T, H, L]` and `q_pe` `[T, H, R]`, into `out`.

    `plan` is the step's launch plan (default: the Triton backend's `step_plan(metadata)`).
    `num_splits` (a power of two) forces how many ranges each query's keys are split into,
    computed in parallel and merged after (flash-decoding); by default the plan chooses.
    """
    num_tokens, num_heads, latent = q_latent.shape
    if num_tokens == 0 or metadata.seq_lens.shape[0] == 0:
        out.zero_()
        return
    plan = plan or step_launch_plan(metadata)
    rope, block_size = q_pe.shape[-1], kv_c_cache.shape[1]
    launch = plan.mla(q_latent, num_splits)
    q_latent, q_pe = rows_contiguous(q_latent), rows_contiguous(q_pe)
    _mla_attention_kernel[launch.grid](
        out, q_latent, q_pe, kv_c_cache, k_pe_cache, metadata.block_table, metadata.seq_lens,
        metadata.query_start_loc, scale, num_tokens, metadata.seq_lens.shape[0],
        metadata.block_table.stride(0), *q_latent.stride()[:2], *q_pe.stride()[:2],
        *out.stride()[:2], *launch.partials(out),
        NUM_HEADS=num_heads, HEADS=launch.heads, LATENT=latent, LATENT_BLOCK=launch.row_block,
        ROPE=rope, ROPE_BLOCK=dot_block(rope), BLOCK_SIZE=block_size,
        PRECISION=dot_precision(kv_c_cache.dtype), **launch.constexprs(),
    )
    launch.finish(out)
