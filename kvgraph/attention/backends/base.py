"""The interface every attention backend implements; the ops call nothing else."""

from __future__ import annotations

import enum
from typing import Protocol

import torch

from kvgraph.attention.metadata import AttentionMetadata


class GraphSupport(enum.Enum):
    """Which batches an attention backend can run inside a captured graph."""

    ALWAYS = "always"
    UNIFORM_DECODE = "uniform_decode"
    NEVER = "never"


class AttentionBackend(Protocol):
    """Kernels behind kvgraph's attention ops for one kind of device.

    Every method writes its result into `out` (and, with a cache and `write_kv`, the new
    keys/values into the cache at `metadata.slot_mapping`, skipping padding slots) and returns
    nothing. Attention over a cache reads every key from the cache, this step's included.
    """

    name: str
    graph_support: GraphSupport
    device_types: tuple[str, ...] | None  # the device types it runs on; None: any

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
        write_kv: bool,  # False: the layer reads another layer's cache, writes nothing
    ) -> None: ...

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
        write_kv: bool,
    ) -> None: ...

    def forward_encoder(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        out: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        sliding_window: int | None,  # bidirectional: |i - j| < sliding_window
    ) -> None: ...
