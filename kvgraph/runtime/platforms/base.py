"""What kvgraph asks of a device: graphs, a graph memory pool per runner, synchronisation, and
the defaults a serving engine takes for it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, ContextManager, Protocol, Sequence

import torch
from torch import nn

from kvgraph.errors import GraphError

if TYPE_CHECKING:
    from kvgraph.config import GraphMode

# Cores a serving process leaves to its threads that are not torch's compute threads: the
# server's event loop and the engine loop's own Python between steps. vLLM's CPU backend makes
# the same choice (a core left for its server processes); not measured apart on accelerators.
SERVING_CORES = 1


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


class DeviceMemory(Protocol):
    """What a profiling step reads of a device's caching allocator (`torch.cuda`'s API)."""

    def synchronize(self, device: Any) -> None: ...

    def reset_peak_memory_stats(self, device: Any) -> None: ...

    def max_memory_allocated(self, device: Any) -> int: ...

    def memory_reserved(self, device: Any) -> int: ...

    def mem_get_info(self, device: Any) -> tuple[int, int]: ...


class Platform(Protocol):
    """One kind of device, as the graph wrapper, the runner and a serving engine see it.

    The serving defaults are what an engine takes when its flags do not say; each platform's
    values carry the measurements (or the lack of them) behind them.
    """

    name: str
    device_type: str
    attention_backend: str  # the default attention backend's name
    default_block_size: int  # tokens per cache block when the runner is not told
    needs_warmup: bool  # whether a batch must run once before it is captured
    # Whether a graph freezes the host ints attention's shapes depend on (`max_seq_len`): a
    # device graph does; the CPU graph reruns Python on replay.
    freezes_shapes: bool
    default_graph_mode: GraphMode | None  # None: kvgraph's own default (piecewise)
    default_max_num_tokens: int  # the token budget of one step
    # Whether the default capture sizes stop at a decode step's largest batch (the larger
    # steps then run without graphs).
    captures_decode_only: bool
    # How long an idle server waits for the rest of a burst of requests before stepping.
    default_burst_gap_ms: float
    serving_cores: int  # cores left to a process's threads other than torch's compute threads
    distributed_backend: str  # the torch.distributed backend of a tensor-parallel group
    # The allocator a profiling step reads to size the KV cache; None where none tracks memory.
    device_memory: DeviceMemory | None

    def make_graph(self, check_inputs: bool, name: str = "graph", last: bool = False
                   ) -> DeviceGraph:
        """A graph for the wrapper called `name`; `last`: it produces the forward's outputs."""

    def capture_phase(self) -> ContextManager[None]:
        """Entered around a runner's whole capture phase (many captures in a row)."""

    def new_graph_pool(self) -> Any:
        """A fresh memory pool for one runner's graphs (None where graphs need none)."""

    def synchronize(self) -> None: ...

    def total_memory(self, device: torch.device | str) -> int | None:
        """All the memory `device` has (the machine's RAM for the CPU); None when unknown."""

    def rank_device(self, local_rank: int) -> str:
        """The device tensor-parallel rank `local_rank` of a node runs on: an accelerator of
        its own, or the one CPU the ranks share."""

    def set_device(self, local_rank: int) -> None:
        """Make `rank_device(local_rank)` this process's current device."""

    def prepare_model(self, model: nn.Module, *, pack_weights: bool, huge_pages: bool
                      ) -> None:
        """Lay out a loaded model's weights for serving here, in place, before it compiles:
        `pack_weights` into the device's faster linear layouts, `huge_pages` into memory
        backed by huge pages (nothing where the device has no such layouts)."""

    def prepare_process(self, *, keep_freed_memory: bool) -> None:
        """After the model's load: process-wide settings for serving; `keep_freed_memory`
        keeps memory a step frees for the next (nothing where the device allocator caches)."""
