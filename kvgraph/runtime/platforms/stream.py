"""Platforms over a torch device module with the CUDA graph API (`torch.cuda`, `torch.npu`)."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import nn

from kvgraph.runtime.platforms.base import (SERVING_CORES, check_addresses, input_addresses,
                                            map_tensors, weak_tensor)


class StreamGraph:
    """A device graph of a torch graph API (CUDA, NPU): outputs are what capture produced.

    `graph` is the API's graph object, `graph_context(graph, pool=...)` its capture context and
    `pool_bytes(pool)` the bytes its allocator holds for a graph pool: what a capture adds to
    the pool is what the graph costs. Capture records kernels without running them, so its
    outputs hold no results until the first replay.

    Memory is shared across sizes, as vLLM does it: the graph keeps only weak references to
    its outputs, so once a step's forward has used them their memory returns to the pool and
    the next (smaller) capture reuses it. A `last` graph's outputs (the forward's own) are
    released inside the capture, since nothing captured after them reads them. Replays of one
    pool never overlap, so sharing is safe; an output is valid until the next replay.
    """

    def __init__(self, graph: Any, graph_context: Callable, pool_bytes: Callable[[Any], int],
                 check_inputs: bool, name: str, last: bool):
        self.graph, self.graph_context, self.pool_bytes = graph, graph_context, pool_bytes
        self.check_inputs, self.name, self.last = check_inputs, name, last
        self.outputs: Any = None
        self.addresses: list[int | None] = []
        self.memory_bytes = 0

    def capture(self, fn: Callable, args: Sequence[Any], pool: Any) -> Any:
        self.addresses = input_addresses(args)
        before = self.pool_bytes(pool)
        with self.graph_context(self.graph, pool=pool):
            outputs = fn(*args)
            if self.last:
                outputs = map_tensors(outputs, weak_tensor)
        self.outputs = map_tensors(outputs, weak_tensor)
        # A pool only grows while its graphs live; the clamp guards an allocator that reports
        # less than it holds.
        self.memory_bytes = max(0, self.pool_bytes(pool) - before)
        return outputs

    def replay(self, args: Sequence[Any]) -> Any:
        if self.check_inputs:
            check_addresses(self.addresses, args, self.name)
        self.graph.replay()
        return self.outputs

    def reset(self) -> None:
        self.outputs = None
        self.graph.reset()


def _keep_cache() -> None:
    """`empty_cache` during a capture phase: the cache stays (see StreamPlatform)."""


class StreamPlatform:
    """A platform over a torch device module with the CUDA graph API (`torch.cuda`, `torch.npu`).

    `module` provides `graph`, `graph_pool_handle`, `synchronize`, `memory_snapshot`,
    `set_device`, `get_device_properties` and its caching allocator's statistics (DeviceMemory);
    `graph_class` is its graph type (`CUDAGraph`, `NPUGraph`); `stream_graph` the StreamGraph
    (sub)class that captures and replays them; `distributed_backend` the collectives' backend.
    """

    needs_warmup = True  # first runs initialise kernels and handles that capture cannot
    freezes_shapes = True
    default_graph_mode = None  # kvgraph's, piecewise: the full graph is not measured here
    captures_decode_only = False  # a graph saves kernel launches at every size
    # Not yet measured: small enough that capturing every size stays quick.
    default_max_num_tokens = 128
    # A step takes a few milliseconds, so waiting for a burst would cost a lone request's time
    # to first token as much as it saves: off unless asked for.
    default_burst_gap_ms = 0.0
    serving_cores = SERVING_CORES

    def __init__(self, name: str, module: Any, graph_class: Callable[[], Any],
                 distributed_backend: str, attention_backend: str = "torch_native",
                 default_block_size: int = 16, stream_graph: type[StreamGraph] = StreamGraph):
        self.name = self.device_type = name
        self.module, self.graph_class = module, graph_class
        self.distributed_backend = distributed_backend
        self.attention_backend = attention_backend
        self.default_block_size = default_block_size
        self.stream_graph = stream_graph
        self.device_memory = module  # the module's caching allocator answers DeviceMemory

    def make_graph(self, check_inputs: bool, name: str = "graph", last: bool = False
                   ) -> StreamGraph:
        return self.stream_graph(self.graph_class(), self.module.graph, self.pool_bytes,
                                 check_inputs, f"{self.name}-graph {name}", last)

    @contextlib.contextmanager
    def capture_phase(self) -> Iterator[None]:
        """Captures without emptying the allocator's cache before each one.

        The device module's `graph` context empties it on entry, to give the graph the most
        memory; over hundreds of captures in a row that frees and re-allocates the warm-up
        runs' memory every time, which is most of the capture time (vLLM skips it too).
        """
        empty_cache = self.module.empty_cache
        self.module.empty_cache = _keep_cache
        try:
            yield
        finally:
            self.module.empty_cache = empty_cache

    def new_graph_pool(self) -> Any:
        # Per runner, never per process: a pool handle reused after the graphs captured in it
        # were freed trips the caching allocator (`use_count > 0` assert, seen on an H200).
        return self.module.graph_pool_handle()

    def pool_bytes(self, pool: Any) -> int:
        """Bytes of the segments the allocator reserved for `pool`."""
        pool_id = tuple(pool)
        return sum(segment["total_size"] for segment in self.module.memory_snapshot()
                   if tuple(segment.get("segment_pool_id", ())) == pool_id)

    def synchronize(self) -> None:
        self.module.synchronize()

    def total_memory(self, device: torch.device | str) -> int | None:
        return int(self.module.get_device_properties(device).total_memory)

    def rank_device(self, local_rank: int) -> str:
        return f"{self.device_type}:{local_rank}"

    def set_device(self, local_rank: int) -> None:
        self.module.set_device(local_rank)

    def prepare_model(self, model: nn.Module, *, pack_weights: bool, huge_pages: bool
                      ) -> None:
        """Nothing: the weights stay as loaded (the packed layouts and huge pages are the
        CPU's)."""

    def prepare_process(self, *, keep_freed_memory: bool) -> None:
        """Nothing: the device's caching allocator already keeps what steps free."""
