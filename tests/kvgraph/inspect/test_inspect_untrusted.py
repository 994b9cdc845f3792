"""`python -m kvgraph.inspect` on dumps nobody should trust: values of the wrong type or depth,
files named outside the dump, devices, fifos and huge files. Each ends in a report with a note,
never a traceback, and nothing outside the dump is read."""

from __future__ import annotations

import contextlib
import copy
import html
import io
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvgraph.inspect.__main__ import main

ROOT = Path(__file__).resolve().parents[3]
DEEP = 3000  # levels of nesting that once ended in RecursionError
SPARSE_BYTES = 2 * 2**30  # a huge file that costs nothing to make: a sparse one
SECRET = "root:x:0:0"  # what /etc/passwd starts with; it must never reach a report
# A run of the command that takes longer has hung (it reads far past a cap): a run takes ~5 s,
# ~12 s on two cores shared with three CPU hogs. How fast it is is no test's business.
HANG_GUARD_S = 60
# The private writable memory the command may use (RLIMIT_DATA: heap and anonymous mappings,
# not the address space, which CUDA builds of torch reserve by the tens of GiB).
MEMORY_LIMIT = 3 * 2**30
CODE = "compile-000/05-build-submod_0-1.py"


def event(seq: int, stage: str, name: str, **fields: Any) -> dict[str, Any]:
    return {"seq": seq, "time": seq / 10, "stage": stage, "name": name, "compile": None,
            "file": None, "seconds": None, "data": None, **fields}


CAPTURE = {"descriptors": 1, "graphs": 2, "seconds": 0.1, "bytes": 4096, "failed": [],
           "bytes_by_descriptor": {"d1": 4096},
           "table": [{"descriptor": "d1", "mode": "full", "graphs": 2, "seconds": 0.1,
                      "capture_seconds": 0.05, "bytes": 4096, "error": None}]}
VERIFY = {"enabled": True, "checks": 2, "failures": 1, "token_flips": 1, "descriptors": {
    "d1": {"checks": 2, "failures": 1, "max_rel": 0.5, "cache_max_rel": 0.0, "token_flips": 1,
           "passed": False, "where": "layer 1"}}}
STATS = {"graph_mode": "full", "hits": {"full:d1": 3}, "padded_tokens": 0, "fallbacks": 1,
         "uncaptured": 1, "graphs": {"captures": 2, "replays": 3, "graph_bytes": 4096},
         "compile": {"dynamo_graphs": 2}, "verify": VERIFY}
# A small dump of every stage kvgraph records, shaped as kvgraph/compilation/debug.py writes it.
EVENTS = [
    event(0, "runner", "runner", data={"requested_graph_mode": "full",
                                        "graph_mode": "full_and_piecewise",
                                        "attn_backend": "torch_native", "device": "cpu",
                                        "limits": {"max_num_tokens": 16}}),
    event(1, "config", "config", compile=0, file="compile-000/00-config.json",
          data={"graph_mode": "piecewise", "piece_compiler": "eager", "compile_sizes": [],
                "capture_sizes": [1, 2, 4], "passes": []}),
    event(2, "dynamo", "dynamo", compile=0, file="compile-000/01-dynamo.py"),
    event(3, "cache", "cache-key", compile=0, data={"used": True, "key": "abc123",
                                                   "directory": "/tmp/c", "key_change": None,
                                                   "why": None}),
    event(4, "pass", "pass-fuse", compile=0, file="compile-000/02-pass-fuse.py", seconds=0.01),
    event(5, "passes", "passes", compile=0, seconds=0.01, data=[
        {"pass": "fuse", "seconds": 0.01, "nodes_before": 10, "nodes_after": 9,
         "removed": ["a", "b"], "added": [], "changed": ["c"]}]),
    event(6, "split", "split", compile=0, file="compile-000/03-split.py", seconds=0.02),
    event(7, "split", "split-pieces", compile=0, data={
        "pieces": [{"name": "submod_0", "kind": "compute", "nodes": 3, "inputs_from": ["x"],
                    "outputs_to": ["submod_1"], "same_as": "submod_0"},
                   {"name": "submod_1", "kind": "attention", "nodes": 1,
                    "inputs_from": ["submod_0"], "outputs_to": ["output"], "same_as": None,
                    "op": "kvgraph.attention"}],
        "compute_pieces": 1, "attention_pieces": 1, "unique_compute_pieces": 1}),
    event(8, "piece", "piece-submod_0", compile=0, file="compile-000/04-piece-submod_0.py"),
    event(9, "build", "build-submod_0-1", compile=0, file=CODE, seconds=0.03,
          data={"piece": "submod_0", "size": "1", "outcome": "fallback", "why": "no"}),
    event(10, "counters", "counters", compile=0, seconds=0.5, data={
        "dynamo_graphs": 1, "builds": 1, "cache_hits": 0, "build_fallbacks": 1,
        "compile_seconds": 0.5}),
    event(11, "bytecode", "bytecode", file="bytecode.py"),
    event(12, "trace", "trace", seconds=0.4, data={"total_seconds": 1.0,
                                                   "backend_seconds": 0.5}),
    event(13, "capture", "capture", file="capture.json", data=CAPTURE),
    event(14, "warning", "kvgraph.runner", data={"message": "capturing d1 failed"}),
    event(15, "stats", "stats", file="stats.json"),
    event(16, "verify", "verify", file="verify.json"),
]
REPORTS = {"capture": CAPTURE, "stats": STATS, "verify": VERIFY}


