"""The callable the backend puts around each piece and around the whole forward.

A wrapper replays its graph for the step's BatchDescriptor from the GraphSet the forward
context names (the runner's), and only when the step's runtime mode is its own: piecewise
wrappers around pieces and the full wrapper around the forward nest without capturing twice.
Without a GraphSet in the context it just runs what it wraps.
"""

from __future__ import annotations

from typing import Any, Callable

from kvgraph.config import GraphMode
from kvgraph.forward_context import current_forward_context


class GraphWrapper:
    """`runnable`, replayed from the step's GraphSet when the step runs in `runtime_mode`."""

    def __init__(self, runnable: Callable, runtime_mode: GraphMode, name: str):
        assert runtime_mode in (GraphMode.PIECEWISE, GraphMode.FULL), runtime_mode
        self.runnable = runnable
        self.runtime_mode = runtime_mode
        self.name = name

    def __call__(self, *args: Any) -> Any:
        context = current_forward_context()
        if (context is None or context.graphs is None
                or context.runtime_mode is not self.runtime_mode
                or context.batch_descriptor is None):
            return self.runnable(*args)
        return context.graphs.run(self, context.batch_descriptor, args)
