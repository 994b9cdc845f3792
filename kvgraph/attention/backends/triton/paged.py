"""What every kvgraph Triton kernel shares: the cache write, finding a token's request and a
program's rows, the online softmax, and the merge of split keys. Launch sizes are in
`launch.py`."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Farther than any position (positions are int32 and stay below it): the window of attention
# without one, and wherever a kernel needs "past every token". A constexpr: kernels may read it.
NO_WINDOW = tl.constexpr(2**30)


@triton.jit
def _write_row(cache_ptr, values_ptr, token, slot, row_size, values_stride, ROW: tl.constexpr):
    """Row `values[token]` into cache row `slot`; slot -1 (padding) writes nothing."""
    cols = tl.arange(0, ROW)
    mask = cols < tl.where(slot >= 0, row_size, 0)
    row = tl.load(values_ptr + token * values_stride + cols, mask=mask)
    target = tl.maximum(slot, 0).to(tl.int64) * row_size
    tl.store(cache_ptr + target + cols, row.to(cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _write_rows_kernel(first_cache_ptr, first_ptr, first_size, first_stride,
                       second_cache_ptr, second_ptr, second_size, second_stride,
                       slot_mapping_ptr, FIRST: tl.constexpr, SECOND: tl.constexpr):
    """One token's rows into both caches of a layer (keys and values, or MLA's two parts)."""
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token)
    _write_row(first_cache_ptr, first_ptr, token, slot, first_size, first_stride, FIRST)
    _write_row(second_cache_ptr, second_ptr, token, slot, second_size, second_stride, SECOND)


def _rows(values: torch.Tensor) -> torch.Tensor:
    """`values` `[T, *row]` as `[T, row]` with contiguous rows."""
    values = values.reshape(values.shape[0], -1)
    return values if values.stride(1) == 1 else values.contiguous()


def write_rows(caches: list[torch.Tensor], values: tuple[torch.Tensor, torch.Tensor],
               slot_mapping: torch.Tensor) -> None:
    """Write each of `values` `[T, *row]` into its cache `[num_blocks, block_size, *row]` at the
    slots, in one launch for the pair."""
    num_tokens = values[0].shape[0]
    if num_tokens == 0:
        return
    first, second = (_rows(v) for v in values)
    _write_rows_kernel[(num_tokens,)](
        caches[0], first, first.shape[1], first.stride(0),
        caches[1], second, second.shape[1], second.stride(0), slot_mapping,
        FIRST=triton.next_power_of_2(first.shape[1]), SECOND=triton.next_power_of_2(second.shape[1]),
    )


@triton.jit
def request_of(token, query_start_loc_ptr, num_reqs, REQS: tl.constexpr):
    """The request `token` belongs to, whether it is real (1) or padding (0), its query start
    and length."""
    reqs = tl.arange(0, REQS)
    ends = tl.load(query_start_loc_ptr + 1 + reqs, mask=reqs < num_reqs,
                   other=NO_WINDOW)  # missing requests end past every token
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



@triton.jit
def query_block(block, query_start_loc_ptr, num_reqs, BLOCK_Q: tl.constexpr,
                 REQS: tl.constexpr):
    """The query tokens program `block` covers: (request, first token, end token). Each
    request's tokens are cut into blocks of BLOCK_Q; blocks past every request's cover the
    padding tokens after the last request (request -1).

    Scalar arithmetic, not tl.where: Triton 3.6's interpreter cannot loop to a tl.where."""
    reqs = tl.arange(0, REQS)
    starts = tl.load(query_start_loc_ptr + reqs, mask=reqs < num_reqs, other=0)
    ends = tl.load(query_start_loc_ptr + 1 + reqs, mask=reqs < num_reqs, other=0)
    blocks = (ends - starts + BLOCK_Q - 1) // BLOCK_Q
    first_blocks = tl.cumsum(blocks, axis=0) - blocks
    total = tl.sum(blocks, axis=0)
    in_request = (block < total).to(tl.int32)
    # Requests whose blocks all come before `block` (empty ones included) precede its own.
    request = tl.minimum(tl.sum((first_blocks + blocks <= block).to(tl.int32), axis=0),
                         num_reqs - 1)
    first_block = tl.sum((reqs == request).to(tl.int32) * first_blocks, axis=0)
    query_start = tl.load(query_start_loc_ptr + request)
    query_end = tl.load(query_start_loc_ptr + request + 1)
    padding_start = tl.load(query_start_loc_ptr + num_reqs)
    first = (in_request * (query_start + (block - first_block) * BLOCK_Q)
             + (1 - in_request) * (padding_start + (block - total) * BLOCK_Q))
    end = in_request * tl.minimum(first + BLOCK_Q, query_end) + (1 - in_request) * (first + BLOCK_Q)
    return in_request * (request + 1) - 1, first, end


