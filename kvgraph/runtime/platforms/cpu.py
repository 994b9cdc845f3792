"""The CPU platform: no device graphs exist, so kvgraph's own keeps the graph contract.

The contract is what CUDA and NPU graphs impose and what must therefore be testable here:
inputs stay at the addresses they were captured at; outputs live in persistent buffers that
every replay overwrites; and a capture's outputs are not results, because a device capture
records kernels without running them. A CPU graph runs the callable while capturing (to learn
its outputs), then poisons them (NaN, or the lowest integer), and on replay reruns it and copies
the results into those buffers. Code that uses a capture's outputs, or holds on to an output
across steps, therefore breaks here as it would on a GPU.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Sequence

import torch

from kvgraph.runtime.platforms.base import check_addresses, input_addresses, tensors_in


def owned_outputs(outputs: Any, inputs: Sequence[Any]) -> list[torch.Tensor]:
    """The output tensors a graph holds: every one that is not (a view of) an input."""
    input_storages = {t.untyped_storage().data_ptr() for t in tensors_in(list(inputs))}
    return [t for t in tensors_in(outputs) if t.untyped_storage().data_ptr() not in input_storages]


def poison(tensors: Sequence[torch.Tensor]) -> None:
    """Fill `tensors` with values no result has: NaN, or the lowest integer."""
    for tensor in tensors:
        if tensor.dtype.is_floating_point or tensor.dtype.is_complex:
            tensor.fill_(float("nan"))
        elif tensor.dtype != torch.bool:
            tensor.fill_(torch.iinfo(tensor.dtype).min)


class CPUGraph:
    """A graph of one callable on the CPU (see the module docstring)."""

    def __init__(self, check_inputs: bool, name: str = "cpu-graph"):
        self.check_inputs = check_inputs
        self.name = name
        self.fn: Callable | None = None
        self.outputs: Any = None
        self.addresses: list[int | None] = []
        self.memory_bytes = 0

    def capture(self, fn: Callable, args: Sequence[Any], pool: Any) -> Any:
        self.fn, self.addresses = fn, input_addresses(args)
        self.outputs = fn(*args)
        owned = owned_outputs(self.outputs, args)
        poison(owned)  # an input passed through stays: a device graph aliases it too
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in owned}
        self.memory_bytes = sum(storages.values())
        return self.outputs

    def replay(self, args: Sequence[Any]) -> Any:
        if self.check_inputs:
            check_addresses(self.addresses, args, self.name)
        fresh = self.fn(*args)
        for persistent, new in zip(tensors_in(self.outputs), tensors_in(fresh)):
            if persistent.data_ptr() != new.data_ptr():
                persistent.copy_(new)
        return self.outputs

    def reset(self) -> None:
        self.fn, self.outputs, self.memory_bytes = None, None, 0


class CPUPlatform:
    name = "cpu"
    device_type = "cpu"
    attention_backend = "torch_native"
    needs_warmup = False
    freezes_shapes = False  # a replay reruns Python: attention reads only a batch's real keys

    def make_graph(self, check_inputs: bool) -> CPUGraph:
        return CPUGraph(check_inputs)

    def capture_phase(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def new_graph_pool(self) -> None:
        return None

    def synchronize(self) -> None:
        return None
