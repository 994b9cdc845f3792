"""An ordered list of named FX -> FX passes, with an identity that enters compile-cache keys."""

from __future__ import annotations

import hashlib
import inspect
from dataclasses import dataclass
from typing import Callable, Sequence

from torch import fx

from passes.collectives import check_waits_kept, wait_signature

PassFn = Callable[[fx.GraphModule], None]
PassObserver = Callable[[str, fx.GraphModule], None]


@dataclass(frozen=True)
class GraphPass:
    """One named pass: `fn` rewrites the graph module in place."""

    name: str
    fn: PassFn

    def uuid(self) -> str:
        """Changes whenever the pass's source does, so cached builds made by an old pass miss."""
        source = inspect.getsource(inspect.getmodule(self.fn))
        return hashlib.sha256(f"{self.name}\n{source}".encode()).hexdigest()


class PassManager:
    """Runs passes in order; `observer(name, gm)` sees the graph after each (for debug dumps).

    A pass that drops, adds or re-points a collective's `wait_tensor` is an error
    (CollectiveWaitError), raised right after it.
    """

    def __init__(self, passes: Sequence[GraphPass]):
        self.passes = tuple(passes)

    def __call__(self, gm: fx.GraphModule, observer: PassObserver | None = None) -> fx.GraphModule:
        for graph_pass in self.passes:
            waits = wait_signature(gm)
            graph_pass.fn(gm)
            check_waits_kept(waits, gm, graph_pass.name)
            gm.graph.lint()
            gm.recompile()
            if observer is not None:
                observer(graph_pass.name, gm)
        return gm

    def uuid(self) -> str:
        digest = hashlib.sha256()
        for graph_pass in self.passes:
            digest.update(graph_pass.uuid().encode())
        return digest.hexdigest()
