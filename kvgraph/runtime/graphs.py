"""One runner's device graphs: capture and replay per GraphWrapper and BatchDescriptor.

`GraphWrapper`s (kvgraph.compilation.graph_wrapper) sit inside the compiled model; the graphs
themselves belong to a `GraphSet`, one per runner, which the step's forward context names.
Dropping the set frees its graphs and its memory pool, whatever still refers to the compiled
model (Dynamo's caches do).

Graphs are captured only inside the set's capture phase: on CUDA and NPU a capture records
kernels without running them, so a step captured on live data would return unwritten outputs
and make none of its cache writes. Outside the phase a descriptor without a graph runs without
one. Capture is not compilation: the wrapped callable is already built.
"""

from __future__ import annotations

import collections
import contextlib
import gc
import logging
import time
from dataclasses import dataclass
from typing import Any, Iterator

from kvgraph.compilation.counters import graph_counters
from kvgraph.compilation.graph_wrapper import GraphWrapper
from kvgraph.config import GraphMode
from kvgraph.forward_context import BatchDescriptor
from kvgraph.runtime.platforms import DeviceGraph, Platform

logger = logging.getLogger(__name__)


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
    key: str  # graph_key of its mode and descriptor
    capture_seconds: float
    memory_bytes: int
    replays: int = 0


class GraphSet:
    """One runner's graphs: their memory pool, every captured graph, and the capture phase.

    `check_inputs` makes every replay check that its inputs did not move (debugging).
    """

    def __init__(self, platform: Platform, check_inputs: bool = False):
        self.platform = platform
        self.check_inputs = check_inputs
        self.pool = platform.new_graph_pool()
        self.entries: dict[tuple[GraphWrapper, BatchDescriptor], GraphEntry] = {}
        self.capturing = False
        self._warned: set[str] = set()

    @contextlib.contextmanager
    def capture_phase(self) -> Iterator[None]:
        """The only place graphs are captured (see the module docstring)."""
        self.capturing = True
        try:
            with gc_paused(), self.platform.capture_phase():
                yield
        finally:
            self.capturing = False

    def run(self, wrapper: GraphWrapper, descriptor: BatchDescriptor, args: tuple) -> Any:
        """Replay `wrapper`'s graph for `descriptor`; capture it in the capture phase."""
        entry = self.entries.get((wrapper, descriptor))
        if entry is not None:
            entry.replays += 1
            graph_counters.replays += 1
            return entry.graph.replay(args)
        if self.capturing:
            return self._capture(wrapper, descriptor, args)
        key = graph_key(wrapper.runtime_mode, descriptor)
        if key not in self._warned:
            self._warned.add(key)
            logger.info("kvgraph: no graph was captured for %s; it runs without graphs "
                        "(graphs are captured only by ModelRunner.capture())", key)
        return wrapper.runnable(*args)

    def _capture(self, wrapper: GraphWrapper, descriptor: BatchDescriptor, args: tuple) -> Any:
        start = time.perf_counter()
        graph = self.platform.make_graph(self.check_inputs)
        outputs = graph.capture(wrapper.runnable, args, self.pool)
        self.platform.synchronize()
        entry = GraphEntry(graph, graph_key(wrapper.runtime_mode, descriptor),
                           time.perf_counter() - start, graph.memory_bytes)
        self.entries[(wrapper, descriptor)] = entry
        graph_counters.captures += 1
        graph_counters.capture_seconds += entry.capture_seconds
        graph_counters.graph_bytes += entry.memory_bytes
        logger.debug("kvgraph: captured %s for %s in %.3f s, %d bytes", wrapper.name, entry.key,
                     entry.capture_seconds, entry.memory_bytes)
        return outputs

    def discard(self, mode: GraphMode, descriptor: BatchDescriptor) -> None:
        """Drop every graph of one descriptor (what a failed capture left of its pieces)."""
        key = graph_key(mode, descriptor)
        for index, entry in list(self.entries.items()):
            if entry.key == key:
                entry.graph.reset()
                graph_counters.graph_bytes -= entry.memory_bytes
                del self.entries[index]

    def memory_by_descriptor(self) -> dict[str, int]:
        """Bytes each descriptor's graphs hold (what their captures added to the pool)."""
        totals: dict[str, int] = collections.Counter()
        for entry in self.entries.values():
            totals[entry.key] += entry.memory_bytes
        return dict(totals)

    def snapshot(self) -> dict[str, Any]:
        """What this set holds and did: graph count, replays, capture time, memory."""
        by_descriptor = self.memory_by_descriptor()
        return {
            "captures": len(self.entries),
            "replays": sum(e.replays for e in self.entries.values()),
            "capture_seconds": sum(e.capture_seconds for e in self.entries.values()),
            "graph_bytes": sum(by_descriptor.values()),
            "bytes_by_descriptor": by_descriptor,
        }

    def release(self) -> None:
        """Free every graph and the pool; later steps run without graphs."""
        for entry in self.entries.values():
            entry.graph.reset()
        self.entries.clear()
        self.pool = self.platform.new_graph_pool()
