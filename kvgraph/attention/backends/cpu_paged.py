"""Paged attention on the CPU in a C++ kernel that reads the cache in place: the CPU default.

Every batch kind (prefill, chunked prefill, decode, mixed), GQA/MQA, sliding windows and MLA run
in `torch.ops.kvgraph_cpu.paged_attention` (paged_attention.cpp): work items of (request, up to
16 query tokens, KV head) run under `at::parallel_for` on torch's threads, each walking only its
request's real keys, 64 at a time through the block table, with an online softmax, four rows
(query heads, tokens) per pass, accumulating in fp32 for fp32, bf16 and fp16 caches. Cache writes are one C++
loop over the slots (-1 writes nothing). Sequence lengths, query offsets and block tables are
read from the metadata's tensors, and the kernels' work depends on nothing else, so any batch
may run inside a graph (`GraphSupport.ALWAYS`).
Encoder-only attention has no cache to read: `torch_native` runs it.

The kernels are built on first use into kvgraph's cache dir (see `build.py`). Where they cannot
be built (no compiler), the backend logs why once and runs `torch_native` instead, whose graph
support it then reports.

Buffers: none persist. Queries and outputs are read and written in their own dtype when it is
fp32 or the cache's (a bf16 model over a bf16 cache converts nothing); any other pairing costs a
conversion per call. Caches are read as they are.
"""

from __future__ import annotations

import functools
import logging

import torch

from kvgraph.attention.backends.base import AttentionBackend, GraphSupport
from kvgraph.cpu.build import KernelBuildError, load_kernels
from kvgraph.attention.backends.torch_native import TorchNativeBackend
from kvgraph.attention.metadata import AttentionMetadata

logger = logging.getLogger(__name__)
NO_WINDOW = -1  # the kernel's sliding_window for "none"


def _returns_nothing(*args, **kwargs) -> None:
    """The kernels' fake (meta) implementation: they return nothing."""
    return None


@functools.cache  # registering a fake twice is an error
def _register_fakes() -> None:
    for op in ("write_cache", "paged_attention"):
        torch.library.register_fake(f"kvgraph_cpu::{op}", _returns_nothing)


def write_rows(cache: torch.Tensor, rows: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write `rows[i]` (`[T, ...]`) into slot `slot_mapping[i]` of `cache`; -1 writes nothing."""
    rows = rows.reshape(rows.shape[0], -1)  # a view for a slice of fused qkv
    if rows.dtype != cache.dtype:  # each skipped no-op call saves ~1 us of dispatch a layer
        rows = rows.to(cache.dtype)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    torch.ops.kvgraph_cpu.write_cache(rows, cache, slot_mapping)


def _query_rows(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`x` as the kernel reads it: `dtype` with a contiguous last dim (no copy when it is)."""
    if x.dtype != dtype:
        x = x.to(dtype)
    return x if x.stride(-1) == 1 else x.contiguous()


def paged_attention(query: torch.Tensor, query_rope: torch.Tensor | None,
                    key_cache: torch.Tensor, key_rope_cache: torch.Tensor | None,
                    value_cache: torch.Tensor, out: torch.Tensor, metadata: AttentionMetadata,
                    scale: float, sliding_window: int | None) -> None:
    """Causal paged attention into `out` `[T, H, Dv]`: scores are `query·key` (plus
    `query_rope·key_rope` for MLA) over caches `[num_blocks, block_size, kv_heads, dim]`."""
    # The kernel reads queries and writes rows in fp32 or the cache's dtype, whichever the
    # query has (anything else goes through fp32); it accumulates in fp32 either way.
    dtype = query.dtype if query.dtype in (torch.float32, key_cache.dtype) else torch.float32
    result = out if out.dtype == dtype and out.stride(-1) == 1 else torch.empty(
        out.shape, dtype=dtype)
    torch.ops.kvgraph_cpu.paged_attention(
        _query_rows(query, dtype), None if query_rope is None else _query_rows(query_rope, dtype),
        key_cache, key_rope_cache, value_cache, result, metadata.block_table, metadata.seq_lens,
        metadata.query_start_loc, scale, sliding_window or NO_WINDOW)
    if result is not out:
        out.copy_(result)


class CPUPagedBackend(AttentionBackend):
    """C++ paged attention for the CPU (see the module docstring)."""

    name = "cpu_paged"
    device_types = ("cpu",)
    graph_support = GraphSupport.ALWAYS

    def __init__(self) -> None:
        self._reference = TorchNativeBackend()  # encoder-only attention, and the fallback
        self.fallback_reason: str | None = None
        try:
            load_kernels()
            _register_fakes()
        except KernelBuildError as error:
            self.fallback_reason = str(error)
            self.graph_support = self._reference.graph_support
            logger.warning("kvgraph: %s; CPU attention runs the torch_native backend instead",
                           error)

    def forward(self, query, key, value, kv_cache, out, metadata, scale, sliding_window,
                write_kv=True):
        if self.fallback_reason is not None:
            return self._reference.forward(query, key, value, kv_cache, out, metadata, scale,
                                           sliding_window, write_kv)
        key_cache, value_cache = kv_cache
        if write_kv:
            write_rows(key_cache, key, metadata.slot_mapping)
            write_rows(value_cache, value, metadata.slot_mapping)
        paged_attention(query, None, key_cache, None, value_cache, out, metadata, scale,
                        sliding_window)

    def forward_mla(self, q_latent, q_pe, kv_c, k_pe, kv_cache, out, metadata, scale,
                    write_kv=True):
        if self.fallback_reason is not None:
            return self._reference.forward_mla(q_latent, q_pe, kv_c, k_pe, kv_cache, out,
                                               metadata, scale, write_kv)
        kv_c_cache, k_pe_cache = kv_cache
        if write_kv:
            write_rows(kv_c_cache, kv_c, metadata.slot_mapping)
            write_rows(k_pe_cache, k_pe, metadata.slot_mapping)
        latent = kv_c_cache.unsqueeze(2)  # one KV head: [num_blocks, block_size, 1, rank]
        paged_attention(q_latent, q_pe, latent, k_pe_cache.unsqueeze(2), latent, out, metadata,
                        scale, None)

    def forward_encoder(self, query, key, value, out, metadata, scale, sliding_window=None):
        self._reference.forward_encoder(query, key, value, out, metadata, scale, sliding_window)
