"""The CUDA platform: `torch.cuda.CUDAGraph` captured into one shared memory pool."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from kvgraph.platforms.base import check_addresses, input_addresses


class CUDAGraph:
    """One `torch.cuda.CUDAGraph`; its outputs are the tensors produced during capture."""

    def __init__(self, check_inputs: bool):
        self.check_inputs = check_inputs
        self.graph = torch.cuda.CUDAGraph()
        self.outputs: Any = None
        self.addresses: list[int | None] = []
        self.memory_bytes = 0

    def capture(self, fn: Callable, args: Sequence[Any], pool: Any) -> Any:
        self.addresses = input_addresses(args)
        before = torch.cuda.memory_reserved()
        with torch.cuda.graph(self.graph, pool=pool):
            self.outputs = fn(*args)
        self.memory_bytes = torch.cuda.memory_reserved() - before
        return self.outputs

    def replay(self, args: Sequence[Any]) -> Any:
        if self.check_inputs:
            check_addresses(self.addresses, args, "cuda-graph")
        self.graph.replay()
        return self.outputs


class CUDAPlatform:
    name = "cuda"
    device_type = "cuda"
    attention_backend = "torch_native"
    needs_warmup = True

    def __init__(self) -> None:
        self._pool: Any = None

    def make_graph(self, check_inputs: bool) -> CUDAGraph:
        return CUDAGraph(check_inputs)

    def graph_pool(self) -> Any:
        # One pool for every graph: graphs replay one at a time, so they can share memory.
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        return self._pool

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def memory_in_use(self) -> int:
        return torch.cuda.memory_allocated()
