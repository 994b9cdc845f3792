"""One runner's device graphs: the only record of what was captured, and capture and replay.

`GraphWrapper`s (kvgraph.compilation.graph_wrapper) sit inside the compiled model; the graphs
themselves belong to a `GraphSet`, one per runner, which the step's forward context names.
The dispatcher asks the set which descriptors have graphs (`has`); a step then runs through
`replay` (or, in the capture phase, `capture`), and every wrapper of the step's runtime mode
replays (or records) its graph for that descriptor without deciding anything itself. The set
calls the attention backend's hooks around each capture and before each replay.

Graphs are captured only inside the set's capture phase: on CUDA and NPU a capture records
kernels without running them, so a step captured on live data would return unwritten outputs
and make none of its cache writes. Capture is not compilation: the wrapped callable is built.
Dropping the set frees its graphs and its memory pool, whatever still refers to the compiled
model.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator, TypeVar

from kvgraph.attention.backends.base import AttentionBackend
from kvgraph.attention.metadata import AttentionMetadata
from kvgraph.config import GraphMode
from kvgraph.errors import GraphError
from kvgraph.forward_context import BatchDescriptor
from kvgraph.runtime.platforms import DeviceGraph, Platform

if TYPE_CHECKING:
    from kvgraph.compilation.graph_wrapper import GraphWrapper

logger = logging.getLogger(__name__)
Result = TypeVar("Result")
GraphKey = tuple[GraphMode, BatchDescriptor]


@dataclass
class GraphCounters:
    """What every GraphSet of the process did since the last `reset()` (tests, logs)."""

    captures: int = 0
    replays: int = 0
    capture_seconds: float = 0.0
    graph_bytes: int = 0  # what the captured graphs added to their pools

    def reset(self) -> None:
        for field in dataclasses.fields(self):
            setattr(self, field.name, field.default)

    def snapshot(self) -> dict:
        return dataclasses.asdict(self)


graph_counters = GraphCounters()


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """No garbage collection during capture: a collection mid-capture would free memory the
    graph recorded as live, and costs time on every one of many captures."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def graph_key(mode: GraphMode, descriptor: BatchDescriptor) -> str:
    """How stats and logs name the graphs of one descriptor in one runtime mode."""
    return f"{mode.value}:{descriptor}"


@dataclass
class GraphEntry:
    graph: DeviceGraph
    capture_seconds: float
    memory_bytes: int
    replays: int = 0


