"""Causal paged multi-head latent attention over `(kv_c_cache, k_pe_cache)`."""

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
def _mla_attention_kernel(
    out_ptr, q_latent_ptr, q_pe_ptr, kv_c_cache_ptr, k_pe_cache_ptr, block_table_ptr,
    seq_lens_ptr, query_start_loc_ptr, scale, num_reqs, block_table_stride,
    q_token_stride, q_head_stride, pe_token_stride, pe_head_stride, out_token_stride,
    out_head_stride, NUM_HEADS: tl.constexpr, LATENT: tl.constexpr, LATENT_BLOCK: tl.constexpr,
    ROPE: tl.constexpr, ROPE_BLOCK: tl.constexpr, BLOCK_SIZE: tl.constexpr, KEYS: tl.constexpr,
    REQS: tl.constexpr,
):
    """One program per (token, head): causal MLA, scores `q_latent·kv_c + q_pe·k_pe`, output
    `softmax · kv_c` (in the latent space)."""
    token = tl.program_id(0)
    head = tl.program_id(1)
    request, real, query_start, query_len = request_of(token, query_start_loc_ptr, num_reqs,
                                                        REQS)
    seq_len = tl.load(seq_lens_ptr + request)
    last_key = (seq_len - query_len + token - query_start) * real + real - 1

    latent = tl.arange(0, LATENT_BLOCK)
    latent_mask = latent < LATENT
    rope = tl.arange(0, ROPE_BLOCK)
    rope_mask = rope < ROPE
    q_latent = load_head_row(q_latent_ptr, token, head, q_token_stride, q_head_stride, LATENT,
                             LATENT_BLOCK)
    q_pe = load_head_row(q_pe_ptr, token, head, pe_token_stride, pe_head_stride, ROPE, ROPE_BLOCK)
    row_max, row_sum, acc = softmax_start(LATENT_BLOCK)
    offsets = tl.arange(0, KEYS)
    for start in range(0, last_key + 1, KEYS):
        positions = start + offsets
        visible = positions <= last_key
        blocks = tl.load(block_table_ptr + request * block_table_stride + positions // BLOCK_SIZE,
                         mask=visible, other=0).to(tl.int64)
        slots = blocks * BLOCK_SIZE + positions % BLOCK_SIZE
        kv_c = tl.load(kv_c_cache_ptr + slots[:, None] * LATENT + latent[None, :],
                       mask=visible[:, None] & latent_mask[None, :], other=0.0).to(tl.float32)
        k_pe = tl.load(k_pe_cache_ptr + slots[:, None] * ROPE + rope[None, :],
                       mask=visible[:, None] & rope_mask[None, :], other=0.0).to(tl.float32)
        scores = (tl.sum(kv_c * q_latent[None, :], axis=1)
                  + tl.sum(k_pe * q_pe[None, :], axis=1)) * scale
        scores = tl.where(visible, scores, float("-inf"))
        row_max, row_sum, acc = online_softmax_step(scores, kv_c, row_max, row_sum, acc)
    store_head_row(out_ptr, acc / tl.maximum(row_sum, 1e-30), token, head, out_token_stride,
                   out_head_stride, LATENT, LATENT_BLOCK)


def mla_attention(q_latent: torch.Tensor, q_pe: torch.Tensor, kv_c_cache: torch.Tensor,
                  k_pe_cache: torch.Tensor, out: torch.Tensor, metadata: AttentionMetadata,
                  scale: float) -> None:
    """Causal paged MLA of `q_latent` `[T, H, L]` and `q_pe` `[T, H, R]`, into `out`."""
    num_tokens, num_heads, latent = q_latent.shape
    num_reqs = metadata.seq_lens.shape[0]
    if num_tokens == 0 or num_reqs == 0:
        out.zero_()
        return
    rope, block_size = q_pe.shape[-1], kv_c_cache.shape[1]
    q_latent, q_pe = rows_contiguous(q_latent), rows_contiguous(q_pe)
    _mla_attention_kernel[(num_tokens, num_heads)](
        out, q_latent, q_pe, kv_c_cache, k_pe_cache, metadata.block_table, metadata.seq_lens,
        metadata.query_start_loc, scale, num_reqs, metadata.block_table.stride(0),
        *q_latent.stride()[:2], *q_pe.stride()[:2], *out.stride()[:2], NUM_HEADS=num_heads,
        LATENT=latent,
        LATENT_BLOCK=triton.next_power_of_2(latent), ROPE=rope,
        ROPE_BLOCK=triton.next_power_of_2(rope), BLOCK_SIZE=block_size,
        KEYS=keys_per_tile(block_size), REQS=triton.next_power_of_2(num_reqs),
    )
