"""Reading kvgraph's debug dumps: `python -m kvgraph.inspect DIR [--html OUT.html] [--json]`.

    summaries = load_dump(DIR)          # one Summary per session: DIR, or each DIR/rank_<r>
    print(text_report(summaries))       # or html_report(summaries), summary_json(summaries)

A path with no dump raises DumpError, whose message says what was there instead. What a dump
holds is not trusted: a value of the wrong kind or depth, a file outside the dump or past its
cap is a note of the report (kvgraph.inspect.dump_reader), never an error.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from kvgraph.inspect.dump_reader import DumpError, read_session, session_dirs
from kvgraph.inspect.html_report import html_report
from kvgraph.inspect.summarise import summarise
from kvgraph.inspect.summary import Summary
from kvgraph.inspect.text_report import text_report

__all__ = ["DumpError", "Summary", "load_dump", "text_report", "html_report", "summary_json"]


def load_dump(path: str | Path) -> list[Summary]:
    """The Summary of each session of the dump at `path`, in rank order; rank dirs that were
    not read are notes of the first."""
    directories, refused = session_dirs(path)
    summaries = [summarise(read_session(directory, rank)) for directory, rank in directories]
    summaries[0].notes += refused
    return summaries


def summary_json(summaries: list[Summary]) -> str:
    """The summaries as one JSON document: `{"sessions": [...]}`, a session per rank."""
    return json.dumps({"sessions": [dataclasses.asdict(s) for s in summaries]}, indent=2,
                      default=str)
