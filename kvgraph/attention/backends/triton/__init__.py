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

from kvgraph.attention.backends.base import AttentionBackend, GraphSupport, StepLengths
from kvgraph.attention.backends.triton.encoder import encoder_attention
from kvgraph.attention.backends.triton.launch import LaunchPlan
from kvgraph.attention.backends.triton.mla import mla_attention
from kvgraph.attention.backends.triton.paged import write_rows
from kvgraph.attention.backends.triton.unified import unified_attention
from kvgraph.forward_context import BatchDescriptor


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (`TRITON_INTERPRET=1`)."""
    knobs = getattr(triton, "knobs", None)
    return bool(knobs is not None and knobs.runtime.interpret)


class TritonBackend(AttentionBackend):
    """Triton kernels behind every kvgraph attention op (see the module docstring).

    A step's `LaunchPlan` (`plan_class`) sizes each launch once per layer geometry. Buffers:
    split-KV partial results are views of `metadata.workspace` (the runner's persistent fp32
    scratch, which never moves, so a captured graph may hold it); when it is missing or too
    small, the plan allocates them once per step and geometry and every layer shares them (a
    graph captured then holds the allocation from its pool). Nothing else persists.
    """

    name = "triton"
    # Launch grids depend only on tensor shapes, and lengths stay on the device.
    graph_support = GraphSupport.ALWAYS
    device_types = ("cuda", "cpu") if interpreting() else ("cuda",)
    plan_class = LaunchPlan

    def frozen_lengths(self, descriptor: BatchDescriptor, batch: StepLengths,
                       max_model_len: int) -> StepLengths:
        """What a step replayed from a device's full graph of `descriptor` carries.

        The only host length the kernels read is `max_query_len` (it picks the query-block size,
        so the grid): frozen at 1 for uniform decode, else at the descriptor's `num_tokens`.
        Sequence lengths are read from `seq_lens` on the device, so `max_seq_len` stays the
        batch's own (freezing it would change nothing the kernels do).
        """
        frozen = super().frozen_lengths(descriptor, batch, max_model_len)
        return frozen._replace(max_seq_len=batch.max_seq_len)

    def forward(self, query, key, value, kv_cache, out, metadata, scale, sliding_window,
                write_kv=True):
        if write_kv:
            write_rows(kv_cache, (key, value), metadata.slot_mapping)
        unified_attention(query, kv_cache[0], kv_cache[1], out, metadata, scale, sliding_window,
                          plan=self.step_plan(metadata))

    def forward_mla(self, q_latent, q_pe, kv_c, k_pe, kv_cache, out, metadata, scale,
                    write_kv=True):
        if write_kv:
            write_rows(kv_cache, (kv_c, k_pe), metadata.slot_mapping)
        mla_attention(q_latent, q_pe, kv_cache[0], kv_cache[1], out, metadata, scale,
                      plan=self.step_plan(metadata))

    def forward_encoder(self, query, key, value, out, metadata, scale, sliding_window=None):
        encoder_attention(query, key, value, out, metadata, scale, sliding_window)
