"""Encoder-only attention: bidirectional within each request's new tokens, no cache."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvgraph.attention.backends.triton.paged import (
    NO_WINDOW,
    load_head_row,
    online_softmax_step,
    request_of,
    rows_contiguous,
    softmax_start,
    store_head_row,
)
from kvgraph.attention.metadata import AttentionMetadata

# Keys per tile: a program holds one query row, so its scores are a sum over the tile, not a dot
# (no tensor-core minimum), and a small tile keeps its registers few.
ENCODER_KEYS = 16


@triton.jit
def _encoder_attention_kernel(
    out_ptr, query_ptr, key_ptr, value_ptr, query_start_loc_ptr, scale, num_reqs,
    sliding_window, q_token_stride, q_head_stride, out_token_stride, out_head_stride,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
    HEAD_SIZE: tl.constexpr, HEAD_BLOCK: tl.constexpr, KEYS: tl.constexpr, REQS: tl.constexpr,
):
    """One program per (token, head): bidirectional attention within the token's request (its
    new tokens only, no cache), key j visible when |i - j| < sliding_window."""
    token = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // (NUM_HEADS // NUM_KV_HEADS)
    request, real, query_start, query_len = request_of(token, query_start_loc_ptr, num_reqs,
                                                        REQS)
    first_key = tl.maximum(token - sliding_window + 1, query_start)
    last_key = (tl.minimum(token + sliding_window, query_start + query_len) - 1) * real \
        + (real - 1) * NO_WINDOW  # padding: an empty range

    dims = tl.arange(0, HEAD_BLOCK)
    dim_mask = dims < HEAD_SIZE
    query = load_head_row(query_ptr, token, head, q_token_stride, q_head_stride, HEAD_SIZE,
                          HEAD_BLOCK)
    row_max, row_sum, acc = softmax_start(HEAD_BLOCK)
    offsets = tl.arange(0, KEYS)
    for start in range(first_key, last_key + 1, KEYS):
        rows = start + offsets
        visible = rows <= last_key
        kv_mask = visible[:, None] & dim_mask[None, :]
        addresses = ((rows * NUM_KV_HEADS + kv_head) * HEAD_SIZE)[:, None] + dims[None, :]
        keys = tl.load(key_ptr + addresses, mask=kv_mask, other=0.0).to(tl.float32)
        scores = tl.where(visible, tl.sum(keys * query[None, :], axis=1) * scale, float("-inf"))
        values = tl.load(value_ptr + addresses, mask=kv_mask, other=0.0).to(tl.float32)
        row_max, row_sum, acc = online_softmax_step(scores, values, row_max, row_sum, acc)
    store_head_row(out_ptr, acc / tl.maximum(row_sum, 1e-30), token, head, out_token_stride,
                   out_head_stride, HEAD_SIZE, HEAD_BLOCK)


def encoder_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      out: torch.Tensor, metadata: AttentionMetadata, scale: float,
                      sliding_window: int | None) -> None:
    """Bidirectional attention within each request's new tokens, into `out`."""
    num_tokens, num_heads, head_size = query.shape
    num_reqs = metadata.query_start_loc.shape[0] - 1
    if num_tokens == 0 or num_reqs == 0:
        out.zero_()
        return
    query = rows_contiguous(query)
    _encoder_attention_kernel[(num_tokens, num_heads)](
        out, query, key.contiguous(), value.contiguous(), metadata.query_start_loc,
        scale, num_reqs, sliding_window or NO_WINDOW.value, *query.stride()[:2],
        *out.stride()[:2], NUM_HEADS=num_heads, NUM_KV_HEADS=key.shape[1], HEAD_SIZE=head_size,
        HEAD_BLOCK=triton.next_power_of_2(head_size), KEYS=ENCODER_KEYS,
        REQS=triton.next_power_of_2(num_reqs),
    )
