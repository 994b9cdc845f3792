"""One step's batch of request chunks, turned into the tensors paged attention reads."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from kvgraph.errors import BatchError

# Slot id of a token whose key/value must not be written (padding).
PADDING_SLOT = -1
# Block tables are int32 (what device kernels take).
MAX_BLOCK_ID = 2**31 - 1


@dataclass(frozen=True)
class RequestChunk:
    """The new tokens one request adds in this step.

    `num_computed_tokens` tokens of the request are already in the cache; the chunk's tokens
    take positions `num_computed_tokens ..  num_computed_tokens + len(token_ids) - 1`.
    `block_ids` is the request's block table: block `i` holds positions
    `i * block_size .. (i + 1) * block_size - 1`.
    """

    token_ids: Sequence[int]
    num_computed_tokens: int
    block_ids: Sequence[int]

    @property
    def num_new_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def seq_len(self) -> int:
        return self.num_computed_tokens + len(self.token_ids)


@dataclass
class AttentionMetadata:
    """Paged-attention metadata for one step, all tensors on the model's device.

    Tokens are laid out request after request; `query_start_loc[r]:query_start_loc[r+1]` are
    request r's new tokens. Tensors may be longer than the real batch (padding): extra tokens
    carry slot `PADDING_SLOT`, and attention writes zeros for them.

    `max_query_len` and `max_seq_len` are host ints that fix the shapes attention computes with;
    a captured graph freezes them, so a runner captures with the largest values it will replay.
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64, PADDING_SLOT for padding
    block_table: torch.Tensor  # [num_reqs, max_blocks_per_req] int32, unused entries 0
    seq_lens: torch.Tensor  # [num_reqs] int32: cached + new tokens
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32
    block_size: int
    num_actual_tokens: int
    num_reqs: int
    num_decode_tokens: int  # tokens of requests that add exactly one token
    num_prefill_tokens: int
    max_query_len: int
    max_seq_len: int

    @property
    def uniform_decode(self) -> bool:
        return self.num_prefill_tokens == 0


def _validate(chunks: Sequence[RequestChunk], block_size: int) -> None:
    if block_size < 1:
        raise BatchError(f"block_size must be >= 1, got {block_size}")
    if len(chunks) == 0:
        raise BatchError("a batch needs at least one RequestChunk, got none")
    for i, chunk in enumerate(chunks):
        if chunk.num_new_tokens == 0:
            raise BatchError(f"chunk {i} has no new tokens; every chunk must add at least one")
        if chunk.num_computed_tokens < 0:
            raise BatchError(
                f"chunk {i}: num_computed_tokens must be >= 0, got {chunk.num_computed_tokens}"
            )
        blocks_needed = -(-chunk.seq_len // block_size)
        if len(chunk.block_ids) < blocks_needed:
            raise BatchError(
                f"chunk {i}: a sequence of {chunk.seq_len} tokens needs {blocks_needed} blocks "
                f"of size {block_size}, but its block table has {len(chunk.block_ids)}"
            )
        if any(not 0 <= b < MAX_BLOCK_ID for b in chunk.block_ids):
            raise BatchError(
                f"chunk {i}: block ids must lie in [0, {MAX_BLOCK_ID}), got {list(chunk.block_ids)}"
            )


def build_attention_metadata(
    chunks: Sequence[RequestChunk], block_size: int, device: torch.device | str = "cpu"
) -> AttentionMetadata:
    """Build the metadata for one step from its request chunks (validated, on `device`)."""
    _validate(chunks, block_size)
    query_lens = [c.num_new_tokens for c in chunks]
    seq_lens = [c.seq_len for c in chunks]
    max_blocks = max(-(-s // block_size) for s in seq_lens)

    block_table = torch.zeros(len(chunks), max_blocks, dtype=torch.int32)
    slots = []
    for r, chunk in enumerate(chunks):
        blocks = torch.as_tensor(list(chunk.block_ids[: -(-chunk.seq_len // block_size)]),
                                 dtype=torch.int32)
        block_table[r, : len(blocks)] = blocks
        positions = torch.arange(chunk.num_computed_tokens, chunk.seq_len)
        slots.append(block_table[r, positions // block_size].long() * block_size
                     + positions % block_size)

    query_start_loc = torch.zeros(len(chunks) + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.cumsum(torch.tensor(query_lens), 0)
    num_decode_tokens = sum(q for q in query_lens if q == 1)
    return AttentionMetadata(
        slot_mapping=torch.cat(slots).to(device),
        block_table=block_table.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32).to(device),
        query_start_loc=query_start_loc.to(device),
        block_size=block_size,
        num_actual_tokens=sum(query_lens),
        num_reqs=len(chunks),
        num_decode_tokens=num_decode_tokens,
        num_prefill_tokens=sum(query_lens) - num_decode_tokens,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
    )


def build_model_inputs(
    chunks: Sequence[RequestChunk], device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """The flat `input_ids` and `positions` of a batch, in the same token order as its metadata."""
    input_ids = torch.tensor([t for c in chunks for t in c.token_ids], dtype=torch.long)
    positions = torch.cat([torch.arange(c.num_computed_tokens, c.seq_len) for c in chunks])
    return input_ids.to(device), positions.to(device)
