"""One step's plan, and the runner's persistent inputs that a plan is written into.

A `StepPlan` is everything decided about a step before it runs (its host batch, runtime mode,
descriptor and padded shape), made once by the dispatcher and read by every later stage.

Graphs record addresses, so a step never allocates its inputs: `InputBuffers.fill` writes the
plan's values into the first rows of buffers sized for `max_num_tokens` / `max_num_seqs`, pads
the rest of the descriptor's rows, and hands out views of them. Padding rules: padded tokens get
id 0, position 0 and slot -1 (nothing is written to the cache). Padded requests (full graphs for
uniform decode) each own one padded token and have sequence length 0, so attention sees no key
and returns zeros: never NaN.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvgraph.attention.metadata import PADDING_SLOT, AttentionMetadata, HostBatch, cdiv
from kvgraph.config import GraphMode
from kvgraph.errors import BatchError
from kvgraph.forward_context import BatchDescriptor


@dataclass(frozen=True)
class StepLimits:
    """The largest step a runner's buffers and caches hold."""

    max_num_tokens: int
    max_num_seqs: int
    max_model_len: int
    num_blocks: int
    block_size: int

    def check(self, batch: HostBatch) -> None:
        """Reject a batch beyond these limits, naming the limit."""
        limits = [
            (batch.num_tokens, self.max_num_tokens, "tokens", "max_num_tokens"),
            (batch.num_reqs, self.max_num_seqs, "requests", "max_num_seqs"),
            (batch.max_seq_len, self.max_model_len, "tokens in one sequence", "max_model_len"),
            (int(batch.block_table.max()) + 1, self.num_blocks, "blocks (largest block id + 1)",
             "num_blocks"),
        ]
        for got, limit, what, name in limits:
            if got > limit:
                raise BatchError(f"the batch has {got} {what}, more than {name}={limit}")


@dataclass(frozen=True)
class StepPlan:
    """One step, decided: its batch, how it runs, and the shapes attention is padded to.

    `max_query_len` and `max_seq_len` are the host ints attention shapes depend on; a full
    graph freezes them, so full steps carry the largest values a replay can meet.
    `writes_cache` is False for the dummy batches of capture, which must leave the cache as is.
    """

    batch: HostBatch
    runtime_mode: GraphMode
    descriptor: BatchDescriptor
    padded_reqs: int
    max_query_len: int
    max_seq_len: int
    writes_cache: bool = True

    @property
    def padded_tokens(self) -> int:
        return self.descriptor.num_tokens


class InputBuffers:
    """Persistent `input_ids`, `positions` and attention-metadata tensors on one device."""

    def __init__(self, limits: StepLimits, device: torch.device):
        self.block_size = limits.block_size

        def zeros(*shape: int, dtype: torch.dtype = torch.int32) -> torch.Tensor:
            return torch.zeros(*shape, dtype=dtype, device=device)

        self.input_ids = zeros(limits.max_num_tokens, dtype=torch.long)
        self.positions = zeros(limits.max_num_tokens, dtype=torch.long)
        self.slot_mapping = zeros(limits.max_num_tokens, dtype=torch.long)
        self.block_table = zeros(limits.max_num_seqs, cdiv(limits.max_model_len, limits.block_size))
        self.seq_lens = zeros(limits.max_num_seqs)
        self.query_start_loc = zeros(limits.max_num_seqs + 1)

    def fill(self, plan: StepPlan) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Write one step into the buffers; the model inputs and metadata as views of them."""
        batch = plan.batch
        n, r, t, padded_r = batch.num_tokens, batch.num_reqs, plan.padded_tokens, plan.padded_reqs
        self._write(self.input_ids, batch.input_ids, t, 0)
        self._write(self.positions, batch.positions, t, 0)
        self._write(self.slot_mapping, batch.slot_mapping, t, PADDING_SLOT)
        if not plan.writes_cache:
            self.slot_mapping[:t].fill_(PADDING_SLOT)
        self._write(self.seq_lens, batch.seq_lens, padded_r, 0)
        # Padded requests own one padded token each, in order, while padded tokens last.
        padded_starts = torch.arange(n + 1, n + 1 + padded_r - r, dtype=torch.int32).clamp(max=t)
        self._write(self.query_start_loc, torch.cat([batch.query_start_loc, padded_starts]),
                    padded_r + 1, 0)
        self.block_table[:padded_r].zero_()
        self.block_table[:r, : batch.block_table.shape[1]].copy_(batch.block_table,
                                                                 non_blocking=True)
        metadata = AttentionMetadata(
            slot_mapping=self.slot_mapping[:t],
            block_table=self.block_table[:padded_r],
            seq_lens=self.seq_lens[:padded_r],
            query_start_loc=self.query_start_loc[:padded_r + 1],
            block_size=self.block_size,
            num_actual_tokens=n,
            num_reqs=r,
            num_decode_tokens=batch.num_decode_tokens,
            num_prefill_tokens=n - batch.num_decode_tokens,
            max_query_len=plan.max_query_len,
            max_seq_len=plan.max_seq_len,
        )
        return self.input_ids[:t], self.positions[:t], metadata

    @staticmethod
    def _write(buffer: torch.Tensor, values: torch.Tensor, length: int, pad: int) -> None:
        buffer[: len(values)].copy_(values, non_blocking=True)
        buffer[len(values):length].fill_(pad)