class GraphSet:
    """One runner's graphs: their memory pool, every captured graph, and the capture phase.

    `backend` is the runner's attention backend, whose hooks the set calls; `check_inputs`
    makes every replay check that its inputs did not move (debugging).
    """

    def __init__(self, platform: Platform, backend: AttentionBackend, check_inputs: bool = False):
        self.platform = platform
        self.backend = backend
        self.check_inputs = check_inputs
        self.pool = platform.new_graph_pool()
        self._graphs: dict[GraphKey, dict[GraphWrapper, GraphEntry]] = {}
        # What the backend's after_capture returned per descriptor, for its before_replay.
        self._updates: dict[GraphKey, Any] = {}
        self._phase = False
        self._recording: dict[GraphWrapper, GraphEntry] | None = None  # a capture under way
        self._replaying: dict[GraphWrapper, GraphEntry] | None = None

    def has(self, mode: GraphMode, descriptor: BatchDescriptor) -> bool:
        """Whether `descriptor`'s graphs in runtime `mode` were captured (and not released)."""
        return (mode, descriptor) in self._graphs

    @property
    def capturing(self) -> bool:
        """Whether a descriptor is being captured now."""
        return self._recording is not None

    @contextlib.contextmanager
    def capture_phase(self) -> Iterator[None]:
        """The only place graphs are captured (see the module docstring)."""
        self._phase = True
        try:
            with gc_paused(), self.platform.capture_phase():
                yield
        finally:
            self._phase = False

    def capture(self, mode: GraphMode, descriptor: BatchDescriptor, metadata: AttentionMetadata,
                forward: Callable[[], Result]) -> Result:
        """Capture every graph `forward` meets for `descriptor` in runtime `mode`.

        All or nothing: if `forward` raises, the graphs it captured are freed and the
        descriptor stays without graphs.
        """
        if not self._phase:
            raise GraphError("graphs are captured only inside GraphSet.capture_phase()")
        self.backend.before_capture(mode, descriptor, metadata)
        self._recording = recorded = {}
        try:
            result = forward()
        except BaseException:
            for entry in recorded.values():
                entry.graph.reset()
            raise
        finally:
            self._recording = None
        self._updates[(mode, descriptor)] = self.backend.after_capture(mode, descriptor, metadata)
        self._graphs[(mode, descriptor)] = recorded
        for entry in recorded.values():
            graph_counters.captures += 1
            graph_counters.capture_seconds += entry.capture_seconds
            graph_counters.graph_bytes += entry.memory_bytes
        return result

    def replay(self, mode: GraphMode, descriptor: BatchDescriptor, metadata: AttentionMetadata,
               forward: Callable[[], Result]) -> Result:
        """Run one step through `descriptor`'s graphs: `forward` replays each of them."""
        graphs = self._graphs.get((mode, descriptor))
        if graphs is None:
            raise GraphError(f"no graphs were captured for {graph_key(mode, descriptor)}; "
                             "the dispatcher asks GraphSet.has before choosing graphs")
        self.backend.before_replay(mode, descriptor, metadata, self._updates[(mode, descriptor)])
        self._replaying = graphs
        try:
            return forward()
        finally:
            self._replaying = None

    def run(self, wrapper: GraphWrapper, args: tuple) -> Any:
        """`wrapper`'s graph for the step under way: recorded in a capture, else replayed."""
        if self._recording is not None:
            return self._record(wrapper, args)
        entry = self._replaying.get(wrapper) if self._replaying is not None else None
        if entry is None:
            raise GraphError(f"graph {wrapper.name} was reached outside a replay of its "
                             "descriptor's graphs (GraphSet.replay) or was never captured")
        entry.replays += 1
        graph_counters.replays += 1
        return entry.graph.replay(args)

    def _record(self, wrapper: GraphWrapper, args: tuple) -> Any:
        start = time.perf_counter()
        graph = self.platform.make_graph(self.check_inputs, wrapper.name, wrapper.last)
        outputs = graph.capture(wrapper.runnable, args, self.pool)
        self.platform.synchronize()
        seconds = time.perf_counter() - start
        self._recording[wrapper] = GraphEntry(graph, seconds, graph.memory_bytes)
        logger.debug("kvgraph: captured %s in %.3f s, %d bytes", wrapper.name, seconds,
                     graph.memory_bytes)
        return outputs

    def entries(self) -> list[GraphEntry]:
        """Every captured graph, of every descriptor."""
        return [entry for graphs in self._graphs.values() for entry in graphs.values()]

    def descriptor_report(self, mode: GraphMode, descriptor: BatchDescriptor) -> dict[str, Any]:
        """What capturing `descriptor` in `mode` made: its graphs, their capture time, memory."""
        entries = list(self._graphs.get((mode, descriptor), {}).values())
        return {"graphs": len(entries),
                "capture_seconds": sum(e.capture_seconds for e in entries),
                "bytes": sum(e.memory_bytes for e in entries)}

    def memory_by_descriptor(self) -> dict[str, int]:
        """Bytes each descriptor's graphs added to the pool when captured."""
        return {graph_key(*key): sum(e.memory_bytes for e in graphs.values())
                for key, graphs in self._graphs.items()}

    def snapshot(self) -> dict[str, Any]:
        """What this set holds and did: graph count, replays, capture time, memory."""
        entries = self.entries()
        by_descriptor = self.memory_by_descriptor()
        return {
            "captures": len(entries),
            "replays": sum(e.replays for e in entries),
            "capture_seconds": sum(e.capture_seconds for e in entries),
            "graph_bytes": sum(by_descriptor.values()),
            "bytes_by_descriptor": by_descriptor,
        }

    def release(self) -> None:
        """Free every graph and the pool; the set then has no graphs."""
        for graphs in self._graphs.values():
            for entry in graphs.values():
                entry.graph.reset()
                graph_counters.graph_bytes -= entry.memory_bytes
        self._graphs.clear()
        self._updates.clear()
        self.pool = self.platform.new_graph_pool()

