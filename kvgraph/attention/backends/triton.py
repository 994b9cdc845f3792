"""Paged attention in Triton kernels: the cache write, and unified, MLA and encoder attention.

The kernels take sequence lengths, query offsets and block tables as device tensors and never
sync with the host, and their launch grids depend only on tensor shapes (tokens, heads), never
on a batch's contents: full graphs can hold any batch. Each program (one token, one head) reads
only its request's real keys, so its cost does not depend on `max_model_len`. Accumulation is
fp32 with an online softmax; padding tokens and requests without keys produce zeros.

Under `TRITON_INTERPRET=1` Triton runs the kernels on CPU tensors: that is how CI tests them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvgraph.attention.backends.base import GraphSupport
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
def _request_of(token, query_start_loc_ptr, num_reqs, REQS: tl.constexpr):
    """The request `token` belongs to, whether it is real (1) or padding (0), its query start
    and length."""
    reqs = tl.arange(0, REQS)
    ends = tl.load(query_start_loc_ptr + 1 + reqs, mask=reqs < num_reqs, other=2**30)
    request = tl.sum((ends <= token).to(tl.int32), axis=0)  # requests that end at or before it
    real = (request < num_reqs).to(tl.int32)  # tokens past the last request are padding
    request = tl.minimum(request, num_reqs - 1)
    query_start = tl.load(query_start_loc_ptr + request)
    query_len = tl.load(query_start_loc_ptr + request + 1) - query_start
    return request, real, query_start, query_len


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
    request, real, query_start, query_len = _request_of(token, query_start_loc_ptr, num_reqs,
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
    query = tl.load(query_ptr + token * q_token_stride + head * q_head_stride + dims,
                    mask=dim_mask, other=0.0).to(tl.float32)
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
        scores = tl.where(visible, tl.sum(keys * query[None, :], axis=1) * scale, float("-inf"))
        values = tl.load(value_cache_ptr + rows[:, None] * HEAD_SIZE + dims[None, :], mask=kv_mask,
                         other=0.0).to(tl.float32)
        row_max, row_sum, acc = _online_softmax_step(scores, values, row_max, row_sum, acc)
    if NUM_SPLITS == 1:
        result = acc / tl.maximum(row_sum, 1e-30)  # no visible key: zeros, never NaN
        tl.store(out_ptr + token * out_token_stride + head * out_head_stride + dims,
                 result.to(out_ptr.dtype.element_ty), mask=dim_mask)
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
    tl.store(out_ptr + token * out_token_stride + head * out_head_stride + dims,
             result.to(out_ptr.dtype.element_ty), mask=dims < HEAD_SIZE)


@triton.jit
def _online_softmax_step(scores, values, row_max, row_sum, acc):
    """Fold one tile of scores `[KEYS]` and values `[KEYS, D]` into the running softmax."""
    new_max = tl.maximum(row_max, tl.max(scores, axis=0))
    correction = tl.exp(row_max - new_max)
    weights = tl.exp(scores - new_max)
    acc = acc * correction + tl.sum(weights[:, None] * values, axis=0)
    row_sum = row_sum * correction + tl.sum(weights, axis=0)
    return new_max, row_sum, acc


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
    request, real, query_start, query_len = _request_of(token, query_start_loc_ptr, num_reqs,
                                                        REQS)
    seq_len = tl.load(seq_lens_ptr + request)
    last_key = (seq_len - query_len + token - query_start) * real + real - 1

    latent = tl.arange(0, LATENT_BLOCK)
    latent_mask = latent < LATENT
    rope = tl.arange(0, ROPE_BLOCK)
    rope_mask = rope < ROPE
    q_latent = tl.load(q_latent_ptr + token * q_token_stride + head * q_head_stride + latent,
                       mask=latent_mask, other=0.0).to(tl.float32)
    q_pe = tl.load(q_pe_ptr + token * pe_token_stride + head * pe_head_stride + rope,
                   mask=rope_mask, other=0.0).to(tl.float32)
    row_max = tl.full((), float("-inf"), tl.float32)
    row_sum = tl.zeros((), tl.float32)
    acc = tl.zeros((LATENT_BLOCK,), tl.float32)
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
        row_max, row_sum, acc = _online_softmax_step(scores, kv_c, row_max, row_sum, acc)
    result = acc / tl.maximum(row_sum, 1e-30)
    tl.store(out_ptr + token * out_token_stride + head * out_head_stride + latent,
             result.to(out_ptr.dtype.element_ty), mask=latent_mask)


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
    request, real, query_start, query_len = _request_of(token, query_start_loc_ptr, num_reqs,
                                                        REQS)
    first_key = tl.maximum(token - sliding_window + 1, query_start)
    last_key = (tl.minimum(token + sliding_window, query_start + query_len) - 1) * real \
        + (real - 1) * (2**30)  # padding: an empty range

    dims = tl.arange(0, HEAD_BLOCK)
    dim_mask = dims < HEAD_SIZE
    query = tl.load(query_ptr + token * q_token_stride + head * q_head_stride + dims,
                    mask=dim_mask, other=0.0).to(tl.float32)
    row_max = tl.full((), float("-inf"), tl.float32)
    row_sum = tl.zeros((), tl.float32)
    acc = tl.zeros((HEAD_BLOCK,), tl.float32)
    offsets = tl.arange(0, KEYS)
    for start in range(first_key, last_key + 1, KEYS):
        rows = start + offsets
        visible = rows <= last_key
        kv_mask = visible[:, None] & dim_mask[None, :]
        addresses = ((rows * NUM_KV_HEADS + kv_head) * HEAD_SIZE)[:, None] + dims[None, :]
        keys = tl.load(key_ptr + addresses, mask=kv_mask, other=0.0).to(tl.float32)
        scores = tl.where(visible, tl.sum(keys * query[None, :], axis=1) * scale, float("-inf"))
        values = tl.load(value_ptr + addresses, mask=kv_mask, other=0.0).to(tl.float32)
        row_max, row_sum, acc = _online_softmax_step(scores, values, row_max, row_sum, acc)
    result = acc / tl.maximum(row_sum, 1e-30)
    tl.store(out_ptr + token * out_token_stride + head * out_head_stride + dims,
             result.to(out_ptr.dtype.element_ty), mask=dim_mask)


def _rows_contiguous(x: torch.Tensor) -> torch.Tensor:
    """`x` with its last dimension contiguous (kernels take the other strides as arguments)."""
    return x if x.stride(-1) == 1 else x.contiguous()


def _keys_per_tile(block_size: int) -> int:
    return max(16, min(64, triton.next_power_of_2(block_size)))


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
    query = _rows_contiguous(query)
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
        HEAD_BLOCK=head_block, BLOCK_SIZE=block_size, KEYS=_keys_per_tile(block_size),
        REQS=triton.next_power_of_2(num_reqs), NUM_SPLITS=splits,
    )
    if splits > 1:
        _merge_splits_kernel[(num_tokens, num_heads)](
            out, partial, partial_stats, *out.stride()[:2], NUM_HEADS=num_heads,
            HEAD_SIZE=head_size, HEAD_BLOCK=head_block, NUM_SPLITS=splits,
        )


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
    q_latent, q_pe = _rows_contiguous(q_latent), _rows_contiguous(q_pe)
    _mla_attention_kernel[(num_tokens, num_heads)](
        out, q_latent, q_pe, kv_c_cache, k_pe_cache, metadata.block_table, metadata.seq_lens,
        metadata.query_start_loc, scale, num_reqs, metadata.block_table.stride(0),
        *q_latent.stride()[:2], *q_pe.stride()[:2], *out.stride()[:2], NUM_HEADS=num_heads,
        LATENT=latent,
        LATENT_BLOCK=triton.next_power_of_2(latent), ROPE=rope,
        ROPE_BLOCK=triton.next_power_of_2(rope), BLOCK_SIZE=block_size,
        KEYS=_keys_per_tile(block_size), REQS=triton.next_power_of_2(num_reqs),
    )


def encoder_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      out: torch.Tensor, metadata: AttentionMetadata, scale: float,
                      sliding_window: int | None) -> None:
    """Bidirectional attention within each request's new tokens, into `out`."""
    num_tokens, num_heads, head_size = query.shape
    num_reqs = metadata.query_start_loc.shape[0] - 1
    if num_tokens == 0 or num_reqs == 0:
        out.zero_()
        return
    query = _rows_contiguous(query)
    _encoder_attention_kernel[(num_tokens, num_heads)](
        out, query, key.contiguous(), value.contiguous(), metadata.query_start_loc,
        scale, num_reqs, sliding_window or 2**30, *query.stride()[:2], *out.stride()[:2],
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=key.shape[1], HEAD_SIZE=head_size,
        HEAD_BLOCK=triton.next_power_of_2(head_size), KEYS=16,
        REQS=triton.next_power_of_2(num_reqs),
    )


