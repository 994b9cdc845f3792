"""The HTML report of a dump: one self-contained page (inline CSS, no scripts, nothing fetched):
each session's overview first (kvgraph.inspect.html_overview; for several ranks, a row per rank
above them), then a table per stage, long ones and every piece's and build's code collapsible
(`<details>`); at most MAX_PAGE_BYTES, however much the dump holds."""

from __future__ import annotations

from html import escape
from pathlib import Path

import kvgraph.inspect.dump_files as dump_files
import kvgraph.inspect.units as units
from kvgraph.inspect.dump_files import MAX_CODE_BYTES
from kvgraph.inspect.html_overview import OVERVIEW_STYLE, overview_html, rank_row, ranks_head
from kvgraph.inspect.overview import Overview, overview
from kvgraph.inspect.sections import session_title, tables
from kvgraph.inspect.summary import Summary
from kvgraph.inspect.table import Code, Table

MAX_PAGE_BYTES = 32 * 2**20  # past it, the page's later tables are a note (a browser chokes)
_CLOSING_BYTES = 4096  # kept for the tags that close the page and the note on where it stopped
COLLAPSED_ROWS = 25  # a table with more rows is shown collapsed (the warnings never are)
_STYLE = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 1.5em; color: #222; max-width: 110em; }
h1 { font-size: 20px; margin: 0 0 0.5em; overflow-wrap: anywhere; }
h2 { font-size: 17px; border-bottom: 2px solid #888; margin-top: 2em; overflow-wrap: anywhere; }
h3 { font-size: 15px; margin: 1.6em 0 0.4em; }
table { border-collapse: collapse; margin: 0.3em 0; }
th, td { border: 1px solid #ccc; padding: 0.2em 0.5em; text-align: left; vertical-align: top; }
th { background: #eee; }
td { font-family: ui-monospace, monospace; font-size: 12px; }
table.warning td { background: #fff4e0; }
tr:target td { background: #ffe27a; }
pre { max-height: 40em; max-width: 100ch; overflow: auto; background: #f7f7f7;
      padding: 0.5em; margin: 0.3em 0; }
details summary { cursor: pointer; color: #035; }
p.note { margin: 0.2em 0; color: #555; }
nav { margin: 0.4em 0; } nav a, nav b { margin-right: 0.8em; }
""" + OVERVIEW_STYLE


def html_report(summaries: list[Summary]) -> str:
    """The page of every session of one dump (one per rank), in rank order; at most
    MAX_PAGE_BYTES of it, the tables past that left out with a note."""
    title = session_title(summaries[0]) if len(summaries) == 1 else (
        f"kvgraph debug dump: {summaries[0].directory} and "
        f"{units.count(len(summaries) - 1, 'more rank')}")
    page = _Page()
    page.open(f'<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
              f"<title>{escape(title)}</title>\n<style>{_STYLE}</style>\n</head>\n<body>\n"
              f"<h1>{escape(title)}</h1>\n", "</body>\n</html>\n")
    views = [overview(summary) for summary in summaries]
    if len(summaries) > 1:
        _ranks(page, summaries, views)
    for number, (summary, view) in enumerate(zip(summaries, views)):
        _session(page, summary, view, number, titled=len(summaries) > 1)
    if page.full:
        page.close_with(f'<p class="note">note: the page reached its cap of '
                        f"{units.size(MAX_PAGE_BYTES)}: the tables past this point are not "
                        "shown (the text report has them all)</p>\n")
    return page.text()


class _Page:
    """The page as it is written, in UTF-8: at most MAX_PAGE_BYTES, and well formed wherever
    it stops (each part that opens an element says how to close it)."""

    def __init__(self) -> None:
        self.parts: list[bytes] = []
        self.closing: list[str] = []  # of each element open, innermost last
        self.left = MAX_PAGE_BYTES - _CLOSING_BYTES
        self.full = False

    def add(self, text: str) -> bool:
        """Add `text` if it fits; once a part does not, none after it is added either."""
        if self.full:
            return False
        data = text.encode("utf-8", "backslashreplace")  # a lone surrogate a JSON string held
        if len(data) > self.left:
            self.full = True
            return False
        self.parts.append(data)
        self.left -= len(data)
        return True

    def open(self, text: str, closing: str) -> bool:
        """Add `text`, which opens elements that `closing` closes (at the next `close`)."""
        if not self.add(text):
            return False
        self.closing.append(closing)
        return True

    def close(self) -> None:
        """Close the innermost open elements (always: _CLOSING_BYTES is kept for it)."""
        self.parts.append(self.closing.pop().encode())

    def close_with(self, text: str) -> None:
        """Add `text` (from _CLOSING_BYTES, as a closing tag is) where the page stopped."""
        while len(self.closing) > 1:  # inside <body>: a note is no table row
            self.close()
        self.parts.append(text.encode())

    def text(self) -> str:
        while self.closing:
            self.close()
        return b"".join(self.parts).decode("utf-8")


def _ranks(page: _Page, summaries: list[Summary], views: list[Overview]) -> None:
    """A row per rank, each linking to its section."""
    if not page.open(ranks_head([fact.label for fact in views[0].facts]), "</tbody>\n</table>\n"):
        return
    for number, (summary, view) in enumerate(zip(summaries, views)):
        if not page.add(rank_row(summary.rank, view, f"s{number}", _warning_rows(number))):
            break
    page.close()


def _session(page: _Page, summary: Summary, view: Overview, number: int, titled: bool) -> None:
    """The session's overview, then its tables; `titled`: it has a heading of its own (one
    session's title is the page's)."""
    made = tables(summary)
    anchors = [f"s{number}-{index}-{table.stage}" for index, table in enumerate(made)]
    links: dict[str, str] = {}  # the first table of each stage, which the overview links to
    for table, anchor in zip(made, anchors):
        links.setdefault(table.stage, anchor)
    title = f"<h2>{escape(session_title(summary))}</h2>\n" if titled else ""
    if not page.open(f'<section class="session" id="s{number}">\n{title}', "</section>\n"):
        return
    page.add(overview_html(view, links, _warning_rows(number)))
    for note in summary.notes:
        page.add(f'<p class="note">note: {escape(note)}</p>\n')
    page.add("<nav><b>Tables:</b> " + "".join(
        f'<a href="#{anchor}">{escape(table.stage)}</a>' for anchor, table in zip(anchors, made))
        + "</nav>\n")
    for table, anchor in zip(made, anchors):
        _table(page, table, anchor, summary,
               _warning_rows(number) if table.stage == "warning" else None)
    page.close()


def _warning_rows(number: int) -> str:
    """The anchor of each row of session `number`'s warnings table, "{}" its row's number (the
    overview links to them)."""
    return f"s{number}-warning-{{}}"


def _table(page: _Page, table: Table, anchor: str, summary: Summary,
           row_anchors: str | None) -> None:
    """The table with its notes; with `row_anchors`, each row has that anchor ("{}" its
    number)."""
    head = "".join(f"<th>{escape(column)}</th>" for column in table.columns)
    collapsed = len(table.rows) > COLLAPSED_ROWS and table.stage != "warning"
    opening = f"<details><summary>{len(table.rows)} rows</summary>\n" if collapsed else ""
    if not page.open(f'<h3 id="{escape(anchor)}">{escape(table.title)}</h3>\n{opening}'
                     f'<table class="{escape(table.stage)}" data-stage="{escape(table.stage)}">'
                     f"\n<thead><tr>{head}</tr></thead>\n<tbody>\n",
                     "</tbody>\n</table>\n" + ("</details>\n" if collapsed else "")):
        return
    ids = [f' id="{escape(row_anchors.format(number))}"' if row_anchors else ""
           for number in range(len(table.rows))]
    for row, row_id in zip(table.rows, ids):  # one at a time: the page may stop at any of them
        if not page.add(f"<tr{row_id}>" + "".join(f"<td>{_cell(value, summary)}</td>"
                                                  for value in row) + "</tr>\n"):
            break
    page.close()
    notes = [escape(note) for note in table.notes] or ([] if table.rows else ["none"])
    for note in notes:
        page.add(f'<p class="note">{note}</p>\n')


def _cell(value: object, summary: Summary) -> str:
    if not isinstance(value, Code):
        return escape(str(value))
    if not value.file:
        return ""
    try:
        contents = dump_files.read(Path(summary.directory), value.file, MAX_CODE_BYTES)
    except dump_files.Refused as refusal:  # its session's notes say which event named it
        return f"{escape(value.file)} ({escape(str(refusal))}; not read)"
    except OSError:
        return f"{escape(value.file)} (missing)"
    cut = (f'<p class="note">shown truncated: the file is larger than '
           f"{units.size(MAX_CODE_BYTES)}</p>" if contents.cut else "")
    text = contents.data.decode("utf-8", errors="replace")
    return (f"<details><summary>{escape(value.label)}</summary>"
            f'<p class="note">{escape(value.file)}</p>{cut}<pre>{escape(text)}</pre></details>')
