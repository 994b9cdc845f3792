"""The CPU platform: no device graphs exist, so kvgraph's own keeps the graph contract.

The contract is what CUDA and NPU graphs impose and what must therefore be testable here:
inputs stay at the addresses they were captured at; outputs live in memory that every replay
overwrites; a capture's outputs are not results, because a device capture records kernels
without running them; and one runner's graphs share one pool, so replaying one size overwrites
what another size returned. A CPU graph runs the callable while capturing (to learn its
outputs), moves them into the pool and poisons them (NaN, or the lowest integer); on replay it
reruns the callable and copies the results into that memory. Code that uses a capture's
outputs, or holds an output across steps, therefore breaks here as it would on a GPU. A replay
calls no KV connector hooks (no Python runs in a device graph's replay), so a layer-by-layer
connector forced into a full graph misses its layers here as it would there.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Sequence

import torch
from torch import nn

from kvgraph.config import GraphMode
from kvgraph.cpu import malloc_policy
from kvgraph.cpu.huge_pages import use_huge_pages
from kvgraph.cpu.packed_linear import pack_linear_weights
from kvgraph.cpu.small_batch_linear import use_small_batch_linear
from kvgraph.devices import memory_bytes
from kvgraph.forward_context import kv_hooks_suspended
from kvgraph.runtime.platforms.base import (SERVING_CORES, check_addresses, has_storage,
                                            input_addresses, map_tensors, tensors_in)


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
        with kv_hooks_suspended():  # a device graph's replay runs no Python: no connector hooks
            fresh = self.fn(*args)
        for persistent, new in zip(tensors_in(self.outputs), tensors_in(fresh)):
            if persistent.data_ptr() != new.data_ptr():
                persistent.copy_(new)
        return self.outputs

    def reset(self) -> None:
        self.fn, self.outputs, self.memory_bytes = None, None, 0


class CPUPlatform:
    """The CPU as kvgraph and a serving engine see it; its serving defaults were measured on
    the small example Llama (docs/performance.md names each measurement)."""

    name = "cpu"
    device_type = "cpu"
    attention_backend = "cpu_paged"  # C++, reads the cache in place (torch_native: the reference)
    default_block_size = 16
    needs_warmup = False
    freezes_shapes = False  # a replay reruns Python: attention reads only a batch's real keys
    # A CPU graph saves no launches, and one graph of the whole forward skips the pieces' own
    # Python between attention ops: decode steps 7-14% faster than piecewise on one thread,
    # 7-10% at batch 1 on two (batch 16 within noise; small Llama, Zen 4,
    # benchmarks/engine_graph_modes.py; docs/performance.md, "Graph modes against eager on the CPU"), for a
    # cold compile ~1.35x piecewise's (warm: equal).
    default_graph_mode = GraphMode.FULL
    # Prefill throughput (small Llama, piecewise; benchmarks/token_budget.py) rises to 1024
    # tokens per step, 2-7% over 512's, and no further at 2048, while the longest step a
    # decoding request waits through grows with the budget (1.4x 512's at 1024). Steps above
    # the capture sizes run without graphs (see captures_decode_only).
    default_max_num_tokens = 1024
    # A CPU graph saves no launches (its replay reruns the compiled forward and copies the
    # outputs), so larger steps lose nothing running that forward without graphs (and without
    # padding to a size), while capturing them made start-up several times longer (docs/performance.md,
    # "Capture sizes on the CPU"). Decode sizes stay captured, so serving keeps the graph
    # contract's path that devices run.
    captures_decode_only = True
    # Prefill steps take tens of milliseconds, and a burst reached the engine within 1-7 ms on
    # the 2-core VM.
    default_burst_gap_ms = 3.0
    serving_cores = SERVING_CORES
    distributed_backend = "gloo"
    device_memory = None  # torch's CPU tensors come from malloc: no allocator keeps statistics

    def make_graph(self, check_inputs: bool, name: str = "cpu-graph", last: bool = False
                   ) -> CPUGraph:
        return CPUGraph(check_inputs, name)  # `last` changes nothing: the pool is shared anyway

    def capture_phase(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def new_graph_pool(self) -> CPUGraphPool:
        return CPUGraphPool()

    def synchronize(self) -> None:
        return None

    def total_memory(self, device: torch.device | str) -> int | None:
        return memory_bytes(torch.device(device))

    def rank_device(self, local_rank: int) -> str:
        return "cpu"  # the ranks share the machine's cores (each takes its share as threads)

    def set_device(self, local_rank: int) -> None:
        return None

    def prepare_model(self, model: nn.Module, *, pack_weights: bool, huge_pages: bool
                      ) -> None:
        """`pack_weights`: linear weights packed into kvgraph's CPU layouts, the rest served
        by the small-batch kernel (kvgraph.cpu.packed_linear); `huge_pages`: then every weight
        moved into memory backed by transparent huge pages (kvgraph.cpu.huge_pages)."""
        if pack_weights:
            pack_linear_weights(model)
            use_small_batch_linear(model)
        if huge_pages:  # after packing: the final bytes
            use_huge_pages(model)

    def prepare_process(self, *, keep_freed_memory: bool) -> None:
        """`keep_freed_memory`: glibc's malloc keeps what steps free, so their tensors reuse
        pages already faulted in (kvgraph.cpu.malloc_policy); call it after the load's copies."""
        if keep_freed_memory:
            malloc_policy.keep_freed_memory()
