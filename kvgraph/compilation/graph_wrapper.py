"""The callable the backend puts around each piece and around the whole forward.

A wrapper hands its call to the GraphSet the forward context names (the runner's) when the
step's runtime mode is its own, and that set replays (or, while capturing, records) the graph
of the step's descriptor: the dispatcher decided, once, that the step runs on those graphs, and
a wrapper never decides again. Piecewise wrappers around pieces and the full wrapper around the
forward nest without capturing twice. Without a GraphSet in the context it just runs.
"""

from __future__ import annotations

from typing import Any, Callable

from kvgraph.config import GraphMode
from kvgraph.forward_context import current_forward_context


class GraphWrapper:
    """`runnable`, replayed from the step's GraphSet when the step runs in `runtime_mode`.

    `last`: its outputs are the forward's own, which nothing later in the step reads, so a
    device graph releases their memory to the pool as soon as they are captured.
    """

    def __init__(self, runnable: Callable, runtime_mode: GraphMode, name: str,
                 last: bool = False):
        assert runtime_mode.is_runtime_mode and runtime_mode.has_graphs, runtime_mode
        self.runnable = runnable
        self.runtime_mode = runtime_mode
        self.name = name
        self.last = last

    def __call__(self, *args: Any) -> Any:
        context = current_forward_context()
        if (context is None or context.graphs is None
                or context.runtime_mode is not self.runtime_mode):
            return self.runnable(*args)
        return context.graphs.run(self, args)
