"""The interface every attention backend implements: its step, its graph hooks, its kernels.

A step, as the runner drives it:
  1. a step replayed from a device's full graph carries `frozen_lengths`: the host ints the
     backend's captured kernels froze (the CPU graph reruns Python, so it keeps the batch's own);
  2. `plan(metadata, descriptor)` runs once, after the persistent inputs are filled; the result
     is `metadata.plan`, which every layer's op call reads (`step_plan`) instead of recomputing
     launch parameters or token layouts per layer;
  3. the graph owner (`kvgraph.runtime.graphs.GraphSet`) calls `before_capture` and
     `after_capture` around the capture of a descriptor, and `before_replay` before each step
     it replays, with what `after_capture` returned; a backend whose kernels take host-side
     lengths (Ascend's fused attention) rewrites them in its captured kernels there;
  4. `forward`, `forward_mla` or `forward_encoder` once per layer.
The ops call nothing else.
"""

from __future__ import annotations

import enum
from typing import Any, NamedTuple

import torch

from kvgraph.attention.metadata import AttentionMetadata
from kvgraph.config import GraphMode
from kvgraph.forward_context import BatchDescriptor


class GraphSupport(enum.Enum):
    """Which batches an attention backend can run inside a captured full graph.

    ALWAYS: any batch. UNIFORM_BATCH: uniform batches of any query length (every request adds
    the same tokens: decode steps, and speculative verify steps of 1 + K tokens a request).
    UNIFORM_DECODE: uniform batches of one token a request only. NEVER: none.
    """

    ALWAYS = "always"
    UNIFORM_BATCH = "uniform_batch"
    UNIFORM_DECODE = "uniform_decode"
    NEVER = "never"

    def runs_uniform(self, query_len: int) -> bool:
        """Whether a full graph can hold uniform batches of `query_len` tokens a request."""
        if query_len == 1:
            return self is not GraphSupport.NEVER
        return self in (GraphSupport.ALWAYS, GraphSupport.UNIFORM_BATCH)


class StepLengths(NamedTuple):
    """The host ints attention's shapes depend on: the longest query and sequence of a step."""

    max_query_len: int
    max_seq_len: int


class AttentionPlan:
    """One step's plan for one backend, made once and read by every layer's op call."""

    def __init__(self, backend: AttentionBackend, metadata: AttentionMetadata,
                 descriptor: BatchDescriptor | None):
        self.backend = backend
        self.metadata = metadata
        self.descriptor = descriptor


class AttentionBackend:
    """Kernels behind kvgraph's attention ops for one kind of device (see the module docstring).

    Every forward method writes its result into `out` (and, with a cache and `write_kv`, the
    new keys/values into the cache at `metadata.slot_mapping`, skipping padding slots) and
    returns nothing. Attention over a cache reads every key from the cache, this step's
    included. Subclasses set `name`, `graph_support`, `device_types` (None: any device) and
    `plan_class`, and implement the forward methods; the hooks do nothing unless overridden.
    """

    name: str
    graph_support: GraphSupport
    device_types: tuple[str, ...] | None = None
    plan_class: type[AttentionPlan] = AttentionPlan

    def check_block_size(self, block_size: int) -> None:
        """Refuse, with a ConfigError naming the limit, a block size the kernels cannot run."""

    # --- the step ---------------------------------------------------------------------------

    def frozen_lengths(self, descriptor: BatchDescriptor, batch: StepLengths,
                       max_model_len: int) -> StepLengths:
        """What a step replayed from a device's full graph of `descriptor` carries.

        A device graph replays the kernels as captured, so every host int they read is frozen at
        capture: the default freezes both at the largest a replay can meet (a uniform batch's
        query is the descriptor's `query_len` tokens, one for decode; a mixed one at most the
        descriptor's tokens).
        """
        longest_query = descriptor.query_len if descriptor.uniform_decode else descriptor.num_tokens
        return StepLengths(longest_query, max_model_len)

    def plan(self, metadata: AttentionMetadata, descriptor: BatchDescriptor | None
             ) -> AttentionPlan:
        """This step's plan (see `plan_class`); `descriptor` is None outside a runner."""
        return self.plan_class(self, metadata, descriptor)

    def step_plan(self, metadata: AttentionMetadata) -> AttentionPlan:
        """The plan the runner made for this step, or one made now and kept on `metadata` (for
        metadata built by hand, whose first op call plans the step for the others). A plan
        copied along with its metadata (`dataclasses.replace`) is another step's: made anew."""
        plan = metadata.plan
        if plan is None or plan.backend is not self or plan.metadata is not metadata:
            plan = metadata.plan = self.plan(metadata, None)
        return plan

    # --- graph hooks, called by the graph owner ---------------------------------------------

    def before_capture(self, mode: GraphMode, descriptor: BatchDescriptor,
                       metadata: AttentionMetadata) -> None:
        """Before the forward that captures `descriptor`'s graphs in runtime `mode`."""

    def after_capture(self, mode: GraphMode, descriptor: BatchDescriptor,
                      metadata: AttentionMetadata) -> Any:
        """After every graph of `descriptor` was captured (not called when capture failed).

        What it returns is kept with those graphs, freed with them, and handed to every
        `before_replay` of them: what the backend needs to update its captured kernels.
        """
        return None

    def before_replay(self, mode: GraphMode, descriptor: BatchDescriptor,
                      metadata: AttentionMetadata, captured: Any = None) -> None:
        """Before a step replays `descriptor`'s graphs, with that step's metadata and what
        `after_capture` returned for them."""

    # --- kernels ----------------------------------------------------------------------------

    def forward(
        self,
        query: torch.Tensor,  # [T, num_heads, head_size]
        key: torch.Tensor,  # [T, num_kv_heads, head_size]
        value: torch.Tensor,  # [T, num_kv_heads, head_size]
        kv_cache: list[torch.Tensor],  # key_cache, value_cache
        out: torch.Tensor,  # [T, num_heads, head_size]
        metadata: AttentionMetadata,
        scale: float,
        sliding_window: int | None,
        write_kv: bool = True,  # False: the layer reads another layer's cache, writes nothing
    ) -> None:
        raise NotImplementedError(f"attention backend {self.name!r} has no standard attention")

    def forward_mla(
        self,
        q_latent: torch.Tensor,  # [T, num_heads, kv_lora_rank]
        q_pe: torch.Tensor,  # [T, num_heads, rope_dim]
        kv_c: torch.Tensor,  # [T, kv_lora_rank]
        k_pe: torch.Tensor,  # [T, rope_dim]
        kv_cache: list[torch.Tensor],  # kv_c_cache, k_pe_cache
        out: torch.Tensor,  # [T, num_heads, kv_lora_rank]
        metadata: AttentionMetadata,
        scale: float,
        write_kv: bool = True,
    ) -> None:
        raise NotImplementedError(f"attention backend {self.name!r} has no MLA")

    def forward_encoder(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        out: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,  # bidirectional: |i - j| < sliding_window
    ) -> None:
        raise NotImplementedError(f"attention backend {self.name!r} has no encoder attention")

