"""The timeline of one dump session: a Stage per recorded event, in order, with a few words on
what it did (rewritten reports shown once, at their newest)."""

from __future__ import annotations

from typing import Any

import kvgraph.inspect.units as units
from kvgraph.inspect.summary import Compile, Stage

# Stages with a table of their own and nothing to add to the timeline.
_NOT_IN_TIMELINE = ("piece", "warning")
_NOT_IN_TIMELINE_NAMES = ("dynamo-nodes", "split-pieces")
# Runtime reports rewritten as they change: the timeline shows the newest only.
_REWRITTEN = ("stats", "verify")


def timeline(events: list[dict[str, Any]], compiles: dict[int, Compile],
             reports: dict[str, Any]) -> list[Stage]:
    """A Stage per event worth a row, each capture's descriptors after it (`compiles` by number
    name what a compile's events did; `reports` hold rewritten reports their events do not)."""
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
