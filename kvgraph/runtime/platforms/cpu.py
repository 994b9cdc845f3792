"""The CPU platform: no device graphs exist, so kvgraph's own keeps the graph contract.

The contract is what CUDA and NPU graphs impose and what must therefore be testable here:
inputs stay at the addresses they were captured at; outputs live in memory that every replay
overwrites; a capture's outputs are not results, because a device capture records kernels
without running them; and one runner's graphs share one pool, so replaying one size overwrites
what another size returned. A CPU graph runs the callable while capturing (to learn its
outputs), moves them into the pool and poisons them (NaN, or the lowest integer); on replay it
reruns the callable and copies the results into that memory. Code that uses a capture's
outputs, or holds an output across steps, therefore breaks here as it would on a GPU.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Sequence

import torch

from kvgraph.runtime.platforms.base import (check_addresses, has_storage, input_addresses,
                                            map_tensors, tensors_in)


def poison(tensors: Sequence[torch.Tensor]) -> None:
    """Fill `tensors` with values no result has: NaN, or the lowest integer."""
    for tensor in tensors:
        if tensor.dtype.is_floating_point or tensor.dtype.is_complex:
            tensor.fill_(float("nan"))
        elif tensor.dtype != torch.bool:
            tensor.fill_(torch.iinfo(tensor.dtype).min)


def span_bytes(tensor: torch.Tensor) -> int:
    """Bytes from a tensor's first element to its last, strides included."""
    if tensor.numel() == 0:
        return 0
    span = 1 + sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))
    return span * tensor.element_size()


class CPUGraphPool:
    """The memory one runner's CPU graphs share, as a device graph pool is shared.

    Each graph position (a wrapper's name) and output index owns one buffer, sized by the
    first (largest) capture and reused by every smaller one, so all sizes of a piece hold one
    buffer, not one each. A capture larger than its buffer gets a new one.
    """

    def __init__(self) -> None:
        self.buffers: dict[tuple[str, int], torch.Tensor] = {}
        self.nbytes = 0  # every buffer ever made: what the pool holds

    def output_like(self, name: str, index: int, tensor: torch.Tensor) -> torch.Tensor:
        """A tensor of `tensor`'s shape, strides and dtype in the memory of output `index` of
        the graph `name`."""
        needed = span_bytes(tensor)
        buffer = self.buffers.get((name, index))
        if buffer is None or buffer.numel() < needed:
            buffer = self.buffers[(name, index)] = torch.empty(needed, dtype=torch.uint8)
            self.nbytes += needed
        return buffer[:needed].view(tensor.dtype).as_strided(tensor.shape, tensor.stride())


class CPUGraph:
    """A graph of one callable on the CPU (see the module docstring)."""

    def __init__(self, check_inputs: bool, name: str = "cpu-graph"):
        self.check_inputs = check_inputs
        self.name = name
        self.fn: Callable | None = None
        self.outputs: Any = None
        self.addresses: list[int | None] = []
        self.memory_bytes = 0

    def capture(self, fn: Callable, args: Sequence[Any], pool: CPUGraphPool | None) -> Any:
        """Run `fn` once and keep its outputs in `pool` (or in buffers of their own), poisoned;
        outputs that are (views of) inputs pass through, as a device graph aliases them."""
        self.fn, self.addresses = fn, input_addresses(args)
        inputs = {t.untyped_storage().data_ptr() for t in tensors_in(list(args)) if has_storage(t)}
        before = pool.nbytes if pool is not None else 0
        owned: list[torch.Tensor] = []

        def persistent(tensor: torch.Tensor) -> torch.Tensor:
            if tensor.untyped_storage().data_ptr() in inputs:
                return tensor
            if pool is not None:
                tensor = pool.output_like(self.name, len(owned), tensor)
            owned.append(tensor)
            return tensor

        self.outputs = map_tensors(fn(*args), persistent)
        poison(owned)
        if pool is not None:
            self.memory_bytes = pool.nbytes - before
        else:
            self.memory_bytes = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                                     for t in owned}.values())
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
    attention_backend = "cpu_paged"  # C++, reads the cache in place (torch_native: the reference)
    default_block_size = 16
    needs_warmup = False
    freezes_shapes = False  # a replay reruns Python: attention reads only a batch's real keys

    def make_graph(self, check_inputs: bool, name: str = "cpu-graph", last: bool = False
                   ) -> CPUGraph:
        return CPUGraph(check_inputs, name)  # `last` changes nothing: the pool is shared anyway

    def capture_phase(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def new_graph_pool(self) -> CPUGraphPool:
        return CPUGraphPool()

    def synchronize(self) -> None:
        return None
