"""What a report says first about one dump session, for a reader with ten seconds: what ran and
when, the graph mode, how many graphs, pieces and descriptors, the compile cache's hits and
misses, the warnings (the most important named), verify's result and where the time went.

Each fact has a status a page colours (OK, WARN, BAD; NEUTRAL where there is nothing to judge)
and names the stage of the table that holds its details. Every value is short text: what the
dump held is cut to MAX_VALUE_CHARS wherever it is quoted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import kvgraph.inspect.dump_files as dump_files
import kvgraph.inspect.units as units
from kvgraph.inspect.dump_reader import EVENTS
from kvgraph.inspect.fields import NUMBER
from kvgraph.inspect.summary import Finding, Summary, TimeShare

OK, WARN, BAD, NEUTRAL = "ok", "warn", "bad", "neutral"
TOP_WARNINGS = 3  # warnings the overview names; the table below has them all
MAX_VALUE_CHARS = 160  # of a value the dump wrote, as the overview quotes it
# Words that make a warning matter more, most first: wrong results, then graphs or builds
# lost, then a mode other than the one asked for, then steps that ran slower.
_IMPORTANCE = ("verify", "failed", "fell back", "downgraded", "without graphs", "recompiled")


@dataclass
class Fact:
    """One card of the overview: `value` the short answer, `detail` a few words more, `stage`
    the table with the rest (None: no table)."""

    label: str
    value: str
    detail: str
    status: str
    stage: str | None


@dataclass
class Overview:
    """The overview of one session: `about` says what ran, where and when (label, value);
    `top_warnings` pairs each named warning with its row in the warnings table."""

    about: list[tuple[str, str]]
    facts: list[Fact]
    top_warnings: list[tuple[int, Finding]] = field(default_factory=list)
    time_spent: list[TimeShare] = field(default_factory=list)
    notes: int = 0  # what the dump could not give: the session's notes


def overview(summary: Summary) -> Overview:
    """The overview of `summary`."""
    facts = [_graph_mode(summary), _compiled(summary), _captured(summary), _cache(summary),
             _warnings(summary), _verify(summary), _time(summary)]
    ranked = sorted(enumerate(summary.warnings), key=lambda item: _importance(item[1]))
    return Overview(_about(summary), facts, ranked[:TOP_WARNINGS],
                    [s for s in summary.time_spent if s.seconds > 0], len(summary.notes))


def quoted(value: Any) -> str:
    """`value` as the overview quotes it: one line, at most MAX_VALUE_CHARS."""
    text = " ".join(str(value).split())
    return text if len(text) <= MAX_VALUE_CHARS else text[:MAX_VALUE_CHARS - 3] + "..."


def headlines(facts: list[Fact]) -> list[tuple[str, str]]:
    """What to read first, as (status, line): a line naming the facts that are problems, one
    naming those worth a look, or one saying there are neither."""
    lines = []
    for status, says in ((BAD, "Problems"), (WARN, "Worth a look")):
        named = [f"{fact.label}: {fact.value}" for fact in facts if fact.status == status]
        if named:
            lines.append((status, f"{says} \N{EM DASH} " + " \N{MIDDLE DOT} ".join(named)))
    return lines or [(OK, "No problems found")]


def _about(summary: Summary) -> list[tuple[str, str]]:
    runner = summary.runner
    what = "a ModelRunner" if runner else 'torch.compile(backend="kvgraph"), no ModelRunner'
    if runner and runner.get("attn_backend"):
        what += f", attn_backend {quoted(runner['attn_backend'])}"
    if runner and runner.get("device"):
        what += f", on {quoted(runner['device'])}"
    about = [("ran", what)]
    when = _written_at(summary.directory)
    if when:
        about.append(("dump written", when))
    times = [s.time for s in summary.stages if s.time is not None]
    if times:
        about.append(("session open", units.seconds(max(times))))
    return about


def _written_at(directory: str) -> str | None:
    """When the session's events.jsonl was last written, in UTC; None when that is not known."""
    try:
        seconds = dump_files.inside(Path(directory), EVENTS).stat().st_mtime
        return datetime.fromtimestamp(seconds, timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    except (dump_files.Refused, OSError, OverflowError, ValueError):
        return None


def _graph_mode(summary: Summary) -> Fact:
    runner = summary.runner or {}
    stats = summary.stats if isinstance(summary.stats, dict) else {}
    steps = [("asked", runner.get("requested_graph_mode")), ("resolved", runner.get("graph_mode")),
             *((f"compile {c.number} built", c.config.get("graph_mode"))
               for c in summary.compiles), ("ran", stats.get("graph_mode"))]
    path: list[tuple[str, str]] = []
    for label, mode in steps:
        if mode and (not path or quoted(mode) != path[-1][1]):
            path.append((label, quoted(mode)))
    if not path:
        return Fact("Graph mode", "not recorded", "", NEUTRAL, "runner")
    detail = "as asked" if [label for label, _ in path] == ["asked"] else \
        ", then ".join(f"{label} {mode}" for label, mode in path)
    return Fact("Graph mode", path[-1][1], detail, WARN if len(path) > 1 else OK,
                "runner" if summary.runner else "config")


def _compiled(summary: Summary) -> Fact:
    pieces = [p for c in summary.compiles for p in c.pieces]
    kinds = {kind: sum(p.kind == kind for p in pieces) for kind in dict.fromkeys(
        p.kind for p in pieces)}
    shared = sum(1 for p in pieces if p.same_as)
    detail = ", ".join(f"{n} {quoted(kind)}" for kind, n in kinds.items()) + (
        f" ({shared} identical to an earlier one)" if shared else "")
    graphs = len(summary.compiles)
    status = NEUTRAL if not graphs else WARN if graphs > 1 else OK
    return Fact("Compiled", f"{units.count(graphs, 'graph')}, "
                f"{units.count(len(pieces), 'piece')}",
                detail or "no pieces recorded", status, "piece" if pieces else "timeline")


def _captured(summary: Summary) -> Fact:
    rows = [row for capture in summary.captures for row in capture.get("table") or []]
    if not summary.captures:
        return Fact("Captured", "nothing", "capture() was not called", NEUTRAL, None)
    failed = sum(1 for row in rows if row.get("error"))
    graphs = sum(row.get("graphs") for row in rows if NUMBER.accepts(row.get("graphs")))
    held = summary.captures[-1].get("bytes")  # the runner's graphs, after its last capture()
    detail = f"{units.count(graphs, 'graph')}, {units.size(held)}; " + (
        f"{failed} failed" if failed else "none failed")
    return Fact("Captured", units.count(len(rows), "descriptor"), detail,
                BAD if failed == len(rows) and rows else WARN if failed else OK, "capture")


def _cache(summary: Summary) -> Fact:
    hits, misses = _cache_counts(summary)
    keys = [c.cache_key for c in summary.compiles if c.cache_key]
    if keys and not any(key.get("used") for key in keys):
        return Fact("Compile cache", "not used", quoted(keys[0].get("why") or ""), NEUTRAL,
                    "cache")
    if not hits + misses:
        return Fact("Compile cache", "no builds", "", NEUTRAL, "cache" if keys else None)
    # A miss is no fault (a cold cache misses every build), only time spent building.
    detail = "every build loaded from the cache" if not misses else \
        "each miss built its piece; the builds table says why"
    return Fact("Compile cache", f"{hits} {'hit' if hits == 1 else 'hits'}, "
                f"{misses} {'miss' if misses == 1 else 'misses'}", detail,
                NEUTRAL if misses else OK, "build")


def _cache_counts(summary: Summary) -> tuple[int, int]:
    """The session's compile-cache hits and misses, over every build."""
    builds = [b for c in summary.compiles for b in c.builds]
    return sum(b.cache == "hit" for b in builds), sum(b.cache == "miss" for b in builds)


def _warnings(summary: Summary) -> Fact:
    count = len(summary.warnings)
    return Fact("Warnings", str(count), "the most important named below" if count else "none",
                WARN if count else OK, "warning")


def _verify(summary: Summary) -> Fact:
    """Verify's result: failed, passed, or not run (no report)."""
    stats = summary.stats if isinstance(summary.stats, dict) else {}
    verify = summary.verify if summary.verify is not None else stats.get("verify")
    if not isinstance(verify, dict) or verify.get("enabled") is False:
        return Fact("Verify", "not run", "verify was off: verify=True checks graph steps "
                    "against eager", NEUTRAL, "verify" if isinstance(verify, dict) else None)
    checks = verify.get("checks") if NUMBER.accepts(verify.get("checks")) else None
    records = verify.get("descriptors") if isinstance(verify.get("descriptors"), dict) else {}
    failing = [key for key, record in records.items() if isinstance(record, dict) and (
        record.get("passed") is False or (record.get("failures") or 0) > 0)]
    failures = verify.get("failures") or 0
    if failing or failures > 0:
        where = [record.get("where") for record in records.values()
                 if isinstance(record, dict) and record.get("where")]
        of = f" of {checks} checks" if checks is not None else " checks"
        return Fact("Verify", "failed", f"{failures}{of} differ from eager" + (
            f"; where: {quoted(where[0])}" if where else ""), BAD, "verify")
    if checks:
        return Fact("Verify", "passed", f"{units.count(checks, 'check')} against eager", OK,
                    "verify")
    return Fact("Verify", "no checks", "verify was on; no step was checked", NEUTRAL, "verify")


def _time(summary: Summary) -> Fact:
    shares = [share for share in summary.time_spent if share.seconds > 0]
    total = sum(share.seconds for share in shares)
    if not shares or not math.isfinite(total):
        return Fact("Compile and capture time", "not recorded", "", NEUTRAL, None)
    top = shares[0]
    return Fact("Compile and capture time", units.seconds(total), f"most in {top.what}: "
                f"{units.seconds(top.seconds)} ({100 * top.seconds / total:.0f}%)", NEUTRAL,
                "time")


def _importance(finding: Finding) -> int:
    return next((rank for rank, word in enumerate(_IMPORTANCE) if word in finding.message),
                len(_IMPORTANCE))
