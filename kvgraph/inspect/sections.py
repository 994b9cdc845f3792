"""What a report of a Summary shows, as tables: the timeline, one table per stage, where the
time went and the warnings. The text and the HTML report render the same tables.
"""

from __future__ import annotations

from typing import Any

import kvgraph.inspect.units as units
from kvgraph.inspect.summary import Compile, Summary
from kvgraph.inspect.table import Code, Table, cell, generic_tables

NAMES_SHOWN = 4  # node names a pass table lists of those removed, added or changed
# The files of what Dynamo traced: event name, what it is, its label in HTML.
_DYNAMO_FILES = (("dynamo", "traced graph", "graph"), ("dynamo-nodes", "node table", "nodes"))


def session_title(summary: Summary) -> str:
    """What a report calls one session: its directory, and its rank in a distributed job."""
    rank = "" if summary.rank is None else f", rank {summary.rank}"
    return f"kvgraph debug dump: {summary.directory}{rank}"


def tables(summary: Summary) -> list[Table]:
    """Every table of `summary`, in the order a reader wants them; stages the session did not
    reach are left out (the warnings table always stays)."""
    made = [_timeline(summary), _runner(summary), *_compile_tables(summary),
            _trace(summary), _captures(summary), _stats(summary),
            *generic_tables("verify", "verify: graph against eager", summary.verify),
            _time(summary), _warnings(summary)]
    return [table for table in made if table is not None]


def _timeline(summary: Summary) -> Table:
    table = Table("timeline", "Stages, in the order they ran",
                  ["at", "compile", "stage", "name", "seconds", "what", "file"])
    for stage in summary.stages:
        table.rows.append([units.seconds(stage.time), cell(stage.compile), stage.stage,
                           stage.name, units.seconds(stage.seconds), stage.detail,
                           stage.file or ""])
    return table


def _runner(summary: Summary) -> Table | None:
    runner = summary.runner
    if not runner:
        return None
    limits = runner.get("limits")
    limits = ", ".join(f"{k} {v}" for k, v in limits.items()) if isinstance(limits, dict) else ""
    return Table("runner", "Runner", ["graph_mode asked", "graph_mode resolved", "attn_backend",
                 "device", "limits"], [[cell(runner.get("requested_graph_mode")),
                                        cell(runner.get("graph_mode")),
                                        cell(runner.get("attn_backend")),
                                        cell(runner.get("device")), limits]])


def _compile_tables(summary: Summary) -> list[Table | None]:
    """The tables of the compile stages, a row per compile (per pass, piece, build)."""
    compiles = summary.compiles
    made = [_config(compiles), _dynamo(summary), _cache(compiles), _passes(compiles),
            _split(compiles), _pieces(compiles), _builds(compiles), _counters(compiles)]
    return [table if table.rows else None for table in made]


def _config(compiles: list[Compile]) -> Table:
    table = Table("config", "Config of each compile", ["compile", "graph_mode", "piece_compiler",
                  "compile_sizes", "capture_sizes", "passes", "config"])
    for c in compiles:
        if c.config:
            table.rows.append([str(c.number)] + [cell(c.config.get(name)) for name in
                              table.columns[1:-1]] + [Code("config", c.files.get("config"))])
    return table


def _dynamo(summary: Summary) -> Table:
    table = Table("dynamo", "What Dynamo traced", ["compile", "what", "nodes", "code"])
    for c in summary.compiles:
        nodes = c.passes[0].get("nodes_before") if c.passes else None
        table.rows += [[str(c.number), what, cell(nodes) if name == "dynamo" else "",
                        Code(label, c.files[name])] for name, what, label in _DYNAMO_FILES
                       if name in c.files]
    table.rows += [["", "transformed bytecode", "", Code("bytecode", file)]
                   for name, file in summary.files.items() if name == "bytecode"]
    return table


