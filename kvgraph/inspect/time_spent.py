"""Where a session's time went: Dynamo's trace, the passes, the split, the builds, the rest of
the backend, graph capture, ranked by seconds."""

from __future__ import annotations

import kvgraph.inspect.units as units
from kvgraph.inspect.summary import Summary, TimeShare


def time_spent(summary: Summary) -> list[TimeShare]:
    """The session's time by kind of work, most first; kinds the dump has no time for left out."""
    shares = []
    if summary.trace and summary.trace.get("seconds") is not None:
        shares.append(TimeShare("trace (Dynamo)", summary.trace["seconds"],
                                "the first call, kvgraph's backend not counted"))
    builds = [b for c in summary.compiles for b in c.builds if b.seconds is not None]
    build_seconds = sum(b.seconds for b in builds)  # type: ignore[misc]
    if builds:
        slowest = max(builds, key=lambda b: b.seconds)  # type: ignore[arg-type,return-value]
        shares.append(TimeShare("builds", build_seconds,
                                f"{units.count(len(builds), 'build')}; the slowest "
                                f"{slowest.piece} "
                                f"{slowest.size} ({units.seconds(slowest.seconds)}, "
                                f"{slowest.outcome})"))
    passes = sum(p.get("seconds") or 0 for c in summary.compiles for p in c.passes)
    split = sum((c.split or {}).get("seconds") or 0 for c in summary.compiles)
    if any(c.passes for c in summary.compiles):
        shares.append(TimeShare("passes", passes))
    if any(c.split for c in summary.compiles):
        shares.append(TimeShare("split", split))
    backend = sum(c.seconds or 0 for c in summary.compiles)
    rest = backend - build_seconds - passes - split
    if any(c.seconds is not None for c in summary.compiles) and rest > 0:
        shares.append(TimeShare("backend, the rest", rest,
                                "dumping, fingerprints, the cache key, wrapping pieces"))
    if summary.captures:
        rows = [row for capture in summary.captures for row in capture.get("table") or []]
        shares.append(TimeShare("capture", sum(c.get("seconds") or 0 for c in summary.captures),
                                f"{units.count(len(rows), 'descriptor')}, "
                                f"{units.count(len(summary.captures), 'capture() call')}"))
    return sorted(shares, key=lambda share: share.seconds, reverse=True)
