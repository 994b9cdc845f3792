"""Reading a debug dump from disk: where its sessions are, their events and runtime reports.

A dump is one session dir (`events.jsonl` at its top) or, from a distributed job, one per rank
(`rank_<r>/events.jsonl`); kvgraph/compilation/debug.py describes what a session holds. A dump
of a process killed while writing ends in a partial record: it is skipped, with a note.

Nothing in a dump is trusted. Files are read through kvgraph.inspect.dump_files (the dump's
own only, each up to a cap), values are kept as far as kvgraph.inspect.fields says they are of
the right kind, and whatever is refused or left out is a note of the session, not an error.
"""

from __future__ import annotations

import itertools
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Iterator

import kvgraph.inspect.dump_files as dump_files
import kvgraph.inspect.fields as fields
from kvgraph.inspect.units import size

EVENTS = "events.jsonl"
REPORTS = ("capture", "stats", "verify")  # the runtime reports at a session's top
MAX_EVENTS = 100_000  # events read of a session: a real one records hundreds to thousands
MAX_NOTES = 200  # notes kept of a session: past them, a damaged dump's notes are only counted
_NAME_SHOWN = 200  # characters of a refused file's name that its note quotes
_RANK_DIR = re.compile(r"rank_(\d+)$")


class DumpError(ValueError):
    """A path that holds no kvgraph debug dump; the message says what was there instead."""


class _TooDeep(ValueError):
    """JSON nested deeper than fields.MAX_DEPTH; the message follows the JSON's name."""


@dataclass
class RawSession:
    """One session as read: its events in order, its runtime reports, what could not be read."""

    directory: Path
    rank: int | None
    events: list[dict[str, Any]]
    reports: dict[str, Any]  # capture, stats, verify: the newest of each, from its file
    notes: list[str] = field(default_factory=list)


class _Notes:
    """What a session's dump could not give, in words: the first MAX_NOTES, then a count."""

    def __init__(self) -> None:
        self.said: list[str] = []
        self.more = 0

    def add(self, note: str) -> None:
        if len(self.said) < MAX_NOTES:
            self.said.append(note)
        else:
            self.more += 1

    def all(self) -> list[str]:
        return self.said + ([f"{self.more} more notes like these"] if self.more else [])


def session_dirs(path: str | Path) -> tuple[list[tuple[Path, int | None]], list[str]]:
    """The session dirs of the dump at `path` with their ranks (None: not distributed), ranks
    in order, and a note for each rank dir that leads outside `path` (not read); a DumpError
    when `path` holds no session."""
    root = Path(path)
    if not root.exists():
        raise DumpError(f"{root} does not exist: give the debug_dump_path a run wrote to")
    if not root.is_dir():
        raise DumpError(f"{root} is not a directory: give the debug_dump_path a run wrote to "
                        f"(a directory with {EVENTS} in it)")
    if (root / EVENTS).is_file():
        return [(root, None)], []
    ranks, refused = [], []
    for child in sorted(root.iterdir()):
        match = _RANK_DIR.match(child.name)
        if not (match and (child / EVENTS).is_file()):
            continue
        try:
            dump_files.inside(root, child.name)
        except dump_files.Refused as refusal:  # a symlink to someone else's directory
            refused.append(f"{child.name} {refusal}; not read")
            continue
        ranks.append((child, int(match.group(1))))
    if not ranks:
        raise DumpError(f"{root} is not a kvgraph debug dump: it has no {EVENTS} (nor "
                        f"rank_<r>/{EVENTS}); write one with debug_dump_path={root} "
                        "(KVGRAPH_DEBUG_DUMP, --debug-dump-path)"
                        + "".join(f"; {note}" for note in refused))
    return sorted(ranks, key=lambda item: item[1]), refused


def read_session(directory: Path, rank: int | None = None) -> RawSession:
    """The events and runtime reports of the session in `directory`."""
    notes = _Notes()
    events = _read_events(directory, notes)
    reports = {}
    for name in REPORTS:
        report = _read_report(directory, name, notes)
        if report is None:  # no file (or a damaged one): the newest event holds the same data
            report = next((e.get("data") for e in reversed(events) if e["stage"] == name), None)
        if report is not None:
            reports[name] = report
    return RawSession(directory, rank, events, reports, notes.all())


