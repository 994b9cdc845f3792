"""Capture and replay of one callable as a device graph per BatchDescriptor.

A wrapper acts only when the step's runtime mode (set by the dispatcher in the forward context)
is its own: piecewise wrappers around pieces and one full wrapper around the whole forward can
therefore nest without capturing twice. Capture is not compilation: the wrapped callable is
already built; this module only records and replays it.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from kvgraph.config import GraphMode
from kvgraph.counters import graph_counters
from kvgraph.forward_context import BatchDescriptor, current_forward_context
from kvgraph.platforms import DeviceGraph, Platform

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


@dataclass
class GraphEntry:
    graph: DeviceGraph
    capture_seconds: float
    memory_bytes: int
    replays: int = 0


class GraphWrapper:
    """`runnable`, captured once per descriptor in `runtime_mode`, replayed afterwards."""

    def __init__(self, runnable: Callable, platform: Platform, runtime_mode: GraphMode, name: str,
                 check_inputs: bool = False):
        assert runtime_mode in (GraphMode.PIECEWISE, GraphMode.FULL), runtime_mode
        self.runnable = runnable
        self.platform = platform
        self.runtime_mode = runtime_mode
        self.name = name
        self.check_inputs = check_inputs
        self.entries: dict[BatchDescriptor, GraphEntry] = {}

    def __call__(self, *args: Any) -> Any:
        context = current_forward_context()
        if (context is None or context.runtime_mode is not self.runtime_mode
                or context.batch_descriptor is None):
            return self.runnable(*args)
        entry = self.entries.get(context.batch_descriptor)
        if entry is None:
            return self._capture(context.batch_descriptor, args)
        entry.replays += 1
        graph_counters.replays += 1
        return entry.graph.replay(args)

    def _capture(self, descriptor: BatchDescriptor, args: tuple) -> Any:
        start = time.perf_counter()
        graph = self.platform.make_graph(self.check_inputs)
        with gc_paused():
            outputs = graph.capture(self.runnable, args, self.platform.graph_pool())
        self.platform.synchronize()
        entry = GraphEntry(graph, time.perf_counter() - start, graph.memory_bytes)
        self.entries[descriptor] = entry
        graph_counters.captures += 1
        graph_counters.capture_seconds += entry.capture_seconds
        graph_counters.graph_bytes += entry.memory_bytes
        logger.debug("kvgraph: captured %s for %s in %.3f s", self.name, descriptor,
                     entry.capture_seconds)
        return outputs