def _cache(compiles: list[Compile]) -> Table:
    table = Table("cache", "Compile cache: the key of each compile, its hits and misses",
                  ["compile", "used", "key", "key change, or why not used", "hits", "misses",
                   "directory"])
    table.rows = [_cache_row(c) for c in compiles if c.cache_key]
    return table


def _passes(compiles: list[Compile]) -> Table:
    table = Table("pass", "Passes: what each did to the graph", ["compile", "pass", "seconds",
                  "nodes", "removed", "added", "changed", "graph after"])
    for c in compiles:
        for entry in c.passes:
            name = entry.get("pass")
            table.rows.append([str(c.number), cell(name), units.seconds(entry.get("seconds")),
                               f"{entry.get('nodes_before')} -> {entry.get('nodes_after')}",
                               _names(entry.get("removed")), _names(entry.get("added")),
                               _names(entry.get("changed")),
                               Code(f"after {name}", c.files.get(f"pass-{name}"))])
    return table


def _split(compiles: list[Compile]) -> Table:
    table = Table("split", "Split at attention", ["compile", "pieces", "compute", "attention",
                  "unique compute", "seconds", "split graph"])
    for c in compiles:
        if c.split:
            s = c.split
            table.rows.append([str(c.number), cell(len(s.get("pieces") or [])),
                               cell(s.get("compute_pieces")), cell(s.get("attention_pieces")),
                               cell(s.get("unique_compute_pieces")),
                               units.seconds(s.get("seconds")),
                               Code("split", c.files.get("split"))])
    return table


def _pieces(compiles: list[Compile]) -> Table:
    table = Table("piece", "Pieces (identical ones built once)", ["compile", "piece", "kind",
                  "nodes", "inputs from", "outputs to", "builds", "code"])
    table.rows = [[str(c.number), p.name, p.kind, cell(p.nodes), cell(p.inputs_from),
                   cell(p.outputs_to), _piece_builds(c, p), Code(p.name, p.file)]
                  for c in compiles for p in c.pieces]
    return table


def _builds(compiles: list[Compile]) -> Table:
    table = Table("build", "Builds: each piece at each size, and the compile cache",
                  ["compile", "piece", "size", "outcome", "cache", "seconds", "why", "code"])
    table.rows = [[str(c.number), b.piece, b.size, b.outcome, b.cache, units.seconds(b.seconds),
                   cell(b.why), Code(f"{b.piece} {b.size}", b.file)]
                  for c in compiles for b in c.builds]
    table.notes = _build_notes(compiles)
    return table


def _counters(compiles: list[Compile]) -> Table:
    names = list(dict.fromkeys(name for c in compiles for name in c.counters))
    table = Table("counters", "Compile counters", ["compile", *names])
    table.rows = [[str(c.number)] + [_counter(name, c.counters.get(name)) for name in names]
                  for c in compiles if c.counters]
    return table


def _cache_row(c: Compile) -> list[Any]:
    key = c.cache_key
    hits = sum(b.cache == "hit" for b in c.builds)
    misses = sum(b.cache == "miss" for b in c.builds)
    if not key.get("used"):
        return [str(c.number), "no", "", cell(key.get("why")), str(hits), str(misses), ""]
    change = key.get("key_change") or "none: this key was used here before"
    return [str(c.number), "yes", cell(key.get("key")), cell(change), str(hits), str(misses),
            cell(key.get("directory"))]


def _names(names: Any) -> str:
    names = list(names or [])
    shown = ", ".join(str(n) for n in names[:NAMES_SHOWN])
    more = f", +{len(names) - NAMES_SHOWN}" if len(names) > NAMES_SHOWN else ""
    return f"{len(names)}" + (f": {shown}{more}" if names else "")


def _piece_builds(c: Compile, piece: Any) -> str:
    if piece.kind == "attention":
        return f"none: {piece.op or 'attention'} runs as it is"
    if piece.same_as:
        return f"those of {piece.same_as} (identical: built once)"
    sizes = [b.size for b in c.builds if b.piece == piece.name]
    return ", ".join(sizes) or "none recorded"


