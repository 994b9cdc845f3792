"""The summary of one dump session, as data: its stages in order, its compiles (pieces, builds,
cache decisions), its captures, stats and verify results, where the time went, and its warnings.

Every report (text, HTML, JSON) is made from a `Summary`; kvgraph.inspect.summarise builds one
from what kvgraph.inspect.dump_reader read.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Stage:
    """One recorded stage, in the order it ran (a row of the timeline)."""

    seq: int | None
    time: float | None  # seconds since the session opened
    compile: int | None
    stage: str
    name: str
    seconds: float | None
    file: str | None
    detail: str = ""


@dataclass
class Piece:
    """One piece of a compile's split: `kind` compute, attention or whole graph (attention in)."""

    compile: int
    name: str
    kind: str
    nodes: int | None = None
    inputs_from: list[str] = field(default_factory=list)
    outputs_to: list[str] = field(default_factory=list)
    same_as: str | None = None  # an earlier identical piece whose builds this one shares
    op: str | None = None  # an attention piece's op
    file: str | None = None  # its FX code


@dataclass
class Build:
    """One build of one piece at one size; `cache` hit, miss or not used, `why` a miss."""

    compile: int
    piece: str
    size: str
    outcome: str  # built | loaded | fallback | uncompiled
    cache: str
    why: str | None
    seconds: float | None
    file: str | None


@dataclass
class Compile:
    """One Dynamo graph as the backend compiled it."""

    number: int
    config: dict[str, Any] = field(default_factory=dict)
    cache_key: dict[str, Any] = field(default_factory=dict)
    passes: list[dict[str, Any]] = field(default_factory=list)
    split: dict[str, Any] | None = None  # split-pieces.json, with the split's seconds
    pieces: list[Piece] = field(default_factory=list)
    builds: list[Build] = field(default_factory=list)
    counters: dict[str, Any] = field(default_factory=dict)
    seconds: float | None = None  # the backend's, for this graph
    files: dict[str, str] = field(default_factory=dict)  # event name -> file


@dataclass
class TimeShare:
    """Seconds one kind of work took in a session, with a word on what was in it."""

    what: str
    seconds: float
    detail: str = ""


@dataclass
class Finding:
    """One warning: `source` says who logged it or which report it was read from; `compile`
    the compile it came in, if any."""

    source: str
    message: str
    compile: int | None = None


@dataclass
class Summary:
    """What one session of a dump says; `directory` holds the files named in it."""

    directory: str
    rank: int | None
    notes: list[str]
    stages: list[Stage]
    compiles: list[Compile]
    runner: dict[str, Any] | None  # the graph mode asked for and the one resolved, limits
    trace: dict[str, Any] | None  # the runner's first call: Dynamo's seconds and the total
    captures: list[dict[str, Any]]  # one per capture() call, its descriptor rows in "table"
    stats: dict[str, Any] | None
    verify: Any
    files: dict[str, str]  # the session's own files by event name (bytecode)
    time_spent: list[TimeShare] = field(default_factory=list)
    warnings: list[Finding] = field(default_factory=list)
