"""Reading a debug dump from disk: where its sessions are, their events and runtime reports.

A dump is one session dir (`events.jsonl` at its top) or, from a distributed job, one per rank
(`rank_<r>/events.jsonl`); kvgraph/compilation/debug.py describes what a session holds. A dump
of a process killed while writing ends in a partial record: it is skipped, with a note.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

EVENTS = "events.jsonl"
REPORTS = ("capture", "stats", "verify")  # the runtime reports at a session's top
_RANK_DIR = re.compile(r"rank_(\d+)$")


class DumpError(ValueError):
    """A path that holds no kvgraph debug dump; the message says what was there instead."""


@dataclass
class RawSession:
    """One session as read: its events in order, its runtime reports, what could not be read."""

    directory: Path
    rank: int | None
    events: list[dict[str, Any]]
    reports: dict[str, Any]  # capture, stats, verify: the newest of each, from its file
    notes: list[str] = field(default_factory=list)


def session_dirs(path: str | Path) -> list[tuple[Path, int | None]]:
    """The session dirs of the dump at `path` with their ranks (None: not distributed), ranks
    in order; a DumpError when `path` holds none."""
    root = Path(path)
    if not root.exists():
        raise DumpError(f"{root} does not exist: give the debug_dump_path a run wrote to")
    if not root.is_dir():
        raise DumpError(f"{root} is not a directory: give the debug_dump_path a run wrote to "
                        f"(a directory with {EVENTS} in it)")
    if (root / EVENTS).is_file():
        return [(root, None)]
    ranks = []
    for child in root.iterdir():
        match = _RANK_DIR.match(child.name)
        if match and (child / EVENTS).is_file():
            ranks.append((child, int(match.group(1))))
    if not ranks:
        raise DumpError(f"{root} is not a kvgraph debug dump: it has no {EVENTS} (nor "
                        f"rank_<r>/{EVENTS}); write one with debug_dump_path={root} "
                        "(KVGRAPH_DEBUG_DUMP, --debug-dump-path)")
    return sorted(ranks, key=lambda item: item[1])


def read_session(directory: Path, rank: int | None = None) -> RawSession:
    """The events and runtime reports of the session in `directory`."""
    notes: list[str] = []
    events = _read_events(directory / EVENTS, notes)
    reports = {}
    for name in REPORTS:
        report = _read_report(directory / f"{name}.json", notes)
        if report is None:  # no file (or a damaged one): the newest event holds the same data
            report = next((e["data"] for e in reversed(events) if e.get("stage") == name), None)
        if report is not None:
            reports[name] = report
    return RawSession(directory, rank, events, reports, notes)


def _read_events(path: Path, notes: list[str]) -> list[dict[str, Any]]:
    try:
        text = path.read_text(errors="replace")
    except OSError as error:
        raise DumpError(f"cannot read {path}: {error}") from None
    lines = text.split("\n")
    events = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            if number == len(lines):  # no newline after it: the writer stopped mid-record
                notes.append(f"{EVENTS} ends in a partial record (line {number}: the process "
                             "was probably killed while writing it); it was skipped")
            else:
                notes.append(f"{EVENTS} line {number} is not JSON; it was skipped")
            continue
        if isinstance(record, dict) and "stage" in record:
            events.append(record)
        else:
            notes.append(f"{EVENTS} line {number} is not a kvgraph event; it was skipped")
    return events


def _read_report(path: Path, notes: list[str]) -> Any:
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(errors="replace"))
    except (OSError, ValueError) as error:
        notes.append(f"{path.name} could not be read ({type(error).__name__}); its newest "
                     "event is used instead")
        return None
