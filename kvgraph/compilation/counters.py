"""Counts of what compilation did: one compiled model's, and the process's totals (tests, logs)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass
class CompileCounters:
    """What kvgraph's backend did: for one compiled model, or in the process (`compile_counters`).

    Counting sites call `add`, which counts in the model's counters and in the process's.
    """

    dynamo_graphs: int = 0  # graphs Dynamo handed to the backend (one per trace)
    pieces: int = 0  # compute pieces seen across all graphs
    unique_pieces: int = 0  # compute pieces after merging identical ones
    builds: int = 0  # builds actually compiled (general + static), cache hits excluded
    cache_hits: int = 0  # builds loaded from the compile cache
    cache_corrupt: int = 0  # artifacts found damaged, discarded and rebuilt
    build_fallbacks: int = 0  # builds inductor failed at, run as traced FX code instead
    compile_seconds: float = 0.0

    def add(self, name: str, amount: int | float = 1) -> None:
        """Count `amount` of `name` here and, for a model's counters, in the process's."""
        setattr(self, name, getattr(self, name) + amount)
        if self is not compile_counters:
            compile_counters.add(name, amount)

    def reset(self) -> None:
        for field in dataclasses.fields(self):
            setattr(self, field.name, field.default)

    def snapshot(self) -> dict:
        return dataclasses.asdict(self)


compile_counters = CompileCounters()  # the process's totals; `reset()` between tests