def _keys(value: Any) -> set[str]:
    """Every dict key anywhere in `value`."""
    if isinstance(value, dict):
        return set(value) | {k for v in value.values() for k in _keys(v)}
    if isinstance(value, list):
        return {k for v in value for k in _keys(v)}
    return set()


KEYS = sorted(_keys(EVENTS) | _keys(list(REPORTS.values())))


def write_dump(directory: Path, events: list[Any] | None = None,
               reports: dict[str, Any] | None = None) -> Path:
    """A dump in `directory`: each event a JSON line (a str is written as it is), the reports
    as <name>.json, and every file the good events name, with a line of code in it."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "compile-000").mkdir(exist_ok=True)
    for e in EVENTS:
        if e["file"] and e["file"] not in ("capture.json", "stats.json", "verify.json"):
            (directory / e["file"]).write_text(f"# {e['name']}: x < y\n")
    lines = [e if isinstance(e, str) else json.dumps(e) for e in
             (EVENTS if events is None else events)]
    (directory / "events.jsonl").write_text("".join(line + "\n" for line in lines))
    for name, report in (REPORTS if reports is None else reports).items():
        (directory / f"{name}.json").write_text(report if isinstance(report, str)
                                                else json.dumps(report))
    return directory


def inspect_command(*args: str) -> subprocess.CompletedProcess:
    """The real command, in a process whose memory is capped at MEMORY_LIMIT."""
    def limit_memory() -> None:
        resource.setrlimit(resource.RLIMIT_DATA, (MEMORY_LIMIT, MEMORY_LIMIT))

    return subprocess.run([sys.executable, "-m", "kvgraph.inspect", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=HANG_GUARD_S,
                          preexec_fn=limit_memory)


def inspect_html(dump: Path) -> tuple[str, str]:
    """The real command's text and HTML page of `dump`: it must exit 0 without a traceback."""
    page = dump.parent / f"{dump.name}.html"
    result = inspect_command(str(dump), "--html", str(page))
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr[-3000:]
    return result.stdout, page.read_text(errors="replace")


