"""The HTML report of a dump: one self-contained page (inline CSS, no scripts, nothing fetched),
a table per stage, every piece's and build's code collapsible (`<details>`)."""

from __future__ import annotations

from html import escape

from kvgraph.inspect.sections import session_title, tables
from kvgraph.inspect.summary import Summary
from kvgraph.inspect.table import Code, Table

_STYLE = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 1.5em; color: #222; }
h2 { border-bottom: 2px solid #888; margin-top: 2em; }
h3 { margin: 1.6em 0 0.4em; }
table { border-collapse: collapse; margin: 0.3em 0; }
th, td { border: 1px solid #ccc; padding: 0.2em 0.5em; text-align: left; vertical-align: top; }
th { background: #eee; }
td { font-family: ui-monospace, monospace; font-size: 12px; }
table.warning td { background: #fff4e0; }
pre { max-height: 40em; max-width: 100ch; overflow: auto; background: #f7f7f7;
      padding: 0.5em; margin: 0.3em 0; }
details summary { cursor: pointer; color: #035; }
p.note { margin: 0.2em 0; color: #555; }
nav a { margin-right: 0.8em; }
"""


def html_report(summaries: list[Summary]) -> str:
    """The page of every session of one dump (one per rank), in rank order."""
    title = session_title(summaries[0]) if len(summaries) == 1 else (
        f"kvgraph debug dump: {summaries[0].directory} and {len(summaries) - 1} more ranks")
    body = "\n".join(_session(summary, number) for number, summary in enumerate(summaries))
    return (f'<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
            f"<title>{escape(title)}</title>\n<style>{_STYLE}</style>\n</head>\n<body>\n"
            f"<h1>{escape(title)}</h1>\n{body}\n</body>\n</html>\n")


def _session(summary: Summary, number: int) -> str:
    made = tables(summary)
    anchors = [f"s{number}-{index}-{table.stage}" for index, table in enumerate(made)]
    parts = [f'<section class="session">\n<h2>{escape(session_title(summary))}</h2>']
    parts += [f'<p class="note">note: {escape(note)}</p>' for note in summary.notes]
    parts.append("<nav>" + "".join(f'<a href="#{anchor}">{escape(table.stage)}</a>'
                                   for anchor, table in zip(anchors, made)) + "</nav>")
    parts += [_table(table, anchor, summary) for table, anchor in zip(made, anchors)]
    return "\n".join(parts) + "\n</section>"


def _table(table: Table, anchor: str, summary: Summary) -> str:
    head = "".join(f"<th>{escape(column)}</th>" for column in table.columns)
    rows = "\n".join("<tr>" + "".join(f"<td>{_cell(value, summary)}</td>" for value in row)
                     + "</tr>" for row in table.rows)
    notes = [escape(note) for note in table.notes] or ([] if table.rows else ["none"])
    return (f'<h3 id="{escape(anchor)}">{escape(table.title)}</h3>\n'
            f'<table class="{escape(table.stage)}" data-stage="{escape(table.stage)}">\n'
            f"<thead><tr>{head}</tr></thead>\n<tbody>\n{rows}\n</tbody>\n</table>\n"
            + "".join(f'<p class="note">{note}</p>\n' for note in notes))


def _cell(value: object, summary: Summary) -> str:
    if not isinstance(value, Code):
        return escape(str(value))
    if not value.file:
        return ""
    text = summary.read_text(value.file)
    if text is None:
        return f"{escape(value.file)} (missing)"
    return (f"<details><summary>{escape(value.label)}</summary>"
            f'<p class="note">{escape(value.file)}</p><pre>{escape(text)}</pre></details>')
