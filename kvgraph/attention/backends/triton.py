"""Paged attention in Triton kernels: the cache write and unified attention for any batch.

Both kernels take sequence lengths, query offsets and block tables as device tensors and never
sync with the host, and their launch grids depend only on tensor shapes (tokens, heads), never
on a batch's contents. Each attention program reads only its request's real keys, so its cost
does not depend on `max_model_len`. Accumulation is fp32 with an online softmax.

Under `TRITON_INTERPRET=1` Triton runs the kernels on CPU tensors: that is how CI tests them.
MLA and encoder-only attention still run the reference torch code (see `TritonBackend`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvgraph.attention.backends.base import GraphSupport
from kvgraph.attention.backends.torch_native import TorchNativeBackend
from kvgraph.attention.metadata import AttentionMetadata


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (`TRITON_INTERPRET=1`)."""
    knobs = getattr(triton, "knobs", None)
    return bool(knobs is not None and knobs.runtime.interpret)


@triton.jit
def _write_rows_kernel(cache_ptr, values_ptr, slot_mapping_ptr, row_size, values_stride,
                       ROW: tl.constexpr):
    """Row `values[t]` into cache row `slot_mapping[t]`; slot -1 (padding) writes nothing."""
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token)
    cols = tl.arange(0, ROW)
    mask = cols < tl.where(slot >= 0, row_size, 0)
    row = tl.load(values_ptr + token * values_stride + cols, mask=mask)
    target = tl.maximum(slot, 0).to(tl.int64) * row_size
    tl.store(cache_ptr + target + cols, row.to(cache_ptr.dtype.element_ty), mask=mask)


def write_rows(cache: torch.Tensor, values: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write `values` `[T, *row]` into `cache` `[num_blocks, block_size, *row]` at the slots."""
    num_tokens = values.shape[0]
    if num_tokens == 0:
        return
    values = values.reshape(num_tokens, -1)
    if values.stride(1) != 1:
        values = values.contiguous()
    row_size = values.shape[1]
    _write_rows_kernel[(num_tokens,)](cache, values, slot_mapping, row_size, values.stride(0),
                                      ROW=triton.next_power_of_2(row_size))


@triton.jit
def _unified_attention_kernel(
    out_ptr, query_ptr, key_cache_ptr, value_cache_ptr, block_table_ptr, seq_lens_ptr,
    query_start_loc_ptr, scale, num_reqs, block_table_stride, sliding_window,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_SIZE: tl.constexpr,
    HEAD_BLOCK: tl.constexpr, BLOCK_SIZE: tl.constexpr, KEYS: tl.constexpr,
    REQS: tl.constexpr,
):
    """One program per (token, query head): causal attention over its request's cached keys."""
    token = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // (NUM_HEADS // NUM_KV_HEADS)

    # The request of this token: how many requests end at or before it.
    reqs = tl.arange(0, REQS)
    ends = tl.load(query_start_loc_ptr + 1 + reqs, mask=reqs < num_reqs, other=2**30)
    request = tl.sum((ends <= token).to(tl.int32), axis=0)
    is_real = request < num_reqs  # tokens past the last request are padding
    request = tl.minimum(request, num_reqs - 1)
    query_start = tl.load(query_start_loc_ptr + request)
    query_len = tl.load(query_start_loc_ptr + request + 1) - query_start
    seq_len = tl.load(seq_lens_ptr + request)
    position = seq_len - query_len + (token - query_start)  # this token's place in its sequence
    # Scalar arithmetic, not tl.where: Triton 3.6's interpreter cannot loop to a tl.where.
    first_key = tl.maximum(position - sliding_window + 1, 0)
    real = is_real.to(tl.int32)
    last_key = position * real + real - 1  # inclusive; -1 (no key at all) for padding

    dims = tl.arange(0, HEAD_BLOCK)
    dim_mask = dims < HEAD_SIZE
    query = tl.load(query_ptr + (token * NUM_HEADS + head) * HEAD_SIZE + dims, mask=dim_mask,
                    other=0.0).to(tl.float32)
    row_max = tl.full((), float("-inf"), tl.float32)
    row_sum = tl.zeros((), tl.float32)
    acc = tl.zeros((HEAD_BLOCK,), tl.float32)
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
        scores = tl.sum(keys * query[None, :], axis=1) * scale
        scores = tl.where(visible, scores, float("-inf"))
        new_max = tl.maximum(row_max, tl.max(scores, axis=0))
        correction = tl.exp(row_max - new_max)
        weights = tl.exp(scores - new_max)
        values = tl.load(value_cache_ptr + rows[:, None] * HEAD_SIZE + dims[None, :], mask=kv_mask,
                         other=0.0).to(tl.float32)
        acc = acc * correction + tl.sum(weights[:, None] * values, axis=0)
        row_sum = row_sum * correction + tl.sum(weights, axis=0)
        row_max = new_max
    result = acc / tl.maximum(row_sum, 1e-30)  # no visible key: zeros, never NaN
    tl.store(out_ptr + (token * NUM_HEADS + head) * HEAD_SIZE + dims,
             result.to(out_ptr.dtype.element_ty), mask=dim_mask)


def unified_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                      out: torch.Tensor, metadata: AttentionMetadata, scale: float,
                      sliding_window: int | None) -> None:
    """Causal paged attention of `query` `[T, H, D]` over the caches, into `out`."""
    num_tokens, num_heads, head_size = query.shape
    num_reqs = metadata.seq_lens.shape[0]
    if num_tokens == 0 or num_reqs == 0:
        out.zero_()
        return
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    block_table = metadata.block_table
    _unified_attention_kernel[(num_tokens, num_heads)](
        out, query.contiguous(), key_cache, value_cache, block_table, metadata.seq_lens,
        metadata.query_start_loc, scale, num_reqs, block_table.stride(0),
        sliding_window or 2**30,
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_SIZE=head_size,
        HEAD_BLOCK=triton.next_power_of_2(head_size), BLOCK_SIZE=block_size,
        KEYS=max(16, min(64, triton.next_power_of_2(block_size))),
        REQS=triton.next_power_of_2(num_reqs),
    )


class TritonBackend(TorchNativeBackend):
    """Triton kernels for the cache write and standard (MHA/GQA/MQA) attention.

    MLA and encoder-only attention are inherited from the reference backend for now; until they
    have kernels too, full graphs are declared for uniform-decode batches only.
    """

    name = "triton"
    graph_support = GraphSupport.UNIFORM_DECODE
    device_types = ("cuda", "cpu") if interpreting() else ("cuda",)

    def forward(self, query, key, value, kv_cache, out, metadata, scale, sliding_window,
                write_kv=True):
        key_cache, value_cache = kv_cache
        if write_kv:
            write_rows(key_cache, key, metadata.slot_mapping)
            write_rows(value_cache, value, metadata.slot_mapping)
        unified_attention(query, key_cache, value_cache, out, metadata, scale, sliding_window)
