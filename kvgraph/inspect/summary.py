"""The summary of one dump session: its stages in order, its compiles (pieces, builds, cache
decisions), its captures, stats and verify results, where the time went, and its warnings.

Every report (text, HTML, JSON) is made from a `Summary`; `summarise` builds one from what
kvgraph.inspect.dump_reader read.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import kvgraph.inspect.units as units
from kvgraph.inspect.dump_reader import RawSession
from kvgraph.inspect.findings import Finding, find_warnings
from kvgraph.inspect.time_spent import TimeShare, time_spent

# Stages with a table of their own and nothing to add to the timeline.
_NOT_IN_TIMELINE = ("piece", "warning")
_NOT_IN_TIMELINE_NAMES = ("dynamo-nodes", "split-pieces")
# Runtime reports rewritten as they change: the timeline shows the newest only.
_REWRITTEN = ("stats", "verify")


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


def summarise(raw: RawSession) -> Summary:
    """The Summary of one session as read."""
    compiles: dict[int, Compile] = {}
    files: dict[str, str] = {}
    runner = trace = None
    captures = []
    for event in raw.events:
        number, data = event.get("compile"), event.get("data")
        stage, name, file = event.get("stage"), str(event.get("name")), event.get("file")
        if stage == "runner" and isinstance(data, dict):
            runner = data
        elif stage == "trace" and isinstance(data, dict):
            trace = {**data, "seconds": event.get("seconds")}
        elif stage == "capture" and isinstance(data, dict):
            captures.append(data)
        elif isinstance(number, int):
            _add_to_compile(compiles.setdefault(number, Compile(number)), event)
        elif file:
            files[name] = file
    if not captures and isinstance(raw.reports.get("capture"), dict):
        captures.append(raw.reports["capture"])
    ordered = [compiles[n] for n in sorted(compiles)]
    for compile_ in ordered:
        _add_whole_graph_piece(compile_)
    timeline = _timeline(raw.events, compiles, raw.reports)
    summary = Summary(str(raw.directory), raw.rank, list(raw.notes), timeline, ordered, runner,
                      trace, captures, raw.reports.get("stats"), raw.reports.get("verify"), files)
    summary.time_spent = time_spent(summary)
    summary.warnings = find_warnings(summary, raw.events)
    return summary


def _add_to_compile(compile_: Compile, event: dict[str, Any]) -> None:
    stage, name, data = event.get("stage"), str(event.get("name")), event.get("data")
    file, seconds = event.get("file"), event.get("seconds")
    if file:
        compile_.files[name] = file
    if stage == "config" and isinstance(data, dict):
        compile_.config = data
    elif stage == "cache" and isinstance(data, dict):
        compile_.cache_key = data
    elif stage == "passes" and isinstance(data, list):
        compile_.passes = data
    elif stage == "split" and name == "split":
        compile_.split = {**(compile_.split or {}), "seconds": seconds}
    elif stage == "split" and isinstance(data, dict):
        compile_.split = {**data, **(compile_.split or {})}
        compile_.pieces = [_piece(compile_.number, entry) for entry in data.get("pieces") or []]
    elif stage == "piece":
        piece = next((p for p in compile_.pieces if f"piece-{p.name}" == name), None)
        if piece is not None:
            piece.file = file
    elif stage == "build" and isinstance(data, dict):
        compile_.builds.append(_build(compile_, data, seconds, file))
    elif stage == "counters" and isinstance(data, dict):
        compile_.counters, compile_.seconds = data, seconds


def _piece(number: int, entry: dict[str, Any]) -> Piece:
    return Piece(number, str(entry.get("name")), str(entry.get("kind") or "compute"),
                 entry.get("nodes"), list(entry.get("inputs_from") or []),
                 list(entry.get("outputs_to") or []), entry.get("same_as"), entry.get("op"))


def _build(compile_: Compile, data: dict[str, Any], seconds: float | None,
           file: str | None) -> Build:
    outcome = str(data.get("outcome"))
    if outcome == "loaded":
        cache = "hit"
    elif outcome in ("built", "fallback") and compile_.cache_key.get("used"):
        cache = "miss"
    else:
        cache = "not used"
    return Build(compile_.number, str(data.get("piece")), str(data.get("size")), outcome, cache,
                 data.get("why"), seconds, file)


def _add_whole_graph_piece(compile_: Compile) -> None:
    """A compile without a split (full-graph modes) built one piece: the whole graph."""
    if compile_.split is None and compile_.builds:
        graphs = [file for name, file in compile_.files.items() if name.startswith("pass-")]
        code = (graphs or [compile_.files.get("dynamo")])[-1]  # the graph after the passes
        compile_.pieces = [Piece(compile_.number, name, "whole graph", file=code)
                           for name in dict.fromkeys(b.piece for b in compile_.builds)]


def _timeline(events: list[dict[str, Any]], compiles: dict[int, Compile],
              reports: dict[str, Any]) -> list[Stage]:
    last_of = {e.get("stage"): i for i, e in enumerate(events) if e.get("stage") in _REWRITTEN}
    writes = {stage: sum(e.get("stage") == stage for e in events) for stage in last_of}
    stages = []
    for index, event in enumerate(events):
        stage, name = event.get("stage"), str(event.get("name"))
        if stage in _NOT_IN_TIMELINE or name in _NOT_IN_TIMELINE_NAMES:
            continue
        if stage in _REWRITTEN and last_of[stage] != index:
            continue
        compile_ = compiles.get(event.get("compile"))  # type: ignore[arg-type]
        data = event.get("data")
        if data is None and stage in _REWRITTEN:  # its report file holds it, not the event
            data = reports.get(stage)
        detail = _detail(stage, name, data, compile_)
        if stage in _REWRITTEN and writes[stage] > 1:
            detail += f" (the newest of {writes[stage]} writes)"
        stages.append(Stage(event.get("seq"), event.get("time"), event.get("compile"),
                            str(stage), name, event.get("seconds"), event.get("file"), detail))
        if stage == "capture" and isinstance(event.get("data"), dict):
            stages += [Stage(event.get("seq"), None, None, "capture", "descriptor",
                             row.get("seconds"), None, _capture_detail(row))
                       for row in event["data"].get("table") or []]
    return stages


def _capture_detail(row: dict[str, Any]) -> str:
    if row.get("error"):
        return f"{row.get('descriptor')}: failed: {row['error']}"
    return (f"{row.get('descriptor')}: {units.count(row.get('graphs'), 'graph')}, "
            f"{units.size(row.get('bytes'))}")


def _pass_detail(name: str, compile_: Compile | None) -> str:
    entry = next((p for p in compile_.passes if f"pass-{p.get('pass')}" == name), None) \
        if compile_ is not None else None
    if not entry:
        return ""
    return (f"{entry.get('nodes_before')} -> {entry.get('nodes_after')} nodes: "
            f"{len(entry.get('removed') or [])} removed, {len(entry.get('added') or [])} "
            f"added, {len(entry.get('changed') or [])} changed")


def _split_detail(compile_: Compile | None) -> str:
    if compile_ is None or not compile_.split:
        return ""
    split = compile_.split
    return (f"{len(split.get('pieces') or [])} pieces: {split.get('compute_pieces')} compute "
            f"({split.get('unique_compute_pieces')} unique), "
            f"{split.get('attention_pieces')} attention")


def _cache_detail(data: dict) -> str:
    if not data.get("used"):
        return f"not used: {data.get('why')}"
    return f"key {str(data.get('key'))[:12]}: {data.get('key_change') or 'known here'}"


def _build_detail(data: dict) -> str:
    hit = {"loaded": ", cache hit", "built": ", cache miss"}.get(str(data.get("outcome")), "")
    return f"{data.get('piece')} {data.get('size')}: {data.get('outcome')}{hit}"


# A few words on a stage whose event carries a dict, by stage.
_DICT_DETAILS: dict[str, Any] = {
    "config": lambda d: (f"graph_mode {d.get('graph_mode')}, piece_compiler "
                         f"{d.get('piece_compiler')}, compile_sizes {d.get('compile_sizes')}"),
    "runner": lambda d: (f"graph_mode {d.get('requested_graph_mode')} asked, "
                         f"{d.get('graph_mode')} resolved; attn_backend {d.get('attn_backend')} "
                         f"on {d.get('device')}"),
    "cache": _cache_detail,
    "build": _build_detail,
    "counters": lambda d: (f"the whole compile: {d.get('builds')} builds, "
                           f"{d.get('cache_hits')} cache hits, {d.get('build_fallbacks')} "
                           "fallbacks"),
    "trace": lambda d: (f"Dynamo's part of {units.seconds(d.get('total_seconds'))} "
                        f"(kvgraph's backend: {units.seconds(d.get('backend_seconds'))})"),
    "capture": lambda d: (f"{units.count(d.get('descriptors'), 'descriptor')}, "
                          f"{units.count(d.get('graphs'), 'graph')}, "
                          f"{units.size(d.get('bytes'))}, {len(d.get('failed') or [])} failed"),
    "stats": lambda d: (f"graph_mode {d.get('graph_mode')}, "
                        f"{sum((d.get('hits') or {}).values())} steps"),
    "verify": lambda d: (f"{d.get('checks')} checks, {d.get('failures')} failures"
                         if "checks" in d else ""),
}
_FIXED_DETAILS = {"bytecode": "the bytecode Dynamo made", "dynamo": "the graph Dynamo traced"}


def _detail(stage: Any, name: str, data: Any, compile_: Compile | None) -> str:
    """A few words on what a stage did, for the timeline."""
    if stage == "pass":
        return _pass_detail(name, compile_)
    if stage == "split":
        return _split_detail(compile_)
    if stage == "passes" and isinstance(data, list):
        return units.count(len(data), "pass", "passes") + " in all"
    if stage in _DICT_DETAILS and isinstance(data, dict):
        return _DICT_DETAILS[stage](data)
    return _FIXED_DETAILS.get(stage, "")
