"""The text report of a dump: each session's tables as aligned columns, for a terminal."""

from __future__ import annotations

from kvgraph.inspect.sections import session_title, tables
from kvgraph.inspect.summary import Summary
from kvgraph.inspect.table import Code, Table

CELL_WIDTH = 100  # a cell wider than this is cut (the last column never is)


def text_report(summaries: list[Summary]) -> str:
    """The text report of every session of one dump (one per rank), in rank order."""
    return "\n\n".join(_session(summary) for summary in summaries) + "\n"


def _session(summary: Summary) -> str:
    parts = [f"# {session_title(summary)}"]
    if summary.notes:
        parts.append("\n".join(f"note: {note}" for note in summary.notes))
    for table in tables(summary):
        parts.append(_table(table))
    return "\n\n".join(parts)


def _table(table: Table) -> str:
    lines = [f"## {table.title}"]
    used = [i for i in range(len(table.columns))  # columns empty in every row go
            if any(_text(row[i], False) for row in table.rows)]
    if not used:
        lines.append("(none)")
    else:
        rows = [[table.columns[i] for i in used]] + [
            [_text(row[i], i != used[-1]) for i in used] for row in table.rows]
        widths = [max(len(row[i]) for row in rows) for i in range(len(used) - 1)]
        for row in rows:
            cells = [value.ljust(width) for value, width in zip(row, widths)] + [row[-1]]
            lines.append("  ".join(cells).rstrip())
    lines += [f"  {note}" for note in table.notes]
    return "\n".join(lines)


def _text(value: object, cut: bool) -> str:
    if isinstance(value, Code):
        return value.file or ""
    text = " ".join(str(value).split())  # one line per row
    return text if not cut or len(text) <= CELL_WIDTH else text[:CELL_WIDTH - 3] + "..."