def _counter(name: str, value: Any) -> str:
    return units.seconds(value) if name.endswith("seconds") else cell(value)


def _build_notes(compiles: list[Compile]) -> list[str]:
    builds = [b for c in compiles for b in c.builds]
    if not builds:
        return []
    outcomes = {o: sum(b.outcome == o for b in builds) for o in dict.fromkeys(
        b.outcome for b in builds)}
    notes = [f"{units.count(len(builds), 'build')}: "
             + ", ".join(f"{n} {o}" for o, n in outcomes.items())
             + f"; cache hits {sum(b.cache == 'hit' for b in builds)}, misses "
             f"{sum(b.cache == 'miss' for b in builds)}"]
    computed = [p for c in compiles for p in c.pieces if p.kind == "compute"]
    shared = sum(1 for p in computed if p.same_as)
    if computed:
        notes.append(f"{units.count(len(computed), 'compute piece')}, "
                     f"{len(computed) - shared} built ({shared} identical to an earlier one "
                     "share its builds)")
    return notes


def _trace(summary: Summary) -> Table | None:
    trace = summary.trace
    if not trace:
        return None
    return Table("trace", "Trace (the runner's first call)", ["Dynamo", "kvgraph's backend",
                 "in all"], [[units.seconds(trace.get("seconds")),
                              units.seconds(trace.get("backend_seconds")),
                              units.seconds(trace.get("total_seconds"))]])


def _captures(summary: Summary) -> Table | None:
    if not summary.captures:
        return None
    stats = summary.stats if isinstance(summary.stats, dict) else {}
    hits = stats.get("hits") or {}
    table = Table("capture", "Captured graphs: one row per descriptor", [
        "descriptor", "mode", "graphs", "seconds", "recording", "memory", "steps run", "error"])
    for number, capture in enumerate(summary.captures, start=1):
        rows = capture.get("table") or []
        for row in rows:
            key = row.get("descriptor")
            table.rows.append([cell(key), cell(row.get("mode")), cell(row.get("graphs")),
                               units.seconds(row.get("seconds")),
                               units.seconds(row.get("capture_seconds")),
                               units.size(row.get("bytes")), cell(hits.get(key, 0)),
                               cell(row.get("error"))])
        table.notes.append(
            f"capture() {number}: {capture.get('descriptors')} descriptors, "
            f"{capture.get('graphs')} graphs in {units.seconds(capture.get('seconds'))}; the "
            f"runner's graphs hold {units.size(capture.get('bytes'))}; failed: "
            f"{cell(capture.get('failed')) or 'none'}")
    return table


def _stats(summary: Summary) -> Table | None:
    stats = summary.stats
    if not isinstance(stats, dict):
        return None
    table = Table("stats", "Steps run, by how they ran (runner.stats())", ["ran as", "steps"],
                  [[cell(key), cell(n)] for key, n in (stats.get("hits") or {}).items()])
    graphs = stats.get("graphs") or {}
    table.notes = [f"graph_mode {stats.get('graph_mode')}; padded tokens "
                   f"{stats.get('padded_tokens')}; above the capture sizes "
                   f"{stats.get('fallbacks')}; without a captured graph "
                   f"{stats.get('uncaptured')}",
                   f"graphs: {graphs.get('captures')} captured, {graphs.get('replays')} "
                   f"replays, {units.size(graphs.get('graph_bytes'))}"]
    return table


def _time(summary: Summary) -> Table | None:
    if not summary.time_spent:
        return None
    total = sum(share.seconds for share in summary.time_spent) or 1.0
    return Table("time", "Where the time went", ["what", "seconds", "share", "in it"], [
        [share.what, units.seconds(share.seconds), f"{100 * share.seconds / total:.0f}%",
         share.detail] for share in summary.time_spent])


def _warnings(summary: Summary) -> Table:
    return Table("warning", f"Warnings ({len(summary.warnings)})", ["compile", "from", "warning"],
                 [[cell(w.compile), w.source, w.message] for w in summary.warnings])