@triton.jit
def program_rows(block, head_block, split, query_start_loc_ptr, seq_lens_ptr, num_tokens,
                 num_reqs, sliding_window, NUM_HEADS: tl.constexpr, HEADS: tl.constexpr,
                 NUM_SPLITS: tl.constexpr, BLOCK_Q: tl.constexpr, ROWS: tl.constexpr,
                 REQS: tl.constexpr):
    """The rows of a program over query block `block`, heads `head_block * HEADS ..` and key
    split `split`: (request, each row's token and head, which rows are real, each row's
    position in its sequence, and the inclusive range of keys this split reads).

    Rows are tokens x HEADS. Keys are those any row sees (causal, within `sliding_window`),
    cut into NUM_SPLITS ranges; padding reads none. Scalar arithmetic, not tl.where: Triton
    3.6's interpreter cannot loop to a tl.where."""
    request, first, end = query_block(block, query_start_loc_ptr, num_reqs, BLOCK_Q, REQS)
    end = tl.minimum(end, num_tokens)
    rows = tl.arange(0, ROWS)
    tokens = first + rows // HEADS
    heads = head_block * HEADS + rows % HEADS
    row_valid = (rows < BLOCK_Q * HEADS) & (tokens < end) & (heads < NUM_HEADS)
    real = (request >= 0).to(tl.int32)
    request = tl.maximum(request, 0)
    seq_len = tl.load(seq_lens_ptr + request)
    query_start = tl.load(query_start_loc_ptr + request)
    cached = seq_len - (tl.load(query_start_loc_ptr + request + 1) - query_start) - query_start
    positions = cached + tokens  # each row's place in its sequence
    first_key = tl.maximum(cached + first - sliding_window + 1, 0)
    last_key = real * (cached + end) - 1
    split_len = (tl.maximum(last_key - first_key + 1, 0) + NUM_SPLITS - 1) // NUM_SPLITS
    first_key = first_key + split * split_len
    last_key = tl.minimum(first_key + split_len - 1, last_key)
    return request, tokens, heads, row_valid, positions, first_key, last_key


@triton.jit
def load_rows(ptr, tokens, heads, token_stride, head_stride, valid, SIZE: tl.constexpr,
              BLOCK: tl.constexpr):
    """Rows (tokens[i], heads[i]) of a `[T, H, SIZE]` tensor as fp32 `[rows, BLOCK]`."""
    dims = tl.arange(0, BLOCK)
    return tl.load(ptr + tokens[:, None] * token_stride + heads[:, None] * head_stride
                   + dims[None, :], mask=valid[:, None] & (dims < SIZE)[None, :],
                   other=0.0).to(tl.float32)


@triton.jit
def key_slots(block_table_ptr, request, block_table_stride, key_positions, in_range,
              BLOCK_SIZE: tl.constexpr):
    """The cache slots of `request`'s keys at `key_positions` (0 where not `in_range`)."""
    blocks = tl.load(block_table_ptr + request * block_table_stride
                     + key_positions // BLOCK_SIZE, mask=in_range, other=0).to(tl.int64)
    return blocks * BLOCK_SIZE + key_positions % BLOCK_SIZE


@triton.jit
def softmax_tile(scores, visible, values, row_max, row_sum, acc, PRECISION: tl.constexpr):
    """Fold one tile into each row's running softmax: `scores` `[ROWS, KEYS]`, counted where
    `visible`, and `values` `[KEYS, D]`; returns the new (row max, row sum, weighted values)."""
    scores = tl.where(visible, scores, float("-inf"))
    new_max = tl.maximum(row_max, tl.max(scores, axis=1))
    safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)  # no key seen yet
    correction = tl.exp(row_max - safe_max)
    weights = tl.exp(scores - safe_max[:, None])
    row_sum = row_sum * correction + tl.sum(weights, axis=1)
    acc = acc * correction[:, None] + tl.dot(weights, values, input_precision=PRECISION)
    return new_max, row_sum, acc


@triton.jit
def store_rows(out_ptr, partial_ptr, partial_stats_ptr, acc, row_max, row_sum, tokens, heads,
               row_valid, out_token_stride, out_head_stride, split, NUM_HEADS: tl.constexpr,
               NUM_SPLITS: tl.constexpr, SIZE: tl.constexpr, BLOCK: tl.constexpr):
    """Each row's result: normalised into `out` (zeros for a row that saw no key, never NaN),
    or with several splits its split's part for `merge_splits`."""
    dims = tl.arange(0, BLOCK)
    if NUM_SPLITS == 1:
        result = acc / tl.maximum(row_sum, 1e-30)[:, None]
        tl.store(out_ptr + tokens[:, None] * out_token_stride + heads[:, None] * out_head_stride
                 + dims[None, :], result.to(out_ptr.dtype.element_ty),
                 mask=row_valid[:, None] & (dims < SIZE)[None, :])
    else:
        parts = (tokens * NUM_HEADS + heads) * NUM_SPLITS + split
        tl.store(partial_ptr + parts[:, None] * BLOCK + dims[None, :], acc,
                 mask=row_valid[:, None])
        tl.store(partial_stats_ptr + parts * 2, row_max, mask=row_valid)
        tl.store(partial_stats_ptr + parts * 2 + 1, row_sum, mask=row_valid)


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


def merge_splits(out: torch.Tensor, partial: torch.Tensor, stats: torch.Tensor) -> None:
    """`out` `[T, H, D]` from the splits' partial softmaxes (flash-decoding's reduction)."""
    num_tokens, num_heads, head_size = out.shape
    splits, head_block = partial.shape[2:]
    _merge_splits_kernel[(num_tokens, num_heads)](
        out, partial, stats, *out.stride()[:2], NUM_HEADS=num_heads, HEAD_SIZE=head_size,
        HEAD_BLOCK=head_block, NUM_SPLITS=splits,
    )
