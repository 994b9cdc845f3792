"""One step's request chunks, validated and laid out as host arrays, with no loop per token.

Everything a step needs on the host is computed here once, with vectorised NumPy over the
batch's flattened token and block lists (a Python loop per request only flattens the lists).
Validation happens first and completely: a batch that fails writes nothing and counts nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from kvgraph.attention.chunk_fields import read_chunks
from kvgraph.attention.metadata import (
    MAX_BLOCK_ID,
    MAX_SEQ_LEN,
    AttentionMetadata,
    RequestChunk,
)
from kvgraph.errors import BatchError


@dataclass(frozen=True)
class HostBatch:
    """One step's chunks as host arrays; each value is computed once, here."""

    input_ids: np.ndarray  # [T] int64
    positions: np.ndarray  # [T] int64
    slot_mapping: np.ndarray  # [T] int64
    query_start_loc: np.ndarray  # [R + 1] int32
    seq_lens: np.ndarray  # [R] int32
    block_table: np.ndarray  # [R, blocks of the longest sequence] int32, unused entries 0
    used_blocks: np.ndarray  # every block the sequences use, request after request
    block_size: int
    num_decode_tokens: int
    max_query_len: int
    max_seq_len: int
    min_query_len: int
    logits_indices: np.ndarray  # the token rows that need logits, chunk by chunk, in order

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @property
    def num_reqs(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def uniform_decode(self) -> bool:
        return self.num_decode_tokens == self.num_tokens

    @property
    def uniform_query_len(self) -> int | None:
        """The tokens every request adds when all add the same number (1: a decode step; 1 + K:
        a speculative verify step), else None."""
        return self.max_query_len if self.min_query_len == self.max_query_len else None

    def attention_metadata(self, device: torch.device | str) -> AttentionMetadata:
        def tensor(array: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(array).to(device)

        return AttentionMetadata(
            slot_mapping=tensor(self.slot_mapping),
            block_table=tensor(self.block_table),
            seq_lens=tensor(self.seq_lens),
            query_start_loc=tensor(self.query_start_loc),
            block_size=self.block_size,
            num_actual_tokens=self.num_tokens,
            num_reqs=self.num_reqs,
            num_decode_tokens=self.num_decode_tokens,
            num_prefill_tokens=self.num_tokens - self.num_decode_tokens,
            max_query_len=self.max_query_len,
            max_seq_len=self.max_seq_len,
            host_seq_lens=self.seq_lens,
            host_query_start_loc=self.query_start_loc,
        )


def _first(mask: np.ndarray) -> int:
    return int(np.argmax(mask))


def _check_counts(query_lens: np.ndarray, block_counts: np.ndarray, blocks_needed: np.ndarray,
                  seq_lens: np.ndarray, block_size: int) -> None:
    if (query_lens == 0).any():
        i = _first(query_lens == 0)
        raise BatchError(f"chunk {i} has no new tokens; every chunk must add at least one")
    if (seq_lens > MAX_SEQ_LEN).any():
        i = _first(seq_lens > MAX_SEQ_LEN)
        raise BatchError(f"chunk {i}: num_computed_tokens + len(token_ids) must be at most "
                         f"{MAX_SEQ_LEN} (sequence lengths are int32), got {seq_lens[i]}")
    if (block_counts < blocks_needed).any():
        i = _first(block_counts < blocks_needed)
        raise BatchError(
            f"chunk {i}: a sequence of {seq_lens[i]} tokens needs {blocks_needed[i]} blocks of "
            f"size {block_size}, but its block table has {block_counts[i]}"
        )


def _chunk_of(flat_index: int, counts: np.ndarray) -> int:
    """The chunk that the `flat_index`-th item of the chunks' concatenated lists belongs to."""
    return int(np.searchsorted(np.cumsum(counts), flat_index, side="right"))


def _check_values(chunks: Sequence[RequestChunk], token_ids: np.ndarray,
                  all_blocks: np.ndarray, query_lens: np.ndarray, block_counts: np.ndarray,
                  vocab_size: int | None) -> None:
    if vocab_size is not None:
        bad = (token_ids < 0) | (token_ids >= vocab_size)
        if bad.any():
            i = _chunk_of(_first(bad), query_lens)
            raise BatchError(f"chunk {i}: token_ids must lie in [0, vocab_size={vocab_size}), "
                             f"got {token_ids[_first(bad)]}")
    bad = (all_blocks < 0) | (all_blocks >= MAX_BLOCK_ID)
    if bad.any():
        i = _chunk_of(_first(bad), block_counts)
        raise BatchError(f"chunk {i}: block ids must lie in [0, {MAX_BLOCK_ID}), got "
                         f"{list(chunks[i].block_ids)}")


def _positions(query_lens: np.ndarray, computed: np.ndarray, query_start_loc: np.ndarray
               ) -> tuple[np.ndarray, np.ndarray]:
    """Each token's request and its position in that request's sequence."""
    request_of_token = np.repeat(np.arange(len(query_lens)), query_lens)
    tokens = np.arange(int(query_start_loc[-1]))
    return request_of_token, computed[request_of_token] + tokens - query_start_loc[request_of_token]


def _query_start_loc(query_lens: np.ndarray) -> np.ndarray:
    query_start_loc = np.zeros(len(query_lens) + 1, dtype=np.int32)
    np.cumsum(query_lens, out=query_start_loc[1:])
    return query_start_loc


def host_batch(chunks: Sequence[RequestChunk], block_size: int,
               vocab_size: int | None = None) -> HostBatch:
    """Validate `chunks` (token ids below `vocab_size` when given) and lay them out."""
    if block_size < 1:
        raise BatchError(f"block_size must be >= 1, got {block_size}")
    fields = read_chunks(chunks)
    query_lens, computed, block_counts = (fields.query_lens, fields.num_computed_tokens,
                                          fields.block_counts)
    seq_lens = computed + query_lens
    blocks_needed = -(-seq_lens // block_size)
    _check_counts(query_lens, block_counts, blocks_needed, seq_lens, block_size)
    starts = np.cumsum(block_counts) - block_counts
    used = np.arange(int(blocks_needed.max()))
    in_use = used < blocks_needed[:, None]  # [R, W]: block j of request r is used
    used_blocks = fields.block_ids[(starts[:, None] + used)[in_use]]
    _check_values(chunks, fields.token_ids, fields.block_ids, query_lens, block_counts,
                  vocab_size)
    return _lay_out(fields.token_ids, query_lens, computed, seq_lens, used_blocks, in_use,
                    block_size, fields.num_logits)


def _logits_indices(query_start_loc: np.ndarray, num_logits: np.ndarray) -> np.ndarray:
    """The rows of each request's last `num_logits` tokens, request after request."""
    ends = query_start_loc[1:].astype(np.int64)
    if (num_logits == 1).all():  # the common case: each request's last token
        return ends - 1
    total = int(num_logits.sum())
    firsts = np.repeat(ends - num_logits, num_logits)
    offsets = np.arange(total) - np.repeat(np.cumsum(num_logits) - num_logits, num_logits)
    return firsts + offsets


def _lay_out(token_ids: np.ndarray, query_lens: np.ndarray, computed: np.ndarray,
             seq_lens: np.ndarray, used_blocks: np.ndarray, in_use: np.ndarray,
             block_size: int, num_logits: np.ndarray) -> HostBatch:
    block_table = np.zeros(in_use.shape, dtype=np.int32)
    block_table[in_use] = used_blocks
    query_start_loc = _query_start_loc(query_lens)
    request_of_token, positions = _positions(query_lens, computed, query_start_loc)
    slot_mapping = (block_table[request_of_token, positions // block_size].astype(np.int64)
                    * block_size + positions % block_size)
    return HostBatch(
        input_ids=token_ids,
        positions=positions,
        slot_mapping=slot_mapping,
        query_start_loc=query_start_loc,
        seq_lens=seq_lens.astype(np.int32),
        block_table=block_table,
        used_blocks=used_blocks,
        block_size=block_size,
        num_decode_tokens=int((query_lens == 1).sum()),
        max_query_len=int(query_lens.max()),
        max_seq_len=int(seq_lens.max()),
        min_query_len=int(query_lens.min()),
        logits_indices=_logits_indices(query_start_loc, num_logits),
    )


def check_distinct_blocks(batch: HostBatch) -> None:
    """Refuse a batch in which a block that a chunk writes is in any other block table entry.

    A step writes the blocks holding its new tokens' slots; such a block belongs to its one
    request, or a reader would see half-written tokens and a second writer would overwrite
    them. Blocks no chunk writes may be shared (prefix caching: full, cached blocks are only
    read). Not part of `host_batch`: dummy batches (graph capture, encoder-only models) may
    share a block they never write.
    """
    blocks, counts = np.unique(batch.used_blocks, return_counts=True)
    written = batch.slot_mapping // batch.block_size
    shared_and_written = np.intersect1d(blocks[counts > 1], written)
    if len(shared_and_written):
        block = int(shared_and_written[0])
        raise BatchError(
            f"block_ids: block {block} is written by chunks {_writers(batch, block)} and used "
            f"by chunks {_users(batch, block)}; a block a step writes holds one sequence's new "
            f"tokens, so it must be in one block table entry only (only blocks no chunk writes "
            f"may be shared)"
        )


def _writers(batch: HostBatch, block: int) -> list[int]:
    """The chunks with a new token in `block`."""
    request_of_token = np.repeat(np.arange(batch.num_reqs), np.diff(batch.query_start_loc))
    return np.unique(request_of_token[batch.slot_mapping // batch.block_size == block]).tolist()


def _users(batch: HostBatch, block: int) -> list[int]:
    """The chunk of each block table entry naming `block`, once per entry."""
    blocks_per_request = -(-batch.seq_lens.astype(np.int64) // batch.block_size)
    owners = np.repeat(np.arange(batch.num_reqs), blocks_per_request)
    return owners[batch.used_blocks == block].tolist()


def build_attention_metadata(
    chunks: Sequence[RequestChunk], block_size: int, device: torch.device | str = "cpu"
) -> AttentionMetadata:
    """Build the metadata for one step from its request chunks (validated, on `device`)."""
    return host_batch(chunks, block_size).attention_metadata(device)


def build_model_inputs(
    chunks: Sequence[RequestChunk], device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """The flat `input_ids` and `positions` of a batch, in the same token order as its metadata."""
    fields = read_chunks(chunks)
    _, positions = _positions(fields.query_lens, fields.num_computed_tokens,
                              _query_start_loc(fields.query_lens))
    return torch.from_numpy(fields.token_ids).to(device), torch.from_numpy(positions).to(device)
