"""What every kvgraph Triton kernel shares: the cache write, finding a token's request, and one
step of the online softmax; plus the host-side helpers that size their launches."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


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
def request_of(token, query_start_loc_ptr, num_reqs, REQS: tl.constexpr):
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
def load_head_row(ptr, token, head, token_stride, head_stride, SIZE: tl.constexpr,
                  BLOCK: tl.constexpr):
    """Row (token, head) of a `[T, H, SIZE]` tensor as fp32 `[BLOCK]`, zeros past SIZE."""
    dims = tl.arange(0, BLOCK)
    return tl.load(ptr + token * token_stride + head * head_stride + dims, mask=dims < SIZE,
                   other=0.0).to(tl.float32)


@triton.jit
def store_head_row(ptr, row, token, head, token_stride, head_stride, SIZE: tl.constexpr,
                   BLOCK: tl.constexpr):
    """Write fp32 `row` `[BLOCK]` as row (token, head) of a `[T, H, SIZE]` tensor."""
    dims = tl.arange(0, BLOCK)
    tl.store(ptr + token * token_stride + head * head_stride + dims,
             row.to(ptr.dtype.element_ty), mask=dims < SIZE)


@triton.jit
def softmax_start(BLOCK: tl.constexpr):
    """The running softmax before any key: (row max, row sum, weighted values `[BLOCK]`)."""
    return (tl.full((), float("-inf"), tl.float32), tl.zeros((), tl.float32),
            tl.zeros((BLOCK,), tl.float32))


@triton.jit
def online_softmax_step(scores, values, row_max, row_sum, acc):
    """Fold one tile of scores `[KEYS]` and values `[KEYS, D]` into the running softmax."""
    new_max = tl.maximum(row_max, tl.max(scores, axis=0))
    correction = tl.exp(row_max - new_max)
    weights = tl.exp(scores - new_max)
    acc = acc * correction + tl.sum(weights[:, None] * values, axis=0)
    row_sum = row_sum * correction + tl.sum(weights, axis=0)
    return new_max, row_sum, acc


def rows_contiguous(x: torch.Tensor) -> torch.Tensor:
    """`x` with its last dimension contiguous (kernels take the other strides as arguments)."""
    return x if x.stride(-1) == 1 else x.contiguous()


def keys_per_tile(block_size: int) -> int:
    return max(16, min(64, triton.next_power_of_2(block_size)))
