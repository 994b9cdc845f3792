"""The dummy batches a runner compiles and captures with: shaped like a descriptor's real
batches, writing nothing.

Capture records shapes, not values, so a dummy only has to look like the batches a graph will
replay: a uniform descriptor's dummy has its `num_reqs` requests of `query_len` tokens each (a
verify step's 1 + K tokens, or a decode step's one); any other key's has one-token requests and
is padded to the descriptor by the input buffers. Every request reads block 0 and nothing is
written (the step is prepared with `writes_cache=False`), so no real block is touched.
"""

from __future__ import annotations

from kvgraph.attention.batch import HostBatch, host_batch
from kvgraph.attention.metadata import RequestChunk, cdiv
from kvgraph.forward_context import BatchDescriptor


def dummy_batch(num_reqs: int, block_size: int, query_len: int = 1) -> HostBatch:
    """`num_reqs` requests of `query_len` new tokens each, on an empty cache, all in block 0."""
    chunk = RequestChunk([0] * query_len, 0, [0] * cdiv(query_len, block_size))
    return host_batch([chunk] * num_reqs, block_size)


def capture_dummy(descriptor: BatchDescriptor, block_size: int) -> HostBatch:
    """The dummy batch `descriptor`'s graphs are captured with (see the module docstring)."""
    if descriptor.uniform_decode and descriptor.num_reqs is not None:
        return dummy_batch(descriptor.num_reqs, block_size, descriptor.query_len)
    return dummy_batch(descriptor.num_reqs or 1, block_size)
