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


def cdiv(a: int, b: int) -> int:
    """`a / b` rounded up: how many blocks of `b` slots hold `a` tokens."""
    return -(-a // b)


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
        blocks_needed = cdiv(chunk.seq_len, block_size)
        if len(chunk.block_ids) < blocks_needed:
            raise BatchError(
                f"chunk {i}: a sequence of {chunk.seq_len} tokens needs {blocks_needed} blocks "
                f"of size {block_size}, but its block table has {len(chunk.block_ids)}"
            )
        if any(not 0 <= b < MAX_BLOCK_ID for b in chunk.block_ids):
            raise BatchError(
                f"chunk {i}: block ids must lie in [0, {MAX_BLOCK_ID}), got {list(chunk.block_ids)}"
            )


@dataclass(frozen=True)
class HostBatch:
    """One step's chunks as host tensors, validated; each value is computed once, here."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64
    query_start_loc: torch.Tensor  # [R + 1] int32
    seq_lens: torch.Tensor  # [R] int32
    block_table: torch.Tensor  # [R, blocks of the longest sequence] int32, unused entries 0
    block_size: int
    num_decode_tokens: int
    max_query_len: int
    max_seq_len: int

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @property
    def num_reqs(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def uniform_decode(self) -> bool:
        return self.num_decode_tokens == self.num_tokens

    def attention_metadata(self, device: torch.device | str) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping.to(device),
            block_table=self.block_table.to(device),
            seq_lens=self.seq_lens.to(device),
            query_start_loc=self.query_start_loc.to(device),
            block_size=self.block_size,
            num_actual_tokens=self.num_tokens,
            num_reqs=self.num_reqs,
            num_decode_tokens=self.num_decode_tokens,
            num_prefill_tokens=self.num_tokens - self.num_decode_tokens,
            max_query_len=self.max_query_len,
            max_seq_len=self.max_seq_len,
        )


def _positions(chunks: Sequence[RequestChunk]) -> torch.Tensor:
    return torch.cat([torch.arange(c.num_computed_tokens, c.seq_len) for c in chunks])


def host_batch(chunks: Sequence[RequestChunk], block_size: int) -> HostBatch:
    """Validate `chunks` and lay them out as the host tensors of one step (no per-token loop)."""
    _validate(chunks, block_size)
    query_lens = torch.tensor([c.num_new_tokens for c in chunks])
    seq_lens = [c.seq_len for c in chunks]
    blocks = [cdiv(s, block_size) for s in seq_lens]
    block_table = torch.zeros(len(chunks), max(blocks), dtype=torch.int32)
    for r, (chunk, n) in enumerate(zip(chunks, blocks)):
        block_table[r, :n] = torch.as_tensor(list(chunk.block_ids[:n]), dtype=torch.int32)
    positions = _positions(chunks)
    request_of_token = torch.repeat_interleave(torch.arange(len(chunks)), query_lens)
    slot_mapping = (block_table[request_of_token, positions // block_size].long() * block_size
                    + positions % block_size)
    query_start_loc = torch.zeros(len(chunks) + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.cumsum(query_lens, 0)
    return HostBatch(
        input_ids=torch.tensor([t for c in chunks for t in c.token_ids], dtype=torch.long),
        positions=positions,
        slot_mapping=slot_mapping,
        query_start_loc=query_start_loc,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_table=block_table,
        block_size=block_size,
        num_decode_tokens=int((query_lens == 1).sum()),
        max_query_len=int(query_lens.max()),
        max_seq_len=max(seq_lens),
    )


def build_attention_metadata(
    chunks: Sequence[RequestChunk], block_size: int, device: torch.device | str = "cpu"
) -> AttentionMetadata:
    """Build the metadata for one step from its request chunks (validated, on `device`)."""
    return host_batch(chunks, block_size).attention_metadata(device)


def build_model_inputs(
    chunks: Sequence[RequestChunk], device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """The flat `input_ids` and `positions` of a batch, in the same token order as its metadata."""
    input_ids = torch.tensor([t for c in chunks for t in c.token_ids], dtype=torch.long)
    return input_ids.to(device), _positions(chunks).to(device)
