"""The warnings of a dump session: those kvgraph logged while it was open, and those read off
its reports (downgraded modes, steps without graphs, failed captures, recompiles, build
fallbacks, verify failures), which kvgraph logs once, at info level, or not at all."""

from __future__ import annotations

from typing import Any, Iterator

import kvgraph.inspect.units as units
from kvgraph.inspect.summary import Finding, Summary


def find_warnings(summary: Summary, events: list[dict[str, Any]]) -> list[Finding]:
    """Every logged warning in order, then each one read off the reports that no logged one
    already says."""
    logged = [Finding(f"logged by {e.get('name')}", str(e["data"].get("message")),
                      e.get("compile"))
              for e in events if e.get("stage") == "warning" and isinstance(e.get("data"), dict)]
    found = []
    for finding, said_as in _derived(summary):
        if said_as is None or not any(said_as in f.message for f in logged):
            found.append(finding)
    return logged + found


def _derived(summary: Summary) -> Iterator[tuple[Finding, str | None]]:
    """Each warning the reports imply, with the words a logged warning saying it would hold."""
    stats = summary.stats if isinstance(summary.stats, dict) else {}
    downgrade = _graph_mode_path(summary, stats)
    if downgrade:
        yield Finding("runner, config.json, stats.json", f"graph mode downgraded: {downgrade}"), \
            None
    yield from _steps_without_graphs(summary, stats)
    for capture in summary.captures:
        for row in capture.get("table") or []:
            if row.get("error"):
                yield Finding("capture.json", f"capturing {row.get('descriptor')} failed: "
                              f"{row['error']}; its batches ran without that graph"), \
                    f"capturing {row.get('descriptor')} failed"
    graphs = max([len(summary.compiles)] + [int(c.counters.get("dynamo_graphs") or 0)
                                            for c in summary.compiles]
                 + [int((stats.get("compile") or {}).get("dynamo_graphs") or 0)])
    if graphs > 1:
        yield Finding("events.jsonl, counters", f"recompiled: Dynamo gave the backend {graphs} "
                      "graphs (the model was traced again after a guard failed, or a graph "
                      "break split it)"), "Dynamo gave this backend graph"
    for compile_ in summary.compiles:
        for build in compile_.builds:
            if build.outcome == "fallback":
                yield Finding("build", f"build {build.piece} {build.size} of compile "
                              f"{compile_.number} fell back to the uncompiled FX code: "
                              f"{build.why}", compile_.number), None
    yield from _verify_failures(summary.verify if summary.verify is not None
                                else stats.get("verify"))


def _graph_mode_path(summary: Summary, stats: dict[str, Any]) -> str | None:
    """Each graph mode a session went through, from the one asked for to the one its steps ran
    in, where there was more than one: "asked 'full', compile 0 built 'full_decode_only'"."""
    runner = summary.runner or {}
    steps = [("asked", runner.get("requested_graph_mode")),
             ("the runner resolved", runner.get("graph_mode")),
             *((f"compile {c.number} built", c.config.get("graph_mode"))
               for c in summary.compiles), ("ran", stats.get("graph_mode"))]
    path, last = [], None
    for label, mode in steps:
        if mode and mode != last:
            path.append(f"{label} {mode!r}")
            last = mode
    return ", ".join(path) if len(path) > 1 else None


def _steps_without_graphs(summary: Summary, stats: dict[str, Any]
                          ) -> Iterator[tuple[Finding, str | None]]:
    sizes = [size for c in summary.compiles for size in c.config.get("capture_sizes") or []]
    largest = f" ({max(sizes)} tokens)" if sizes else ""
    if stats.get("fallbacks"):
        yield Finding("stats.json", f"{units.count(stats['fallbacks'], 'step')} above the "
                      f"largest capture size{largest} ran without graphs"), None
    if stats.get("uncaptured"):
        yield Finding("stats.json", f"{units.count(stats['uncaptured'], 'step')} with no "
                      "captured graph for its descriptor ran without graphs (a capture failed, "
                      "or capture() was not called)"), None


def _verify_failures(verify: Any) -> Iterator[tuple[Finding, str | None]]:
    """Failed verify checks, per descriptor where the report has them."""
    if not isinstance(verify, dict):
        return
    records = verify.get("descriptors")
    failed = False
    for key, record in (records or {}).items() if isinstance(records, dict) else ():
        if not isinstance(record, dict):
            continue
        if record.get("passed") is False or (record.get("failures") or 0) > 0:
            failed = True
            where = f"; where: {record['where']}" if record.get("where") else ""
            yield Finding("verify.json", f"verify: {key} differs from eager in "
                          f"{record.get('failures')} of {record.get('checks')} checks (logits "
                          f"{_number(record.get('max_rel'))} of their scale, cache writes "
                          f"{_number(record.get('cache_max_rel'))}, "
                          f"{record.get('token_flips', 0)} greedy tokens changed){where}"), \
                f"verify: {key} differs from eager"
    if not failed and (verify.get("failures") or 0) > 0:
        yield Finding("verify.json", f"verify: {verify['failures']} checks failed"), None


def _number(value: Any) -> str:
    return f"{value:.2e}" if isinstance(value, (int, float)) else str(value)
