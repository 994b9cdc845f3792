"""One step, decided: its batch, how it runs, the shapes attention is padded to, its inputs.

A `StepPlan` is everything decided about a step before it runs (its host batch, runtime mode,
descriptor and padded shape), made once by `plan_step` and read by every later stage; a `Step`
is a plan whose inputs were written into the runner's persistent buffers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvgraph.attention.backends.base import AttentionBackend, StepLengths
from kvgraph.attention.batch import HostBatch
from kvgraph.attention.metadata import AttentionMetadata
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

    `padded_reqs` request rows and the host ints `max_query_len` and `max_seq_len` fix the
    shapes attention computes with. `writes_cache` is False for the dummy batches of compile
    and capture, which must leave the cache as it is.
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


def plan_step(batch: HostBatch, mode: GraphMode, descriptor: BatchDescriptor,
              backend: AttentionBackend, limits: StepLimits, freezes_shapes: bool,
              writes_cache: bool = True) -> StepPlan:
    """`batch` run as `descriptor` in runtime `mode`.

    Attention runs on the batch's own requests and lengths, except in a full graph: its inputs
    have the descriptor's request rows (every request a mixed batch may have, `max_num_seqs`),
    and on a device (`freezes_shapes`) the step carries what the backend's captured kernels
    froze (`AttentionBackend.frozen_lengths`). A CPU graph reruns Python on replay, so there
    the lengths stay the batch's own.
    """
    rows, lengths = batch.num_reqs, StepLengths(batch.max_query_len, batch.max_seq_len)
    if mode is GraphMode.FULL:
        rows = descriptor.num_reqs or limits.max_num_seqs
        if freezes_shapes:
            lengths = backend.frozen_lengths(descriptor, lengths, limits.max_model_len)
    return StepPlan(batch, mode, descriptor, rows, *lengths, writes_cache=writes_cache)


@dataclass(frozen=True)
class Step:
    """A step ready to run: its plan, and its inputs and metadata as views of the persistent
    buffers (`metadata.plan` holds the attention backend's plan of it)."""

    plan: StepPlan
    input_ids: torch.Tensor
    positions: torch.Tensor
    metadata: AttentionMetadata
    logits_indices: torch.Tensor  # the hidden-state rows that need logits (HostBatch's)
