"""Building the Summary of one dump session from the events and reports the dump reader read:
its compiles with their pieces and builds, then its timeline, time and warnings."""

from __future__ import annotations

from typing import Any

from kvgraph.inspect.dump_reader import RawSession
from kvgraph.inspect.findings import find_warnings
from kvgraph.inspect.summary import Build, Compile, Piece, Summary
from kvgraph.inspect.time_spent import time_spent
from kvgraph.inspect.timeline import timeline


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
    stages = timeline(raw.events, compiles, raw.reports)
    summary = Summary(str(raw.directory), raw.rank, list(raw.notes), stages, ordered, runner,
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