class TritonBackend:
    """Triton kernels behind every kvgraph attention op (see the module docstring)."""

    name = "triton"
    # Launch grids depend only on tensor shapes, and lengths stay on the device.
    graph_support = GraphSupport.ALWAYS
    device_types = ("cuda", "cpu") if interpreting() else ("cuda",)

    def forward(self, query, key, value, kv_cache, out, metadata, scale, sliding_window,
                write_kv=True):
        key_cache, value_cache = kv_cache
        if write_kv:
            write_rows(key_cache, key, metadata.slot_mapping)
            write_rows(value_cache, value, metadata.slot_mapping)
        unified_attention(query, key_cache, value_cache, out, metadata, scale, sliding_window)

    def forward_mla(self, q_latent, q_pe, kv_c, k_pe, kv_cache, out, metadata, scale,
                    write_kv=True):
        kv_c_cache, k_pe_cache = kv_cache
        if write_kv:
            write_rows(kv_c_cache, kv_c, metadata.slot_mapping)
            write_rows(k_pe_cache, k_pe, metadata.slot_mapping)
        mla_attention(q_latent, q_pe, kv_c_cache, k_pe_cache, out, metadata, scale)

    def forward_encoder(self, query, key, value, out, metadata, scale, sliding_window=None):
        encoder_attention(query, key, value, out, metadata, scale, sliding_window)
