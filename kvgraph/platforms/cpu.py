"""The CPU platform: no device graphs exist, so kvgraph's own keeps the graph contract.

The contract is what CUDA and NPU graphs impose and what must therefore be testable here:
inputs stay at the addresses they were captured at, and outputs live in persistent buffers that
every replay overwrites. A CPU graph reruns the callable and copies its results into those
buffers, so code that holds on to an output across steps breaks here as it would on a GPU.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence


from kvgraph.platforms.base import check_addresses, input_addresses, tensors_in


class CPUGraph:
    """A graph of one callable on the CPU (see the module docstring)."""

    def __init__(self, check_inputs: bool, name: str = "cpu-graph"):
        self.check_inputs = check_inputs
        self.name = name
        self.fn: Callable | None = None
        self.outputs: Any = None
        self.addresses: list[int | None] = []

    def capture(self, fn: Callable, args: Sequence[Any], pool: Any) -> Any:
        self.fn, self.addresses = fn, input_addresses(args)
        self.outputs = fn(*args)
        return self.outputs

    def replay(self, args: Sequence[Any]) -> Any:
        if self.check_inputs:
            check_addresses(self.addresses, args, self.name)
        fresh = self.fn(*args)
        for persistent, new in zip(tensors_in(self.outputs), tensors_in(fresh)):
            if persistent.data_ptr() != new.data_ptr():
                persistent.copy_(new)
        return self.outputs

    @property
    def memory_bytes(self) -> int:
        return sum(t.untyped_storage().nbytes() for t in tensors_in(self.outputs))


class CPUPlatform:
    name = "cpu"
    device_type = "cpu"
    attention_backend = "torch_native"
    needs_warmup = False

    def make_graph(self, check_inputs: bool) -> CPUGraph:
        return CPUGraph(check_inputs)

    def graph_pool(self) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def memory_in_use(self) -> int:
        return 0
