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
