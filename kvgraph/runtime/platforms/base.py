"""What kvgraph asks of a device: graphs, a graph memory pool per runner, synchronisation."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager, Iterator, Protocol, Sequence

import torch

from kvgraph.errors import GraphError


def tensors_in(tree: Any) -> list[torch.Tensor]:
    """Every tensor in a nest of tuples/lists (graph inputs and outputs are such nests)."""
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, (tuple, list)):
        return [t for item in tree for t in tensors_in(item)]
    return []


def map_tensors(tree: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """`tree` with every tensor replaced by `fn(tensor)`, its tuples and lists kept."""
    if isinstance(tree, torch.Tensor):
        return fn(tree)
    if isinstance(tree, (tuple, list)):
        return type(tree)(map_tensors(item, fn) for item in tree)
    return tree


def weak_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor on `tensor`'s memory that does not keep it alive.

    What a device graph keeps of its outputs: their memory belongs to the graph pool, which
    every graph of the runner shares, so holding them would keep each size's apart.
    """
    storage = tensor.untyped_storage()
    alias = torch._C._construct_storage_from_data_pointer(storage.data_ptr(), tensor.device,
                                                          storage.nbytes())
    return torch.empty(0, dtype=tensor.dtype, device=tensor.device).set_(
        alias, tensor.storage_offset(), tensor.shape, tensor.stride())


def has_storage(tensor: torch.Tensor) -> bool:
    """Whether `tensor` has memory of its own to point at: an opaque tensor (a oneDNN-packed
    weight, `layout=torch._mkldnn`) keeps its memory where torch cannot see it."""
    return tensor.layout != torch._mkldnn


def input_addresses(args: Sequence[Any]) -> list[int | None]:
    """The data pointer of each tensor argument (None for non-tensors and opaque tensors,
    which are packed weights: built once, never refilled, so nothing to check)."""
    return [a.data_ptr() if isinstance(a, torch.Tensor) and has_storage(a) else None
            for a in args]


def check_addresses(captured: list[int | None], args: Sequence[Any], name: str) -> None:
    """A graph replays on the addresses it was captured with; anything else reads stale memory."""
    moved = [i for i, (a, b) in enumerate(zip(captured, input_addresses(args))) if a != b]
    if moved or len(captured) != len(args):
        raise GraphError(
            f"graph {name}: inputs {moved} are not at the addresses they were captured at; "
            f"graph inputs must be persistent buffers (filled in place, never reallocated)"
        )


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


class DeviceGraph(Protocol):
    """One captured graph: `capture` records `fn(*args)`, `replay` reruns it on the same buffers.

    What `capture` returns is not a result (a device capture runs nothing): it is the buffers
    that every replay overwrites. `memory_bytes` is what the capture added to the pool (the
    first, largest size's captures hold what later ones reuse); `reset` frees the graph.
    """

    memory_bytes: int

    def capture(self, fn: Callable, args: Sequence[Any], pool: Any) -> Any: ...

    def replay(self, args: Sequence[Any]) -> Any: ...

    def reset(self) -> None: ...


class Platform(Protocol):
    """One kind of device, as the graph wrapper and the runner see it."""

    name: str
    device_type: str
    attention_backend: str  # the default attention backend's name
    default_block_size: int  # tokens per cache block when the runner is not told
    needs_warmup: bool  # whether a batch must run once before it is captured
    # Whether a graph freezes the host ints attention's shapes depend on (`max_seq_len`): a
    # device graph does; the CPU graph reruns Python on replay.
    freezes_shapes: bool

    def make_graph(self, check_inputs: bool, name: str = "graph", last: bool = False
                   ) -> DeviceGraph:
        """A graph for the wrapper called `name`; `last`: it produces the forward's outputs."""

    def capture_phase(self) -> ContextManager[None]:
        """Entered around a runner's whole capture phase (many captures in a row)."""

    def new_graph_pool(self) -> Any:
        """A fresh memory pool for one runner's graphs (None where graphs need none)."""

    def synchronize(self) -> None: ...


def _keep_cache() -> None:
    """`empty_cache` during a capture phase: the cache stays (see StreamPlatform)."""


class StreamPlatform:
    """A platform over a torch device module with the CUDA graph API (`torch.cuda`, `torch.npu`).

    `module` provides `graph`, `graph_pool_handle`, `synchronize` and `memory_snapshot`;
    `graph_class` is its graph type (`CUDAGraph`, `NPUGraph`); `stream_graph` the StreamGraph
    (sub)class that captures and replays them.
    """

    needs_warmup = True  # first runs initialise kernels and handles that capture cannot
    freezes_shapes = True

    def __init__(self, name: str, module: Any, graph_class: Callable[[], Any],
                 attention_backend: str = "torch_native", default_block_size: int = 16,
                 stream_graph: type[StreamGraph] = StreamGraph):
        self.name = self.device_type = name
        self.module, self.graph_class = module, graph_class
        self.attention_backend = attention_backend
        self.default_block_size = default_block_size
        self.stream_graph = stream_graph

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
