"""Process-wide counts of what compilation and graph capture did, for tests, benchmarks, logs."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass
class CompileCounters:
    """What kvgraph's backend did since the last `reset()`."""

    dynamo_graphs: int = 0  # graphs Dynamo handed to the backend (one per trace)
    pieces: int = 0  # compute pieces seen across all graphs
    unique_pieces: int = 0  # compute pieces after merging identical ones
    builds: int = 0  # builds actually compiled (general + static), cache hits excluded
    cache_hits: int = 0  # builds loaded from the compile cache
    cache_corrupt: int = 0  # artifacts found damaged, discarded and rebuilt
    build_fallbacks: int = 0  # builds inductor failed at, run as traced FX code instead
    compile_seconds: float = 0.0

    def reset(self) -> None:
        for field in dataclasses.fields(self):
            setattr(self, field.name, field.default)

    def snapshot(self) -> dict:
        return dataclasses.asdict(self)


@dataclass
class GraphCounters:
    """What graph wrappers did since the last `reset()`."""

    captures: int = 0
    replays: int = 0
    capture_seconds: float = 0.0
    graph_bytes: int = 0  # output buffers (CPU) or pool growth (CUDA, NPU) of captured graphs

    reset = CompileCounters.reset
    snapshot = CompileCounters.snapshot


compile_counters = CompileCounters()
graph_counters = GraphCounters()