def inspect_in_process(dump: Path) -> tuple[str, str]:
    """main()'s text (then its JSON) and HTML page of `dump`: no traceback may escape."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main([str(dump), "--html", str(dump.parent / "page.html")]) == 0
        assert main([str(dump), "--json"]) == 0
    page = (dump.parent / "page.html").read_text(errors="replace")
    assert page.startswith("<!DOCTYPE html>") and page.endswith("</html>\n")
    return out.getvalue(), page


def inspect_all(dump: Path) -> str:
    """Everything main() makes of `dump`, as one text."""
    return "".join(inspect_in_process(dump))


def notes(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("note: ")]


def nested(depth: int) -> str:
    """A JSON value `depth` levels deep (json.dumps itself cannot write one so deep)."""
    return '{"data": [' * (depth // 2) + "1" + "]}" * (depth // 2)


# --- what kvgraph itself writes reads as before ---------------------------------------------------


def test_a_real_dump_and_the_small_one_here_read_without_a_note(tmp_path):
    from tests.support.dumps import make_dump

    real = make_dump(tmp_path / "real", "full_and_piecewise", verify=True)
    assert {"capture.json", "stats.json", "verify.json"} <= {p.name for p in real.iterdir()}
    for dump in (real, write_dump(tmp_path / "small")):
        assert notes(inspect_all(dump)) == []


# --- 7: values of the wrong type or depth ---------------------------------------------------------


def test_an_event_whose_stage_is_a_list_is_skipped_with_a_note(tmp_path):
    dump = write_dump(tmp_path / "dump", [{"stage": ["x"]}], {})
    text, page = inspect_html(dump)
    assert [n for n in notes(text) if "line 1" in n and '"stage"' in n and "skipped" in n]
    assert "## Warnings (0)" in text and "<h3" in page


def test_3000_deep_values_are_notes_not_a_recursion_error(tmp_path):
    deep = nested(DEEP)
    events = [*EVENTS[:1], f'{{"stage": "runner", "name": "runner", "data": {deep}}}',
              *EVENTS[1:]]
    dump = write_dump(tmp_path / "dump", events, {**REPORTS, "verify": deep})
    text, _ = inspect_html(dump)
    assert [n for n in notes(text) if "events.jsonl line 2" in n and "nested deeper" in n]
    assert [n for n in notes(text) if "verify.json" in n and "nested deeper" in n]
    assert "## Pieces" in text  # the rest of the dump is still read


@pytest.mark.parametrize("index, field, value, expected", [
    (9, "seconds", "0.03", "is text, not a finite number"),
    (9, "seconds", float("nan"), "is nan, not a finite number"),
    (1, "compile", "0", "is text, not an integer"),
    (1, "compile", True, "is a boolean, not an integer"),
    (12, "time", float("inf"), "is inf, not a finite number"),
    (4, "file", ["compile-000/02-pass-fuse.py"], "is a list, not text"),
    (13, "data", [CAPTURE], "is a list, not an object"),
])
def test_an_event_field_of_the_wrong_type_is_ignored_with_a_note(tmp_path, index, field, value,
                                                                  expected):
    events = copy.deepcopy(EVENTS)
    events[index][field] = value
    text = inspect_all(write_dump(tmp_path / "dump", events))
    said = [n for n in notes(text) if f"events.jsonl line {index + 1}" in n]
    assert any(f'"{field}"' in n and expected in n and "ignored" in n for n in said), said
    assert "## Pieces" in text and "## Warnings" in text


@pytest.mark.parametrize("path, value, expected", [
    ("table.0.bytes", "4096", "is text, not a finite number"),
    ("table.0.descriptor", ["d1"], "is a list, not text"),  # once a dict key: unhashable
    ("failed", 3, "is an integer, not a list"),
    ("seconds", 10**400, "is an integer too large for a float, not a finite number"),
], ids=["bytes", "descriptor", "failed", "huge seconds"])
def test_a_nested_value_of_the_wrong_type_is_ignored_with_a_note(tmp_path, path, value,
                                                                 expected):
    capture = copy.deepcopy(CAPTURE)
    *parents, last = [int(key) if key.isdigit() else key for key in path.split(".")]
    target = capture
    for key in parents:
        target = target[key]
    target[last] = value
    events = copy.deepcopy(EVENTS)
    events[13]["data"] = capture
    text = inspect_all(write_dump(tmp_path / "dump", events, {**REPORTS, "capture": capture}))
    shown = path.replace(".0.", "[0].")
    said = [n for n in notes(text) if shown in n and expected in n and "ignored" in n]
    assert [n for n in said if "events.jsonl line 14" in n], notes(text)
    assert [n for n in said if "capture.json" in n], notes(text)


def test_a_lone_surrogate_in_a_string_is_printed_escaped(tmp_path):
    events = [*EVENTS, '{"stage": "warning", "name": "x\\ud800", "data": {"message": "\\udfff"}}']
    text, page = inspect_html(write_dump(tmp_path / "dump", events))
    assert "\\udfff" in text and "\\udfff" in page  # escaped: UTF-8 cannot hold it


# --- 8: only the dump's own files, and only so much of them ---------------------------------------


@pytest.mark.parametrize("named", ["/etc/passwd", "../../../../../../../../etc/passwd",
                                   "/dev/zero", "link-out.py", "link-zero.py"])
def test_a_file_named_outside_the_dump_is_a_note_and_never_read(tmp_path, named):
    events = copy.deepcopy(EVENTS)
    events[9]["file"] = named
    dump = write_dump(tmp_path / "dump", events)
    (dump / "link-out.py").symlink_to("/etc/passwd")
    (dump / "link-zero.py").symlink_to("/dev/zero")
    # /dev/zero through the command, whose memory is capped: read unbounded, it ends in
    # MemoryError (or takes the machine's memory); the rest through main(), faster
    text, page = (inspect_html if "zero" in named else inspect_in_process)(dump)
    assert SECRET not in text and SECRET not in page
    said = f"file {named!r} named by events.jsonl line 10 is outside the dump; not read"
    assert f"note: {said}" in text, notes(text)
    assert said in html.unescape(page)


def test_a_fifo_or_directory_named_as_a_file_is_not_opened(tmp_path):
    events = copy.deepcopy(EVENTS)
    events[9]["file"] = "compile-000/fifo.py"
    events[8]["file"] = "compile-000"
    dump = write_dump(tmp_path / "dump", events)
    os.mkfifo(dump / "compile-000/fifo.py")  # opening it would wait for a writer forever
    text, page = inspect_html(dump)
    for line, named in ((10, "compile-000/fifo.py"), (9, "compile-000")):
        assert (f"note: file {named!r} named by events.jsonl line {line} is not a regular file;"
                " not read") in text


def test_a_report_or_rank_dir_that_leads_outside_is_not_read(tmp_path):
    dump = write_dump(tmp_path / "dump", reports={"capture": CAPTURE, "verify": VERIFY})
    (tmp_path / "secret.json").write_text(json.dumps({"graph_mode": SECRET}))
    (dump / "stats.json").symlink_to(tmp_path / "secret.json")  # JSON: it would be shown
    text, page = inspect_in_process(dump)
    assert "note: stats.json is outside the dump; not read" in text
    assert SECRET not in text and SECRET not in page

    outside = write_dump(tmp_path / "elsewhere")
    ranks = tmp_path / "ranks"
    write_dump(ranks / "rank_0")
    (ranks / "rank_1").symlink_to(outside)
    text = inspect_command(str(ranks)).stdout
    assert "rank 0" in text and "rank 1" not in text
    assert "note: rank_1 is outside the dump; not read" in text


def test_an_events_file_that_leads_outside_is_refused(tmp_path):
    outside = write_dump(tmp_path / "elsewhere")
    dump = tmp_path / "dump"
    dump.mkdir()
    (dump / "events.jsonl").symlink_to(outside / "events.jsonl")
    result = inspect_command(str(dump))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "events.jsonl is outside the dump; not read" in result.stderr


def test_a_2_gib_events_file_is_read_up_to_its_cap(tmp_path):
    from kvgraph.inspect.dump_files import MAX_EVENTS_BYTES
    from kvgraph.inspect.units import size

    dump = write_dump(tmp_path / "dump")
    with open(dump / "events.jsonl", "r+b") as events:
        events.truncate(SPARSE_BYTES)  # the good events, then 2 GiB of zeros
    text, _ = inspect_html(dump)
    assert (f"note: events.jsonl is larger than {size(MAX_EVENTS_BYTES)}; only its first "
            f"{size(MAX_EVENTS_BYTES)} were read") in text
    assert "## Pieces" in text


def test_huge_report_and_code_files_are_capped_with_a_note(tmp_path):
    from kvgraph.inspect.dump_files import MAX_CODE_BYTES, MAX_REPORT_BYTES
    from kvgraph.inspect.units import size

    dump = write_dump(tmp_path / "dump")
    for name in ("stats.json", CODE):
        with open(dump / name, "r+b") as file:
            file.truncate(SPARSE_BYTES)
    text, page = inspect_html(dump)
    assert f"note: stats.json is larger than {size(MAX_REPORT_BYTES)}; not read" in text
    assert f"shown truncated: the file is larger than {size(MAX_CODE_BYTES)}" in page
    assert len(page.encode()) < 2 * MAX_CODE_BYTES


def test_the_page_stops_at_its_cap_with_a_note(tmp_path):
    from kvgraph.inspect.dump_files import MAX_CODE_BYTES
    from kvgraph.inspect.html_report import MAX_PAGE_BYTES
    from kvgraph.inspect.units import size

    builds = [event(100 + n, "build", f"build-submod_0-{n}", compile=0, file=CODE, seconds=0.1,
                    data={"piece": "submod_0", "size": str(n), "outcome": "built"})
              for n in range(2 * MAX_PAGE_BYTES // MAX_CODE_BYTES)]
    dump = write_dump(tmp_path / "dump", [*EVENTS, *builds])
    (dump / CODE).write_text("y" * MAX_CODE_BYTES)
    _, page = inspect_html(dump)
    assert len(page.encode()) <= MAX_PAGE_BYTES
    assert f"the page reached its cap of {size(MAX_PAGE_BYTES)}" in page
    assert page.endswith("</html>\n")


def test_events_past_the_most_read_are_a_note(tmp_path, monkeypatch):
    import kvgraph.inspect.dump_reader as dump_reader

    monkeypatch.setattr(dump_reader, "MAX_EVENTS", 5)
    text = inspect_all(write_dump(tmp_path / "dump"))
    assert "note: events.jsonl has more than 5 events; the rest were not read" in text


# --- any JSON value, anywhere ---------------------------------------------------------------------

# Every kind of value JSON (as Python's json writes it) holds: huge ints, nan and inf included.
SCALARS = (st.none() | st.booleans() | st.integers()
           | st.sampled_from([10**400, -(2**64), "\ud800", "a\udfffb"])
           | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=12))
VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
    st.sampled_from(KEYS) | st.text(max_size=6), inner, max_size=5), max_leaves=24)
STAGES = sorted({e["stage"] for e in EVENTS})
FUZZ = settings(max_examples=80, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def _paths(value: Any, path: tuple = ()) -> list[tuple]:
    """Every path into `value` (dict keys and list indices), `value` itself first."""
    found = [path]
    items = value.items() if isinstance(value, dict) else enumerate(value) \
        if isinstance(value, list) else ()
    for key, inner in items:
        found += _paths(inner, (*path, key))
    return found


# ("events", i, ...) or ("capture"|"stats"|"verify", ...): every place a value can be.
PATHS = [("events", *p) for p in _paths(EVENTS)[1:]] + [
    (name, *p) for name, report in REPORTS.items() for p in _paths(report)]


def _inspect_in_a_fresh_dir(events: list[Any], reports: dict[str, Any]) -> str:
    """Everything main() makes of a dump of these values, each written as JSON (a str too)."""
    with tempfile.TemporaryDirectory() as directory:
        return inspect_all(write_dump(Path(directory) / "dump", [json.dumps(e) for e in events],
                                      {name: json.dumps(r) for name, r in reports.items()}))


@FUZZ
@given(lines=st.lists(VALUES | st.fixed_dictionaries(
    {"stage": st.sampled_from(STAGES)}, optional={k: VALUES for k in EVENTS[0] if k != "stage"}),
    max_size=4))
def test_any_json_line_as_an_event(lines):
    _inspect_in_a_fresh_dir([*EVENTS, *lines], REPORTS)


def _put(dump: dict[str, Any], path: tuple, value: Any) -> None:
    """Put `value` at `path` in `dump`, where an earlier change left a way there."""
    target: Any = dump
    try:
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value
    except (KeyError, IndexError, TypeError):  # a parent was replaced by something else
        pass


@settings(FUZZ, max_examples=140)
@given(changes=st.lists(st.tuples(st.sampled_from(PATHS), VALUES), min_size=1, max_size=3))
def test_any_json_value_in_place_of_any_field(changes):
    dump = {"events": copy.deepcopy(EVENTS), **copy.deepcopy(REPORTS)}
    for path, value in changes:
        _put(dump, path, value)
    events = dump.pop("events")
    _inspect_in_a_fresh_dir(events, dump)


@settings(FUZZ, max_examples=60)
@given(reports=st.fixed_dictionaries({}, optional={  # any value, or an object of its own keys
    name: VALUES | st.dictionaries(st.sampled_from(sorted(_keys(report))), VALUES, max_size=6)
    for name, report in REPORTS.items()}))
def test_any_json_value_as_a_report_file(reports):
    _inspect_in_a_fresh_dir(EVENTS, reports)
