"""The runner's persistent inputs: token and metadata buffers filled in place every step.

Graphs record addresses, so a step never allocates its inputs: it writes this step's values
into the first rows of buffers sized for `max_num_tokens` / `max_num_seqs`, pads the rest of
the descriptor's rows, and hands out views of them.

Padding rules: padded tokens get id 0, position 0 and slot -1 (nothing is written to the
cache). Padded requests (full graphs for uniform decode) each own one padded token and have
sequence length 0, so attention sees no key and returns zeros: never NaN.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from kvgraph.attention.metadata import (
    PADDING_SLOT,
    AttentionMetadata,
    RequestChunk,
    build_attention_metadata,
)
from kvgraph.errors import BatchError


@dataclass(frozen=True)
class StepShape:
    """How far a step is padded, and the host ints attention shapes depend on."""

    num_tokens: int  # padded
    num_reqs: int  # padded
    max_query_len: int
    max_seq_len: int


class InputBuffers:
    """Persistent `input_ids`, `positions` and attention-metadata tensors on one device."""

    def __init__(self, max_num_tokens: int, max_num_seqs: int, max_model_len: int,
                 block_size: int, num_blocks: int, device: torch.device):
        self.max_num_tokens, self.max_num_seqs = max_num_tokens, max_num_seqs
        self.max_model_len, self.block_size, self.num_blocks = max_model_len, block_size, num_blocks
        max_blocks = -(-max_model_len // block_size)

        def zeros(*shape: int, dtype: torch.dtype = torch.int32) -> torch.Tensor:
            return torch.zeros(*shape, dtype=dtype, device=device)

        self.input_ids = zeros(max_num_tokens, dtype=torch.long)
        self.positions = zeros(max_num_tokens, dtype=torch.long)
        self.slot_mapping = zeros(max_num_tokens, dtype=torch.long)
        self.block_table = zeros(max_num_seqs, max_blocks)
        self.seq_lens = zeros(max_num_seqs)
        self.query_start_loc = zeros(max_num_seqs + 1)

    def check(self, chunks: Sequence[RequestChunk]) -> None:
        """Reject a batch these buffers cannot hold, naming the limit."""
        num_tokens = sum(c.num_new_tokens for c in chunks)
        limits = [
            (num_tokens, self.max_num_tokens, "tokens", "max_num_tokens"),
            (len(chunks), self.max_num_seqs, "requests", "max_num_seqs"),
            (max((c.seq_len for c in chunks), default=0), self.max_model_len,
             "tokens in one sequence", "max_model_len"),
            (max((b for c in chunks for b in c.block_ids), default=-1) + 1, self.num_blocks,
             "blocks (largest block id + 1)", "num_blocks"),
        ]
        for got, limit, what, name in limits:
            if got > limit:
                raise BatchError(f"the batch has {got} {what}, more than {name}={limit}")

    def fill(self, chunks: Sequence[RequestChunk], shape: StepShape
             ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Write one step into the buffers; the model inputs and metadata as views of them."""
        host = build_attention_metadata(chunks, self.block_size, "cpu")
        n, r, t, padded_r = host.num_actual_tokens, host.num_reqs, shape.num_tokens, shape.num_reqs
        ids = [tok for c in chunks for tok in c.token_ids]
        positions = torch.cat([torch.arange(c.num_computed_tokens, c.seq_len) for c in chunks])
        self._write(self.input_ids, torch.tensor(ids), t, 0)
        self._write(self.positions, positions, t, 0)
        self._write(self.slot_mapping, host.slot_mapping, t, PADDING_SLOT)
        self._write(self.seq_lens, host.seq_lens, padded_r, 0)
        # Padded requests own one padded token each, in order, while padded tokens last.
        padded_starts = torch.arange(n + 1, n + 1 + padded_r - r, dtype=torch.int32).clamp(max=t)
        self._write(self.query_start_loc, torch.cat([host.query_start_loc, padded_starts]),
                    padded_r + 1, 0)
        self.block_table[:padded_r].zero_()
        self.block_table[:r, : host.block_table.shape[1]].copy_(host.block_table, non_blocking=True)
        metadata = AttentionMetadata(
            slot_mapping=self.slot_mapping[:t],
            block_table=self.block_table[:padded_r],
            seq_lens=self.seq_lens[:padded_r],
            query_start_loc=self.query_start_loc[:padded_r + 1],
            block_size=self.block_size,
            num_actual_tokens=n,
            num_reqs=r,
            num_decode_tokens=host.num_decode_tokens,
            num_prefill_tokens=host.num_prefill_tokens,
            max_query_len=shape.max_query_len,
            max_seq_len=shape.max_seq_len,
        )
        return self.input_ids[:t], self.positions[:t], metadata

    @staticmethod
    def _write(buffer: torch.Tensor, values: torch.Tensor, length: int, pad: int) -> None:
        buffer[: len(values)].copy_(values, non_blocking=True)
        buffer[len(values):length].fill_(pad)
