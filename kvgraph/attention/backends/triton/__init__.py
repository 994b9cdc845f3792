"""Paged attention in Triton kernels: the cache write, and unified, MLA and encoder attention.

The kernels take sequence lengths, query offsets and block tables as device tensors and never
sync with the host, and their launch grids depend only on tensor shapes (tokens, requests,
heads) and the planned `max_query_len`, never on a batch's contents: full graphs can hold any
batch. Unified attention gives each program a block of one request's query tokens and one KV
head, with every query head of that head's group as rows of tensor-core dots (GQA reads each key
once); each program reads only its request's real keys, so its cost does not depend on
`max_model_len`. Accumulation is fp32 with an online softmax; padding tokens and requests
without keys produce zeros.

Under `TRITON_INTERPRET=1` Triton runs the kernels on CPU tensors: that is how CI tests them.
"""

from __future__ import annotations

import triton

from kvgraph.attention.backends.base import GraphSupport
from kvgraph.attention.backends.triton.encoder import encoder_attention
from kvgraph.attention.backends.triton.mla import mla_attention
from kvgraph.attention.backends.triton.paged import write_rows
from kvgraph.attention.backends.triton.unified import unified_attention


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (`TRITON_INTERPRET=1`)."""
    knobs = getattr(triton, "knobs", None)
    return bool(knobs is not None and knobs.runtime.interpret)


class TritonBackend:
    """Triton kernels behind every kvgraph attention op (see the module docstring)."""

    name = "triton"
    # Launch grids depend only on tensor shapes, and lengths stay on the device.
    graph_support = GraphSupport.ALWAYS
    device_types = ("cuda", "cpu") if interpreting() else ("cuda",)

    def forward(self, query, key, value, kv_cache, out, metadata, scale, sliding_window,
                write_kv=True):
        if write_kv:
            write_rows(kv_cache, (key, value), metadata.slot_mapping)
        unified_attention(query, kv_cache[0], kv_cache[1], out, metadata, scale, sliding_window)

    def forward_mla(self, q_latent, q_pe, kv_c, k_pe, kv_cache, out, metadata, scale,
                    write_kv=True):
        if write_kv:
            write_rows(kv_cache, (kv_c, k_pe), metadata.slot_mapping)
        mla_attention(q_latent, q_pe, kv_cache[0], kv_cache[1], out, metadata, scale)

    def forward_encoder(self, query, key, value, out, metadata, scale, sliding_window=None):
        encoder_attention(query, key, value, out, metadata, scale, sliding_window)