def _read_events(directory: Path, notes: _Notes) -> list[dict[str, Any]]:
    try:
        file = dump_files.open_file(directory, EVENTS)
    except dump_files.Refused as refusal:
        raise DumpError(f"{directory / EVENTS} {refusal}; not read") from None
    except OSError as error:
        raise DumpError(f"cannot read {directory / EVENTS}: {error}") from None
    events: list[dict[str, Any]] = []
    with file:
        for number, line in _lines(file, notes):
            if not line.strip():
                continue
            if len(events) == MAX_EVENTS:
                notes.add(f"{EVENTS} has more than {MAX_EVENTS} events; the rest were not read")
                break
            event = _event(directory, number, line, notes)
            if event is not None:
                events.append(event)
    return events


def _lines(file: BinaryIO, notes: _Notes) -> Iterator[tuple[int, bytes]]:
    """Each line of events.jsonl with its number, up to MAX_EVENTS_BYTES in all (a line cut by
    the cap is not given: it would only be a partial record)."""
    left = dump_files.MAX_EVENTS_BYTES
    for number in itertools.count(1):
        line = file.readline(left + 1)
        if len(line) > left:
            cap = size(dump_files.MAX_EVENTS_BYTES)
            notes.add(f"{EVENTS} is larger than {cap}; only its first {cap} were read")
            return
        if not line:
            return
        left -= len(line)
        yield number, line


def _event(directory: Path, number: int, line: bytes, notes: _Notes) -> dict[str, Any] | None:
    """Line `number` as an event, as far as its fields are of their kinds; None (and a note)
    when it is not one."""
    where = f"{EVENTS} line {number}"
    try:
        record = _loads(line)
    except _TooDeep as error:
        notes.add(f"{where} {error}; it was skipped")
        return None
    except ValueError:
        if not line.endswith(b"\n"):  # the last line, unfinished: killed mid-record
            notes.add(f"{EVENTS} ends in a partial record (line {number}: the process "
                      "was probably killed while writing it); it was skipped")
        else:
            notes.add(f"{where} is not JSON; it was skipped")
        return None
    why = _not_an_event(record)
    if why:
        notes.add(f"{where} is not a kvgraph event ({why}); it was skipped")
        return None
    event = fields.clean(record, fields.EVENT, where, notes.add)
    if event.get("data") is not None:
        kind = fields.DATA.get(event["stage"], fields.ANY)
        event["data"] = fields.clean(event["data"], kind, where, notes.add, "data")
    if event.get("file") is not None:
        _check_file(directory, event, where, notes)
    return event


def _not_an_event(record: Any) -> str | None:
    """Why `record` is not an event (an event is an object with a "stage" that is text)."""
    if not isinstance(record, dict):
        return f"it is {fields.describe(record)}, not an object"
    if "stage" not in record:
        return 'it has no "stage"'
    if not isinstance(record["stage"], str):
        return f'"stage" is {fields.describe(record["stage"])}, not text'
    return None


def _check_file(directory: Path, event: dict[str, Any], where: str, notes: _Notes) -> None:
    """Leave out the event's file, with a note, when it is not one of the dump's own."""
    try:
        dump_files.check(directory, event["file"])
    except dump_files.Refused as refusal:
        name = event["file"]
        name = name if len(name) <= _NAME_SHOWN else name[:_NAME_SHOWN - 3] + "..."
        notes.add(f"file {name!r} named by {where} {refusal}; not read")
        event["file"] = None


def _read_report(directory: Path, name: str, notes: _Notes) -> Any:
    """The runtime report `<name>.json`, as far as it is of its kind; None when there is
    none, or it cannot be used (with a note)."""
    file = f"{name}.json"
    try:
        contents = dump_files.read(directory, file, dump_files.MAX_REPORT_BYTES)
        if contents.cut:
            notes.add(f"{file} is larger than {size(dump_files.MAX_REPORT_BYTES)}; not read")
            return None
        report = _loads(contents.data)
    except FileNotFoundError:
        return None
    except (dump_files.Refused, _TooDeep) as refusal:
        notes.add(f"{file} {refusal}; not read")
        return None
    except (OSError, ValueError) as error:
        notes.add(f"{file} could not be read ({type(error).__name__}); its newest "
                  "event is used instead")
        return None
    return fields.clean(report, fields.DATA[name], file, notes.add)


def _loads(data: bytes) -> Any:
    """`data` as JSON: ValueError when it is not, _TooDeep when it nests too deep."""
    too_deep = _TooDeep(f"is nested deeper than {fields.MAX_DEPTH} levels")
    try:
        value = json.loads(data.decode("utf-8", errors="replace"))
    except RecursionError:  # Python's parser gives out near 1000 levels
        raise too_deep from None
    if fields.too_deep(value):
        raise too_deep
    return value
