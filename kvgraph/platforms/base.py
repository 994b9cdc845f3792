"""What kvgraph asks of a device: graphs, a shared graph memory pool, synchronisation, memory."""

from __future__ import annotations

from typing import Any, Callable, Protocol, Sequence

import torch

from kvgraph.errors import GraphError


def tensors_in(tree: Any) -> list[torch.Tensor]:
    """Every tensor in a nest of tuples/lists (graph inputs and outputs are such nests)."""
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, (tuple, list)):
        return [t for item in tree for t in tensors_in(item)]
    return []


def input_addresses(args: Sequence[Any]) -> list[int | None]:
    """The data pointer of each tensor argument (None for non-tensors)."""
    return [a.data_ptr() if isinstance(a, torch.Tensor) else None for a in args]


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
    `memory_reserved()` its allocator's reserved bytes (the pool growth is what a graph costs).
    """

    def __init__(self, graph: Any, graph_context: Callable, memory_reserved: Callable[[], int],
                 check_inputs: bool, name: str):
        self.graph, self.graph_context, self.memory_reserved = graph, graph_context, memory_reserved
        self.check_inputs, self.name = check_inputs, name
        self.outputs: Any = None
        self.addresses: list[int | None] = []
        self.memory_bytes = 0

    def capture(self, fn: Callable, args: Sequence[Any], pool: Any) -> Any:
        self.addresses = input_addresses(args)
        before = self.memory_reserved()
        with self.graph_context(self.graph, pool=pool):
            self.outputs = fn(*args)
        self.memory_bytes = self.memory_reserved() - before
        return self.outputs

    def replay(self, args: Sequence[Any]) -> Any:
        if self.check_inputs:
            check_addresses(self.addresses, args, self.name)
        self.graph.replay()
        return self.outputs


class DeviceGraph(Protocol):
    """One captured graph: `capture` records `fn(*args)`, `replay` reruns it on the same buffers.

    Outputs live in buffers owned by the graph and are overwritten by the next replay.
    """

    def capture(self, fn: Callable, args: Sequence[Any], pool: Any) -> Any: ...

    def replay(self, args: Sequence[Any]) -> Any: ...


class Platform(Protocol):
    """One kind of device, as the graph wrapper and the runner see it."""

    name: str
    device_type: str
    attention_backend: str  # the default attention backend's name
    needs_warmup: bool  # whether a batch must run once before it is captured

    def make_graph(self, check_inputs: bool) -> DeviceGraph: ...

    def graph_pool(self) -> Any: ...

    def synchronize(self) -> None: ...

    def memory_in_use(self) -> int: ...


class StreamPlatform:
    """A platform over a torch device module with the CUDA graph API (`torch.cuda`, `torch.npu`).

    `module` provides `graph`, `graph_pool_handle`, `synchronize`, `memory_allocated` and
    `memory_reserved`; `graph_class` is its graph type (`CUDAGraph`, `NPUGraph`).
    """

    needs_warmup = True  # first runs initialise kernels and handles that capture cannot
    attention_backend = "torch_native"

    def __init__(self, name: str, module: Any, graph_class: Callable[[], Any]):
        self.name = self.device_type = name
        self.module, self.graph_class = module, graph_class
        self._pool: Any = None

    def make_graph(self, check_inputs: bool) -> StreamGraph:
        return StreamGraph(self.graph_class(), self.module.graph, self.module.memory_reserved,
                           check_inputs, f"{self.name}-graph")

    def graph_pool(self) -> Any:
        # One pool for every graph: graphs replay one at a time, so they can share memory.
        if self._pool is None:
            self._pool = self.module.graph_pool_handle()
        return self._pool

    def synchronize(self) -> None:
        self.module.synchronize()

    def memory_in_use(self) -> int:
        return self.module.memory_allocated()
