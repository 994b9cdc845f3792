"""Start-up progress: whole log lines off a terminal, a bar on one, counting what the capture
summary counts (descriptors, not the graphs of their pieces)."""

from __future__ import annotations

import io
import logging

from kvgraph.progress import Progress
from tests.support.scenario import CAPTURE_SIZES, make_runner


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_off_a_terminal_progress_is_log_lines_and_never_carriage_returns(caplog):
    stream = io.StringIO()
    with caplog.at_level(logging.INFO, logger="kvgraph"):
        with Progress("descriptors captured", 3, stream, interval=0) as progress:
            for _ in range(3):
                progress.advance()
    assert stream.getvalue() == ""
    lines = [r.getMessage() for r in caplog.records if "descriptors captured" in r.getMessage()]
    assert lines[0].startswith("kvgraph: 1 of 3 descriptors captured")
    assert len(lines) == 2  # the last item is the summary's to report


def test_on_a_terminal_progress_is_a_bar():
    stream = Terminal()
    with Progress("descriptors captured", 2, stream) as progress:
        progress.advance()
        progress.advance()
    assert "kvgraph: descriptors captured" in stream.getvalue() and "\r" in stream.getvalue()


def test_the_capture_summary_counts_descriptors_and_the_graphs_of_their_pieces(caplog):
    runner = make_runner("llama", "piecewise")
    with caplog.at_level(logging.INFO, logger="kvgraph"):
        summary = runner.capture()
    assert summary["descriptors"] == len(CAPTURE_SIZES)
    pieces = runner.stats()["compile"]["pieces"]
    assert summary["graphs"] == len(CAPTURE_SIZES) * pieces
    assert f"captured {len(CAPTURE_SIZES)} descriptors ({summary['graphs']} graphs" in caplog.text


def test_tagged_items_are_counted_on_the_bar_and_in_the_lines(caplog):
    tags = [None, "from the compile cache", "from the compile cache", "fell back to eager", None]
    stream = io.StringIO()
    with caplog.at_level(logging.INFO, logger="kvgraph"):
        with Progress("piece builds", len(tags), stream, interval=0) as progress:
            for tag in tags:
                progress.advance(tag)
    lines = [r.getMessage() for r in caplog.records if "piece builds" in r.getMessage()]
    assert lines[1].startswith("kvgraph: 2 of 5 piece builds (1 from the compile cache)")
    assert "(2 from the compile cache, 1 fell back to eager)" in lines[3]

    terminal = Terminal()
    with Progress("piece builds", len(tags), terminal) as progress:
        for tag in tags:
            progress.advance(tag)
    assert "2 from the compile cache, 1 fell back to eager" in terminal.getvalue()
