"""The top of the HTML page: a session's overview as a headline, a row of coloured cards (green
ok, amber worth a look, red a problem) that link down to their tables, the most important
warnings and a bar of where the time went; for a dump of several ranks, a table with a row
per rank. Inline CSS only (OVERVIEW_STYLE); every value escaped."""

from __future__ import annotations

from html import escape

import kvgraph.inspect.units as units
from kvgraph.inspect.overview import (BAD, NEUTRAL, OK, WARN, Fact, Overview, headlines,
                                      quoted)

# Each status's text and background colours; the page's tests look for these in a screenshot.
STATUS_COLOURS = {OK: ("#116329", "#dcf5e3"), WARN: ("#7a4d00", "#fff0c2"),
                  BAD: ("#a40e26", "#ffdde0"), NEUTRAL: ("#333333", "#eef1f4")}
_TIME_COLOURS = ("#3b6fb6", "#7fa7de", "#9b6cc4", "#c9a3e6", "#5a9e8f", "#a9d3c8")
OVERVIEW_STYLE = "".join(
    f".{status} {{ color: {text}; background: {back}; }}\n"
    for status, (text, back) in STATUS_COLOURS.items()) + "".join(
    f".t{number} {{ background: {colour}; }}\n"
    for number, colour in enumerate(_TIME_COLOURS)) + """
.overview { margin: 0.8em 0 1.6em; }
.headline { font-size: 18px; font-weight: 600; padding: 0.45em 0.7em; border-left: 6px solid;
            border-radius: 4px; margin: 0 0 0.4em; }
dl.about { display: grid; grid-template-columns: max-content 1fr; gap: 0.15em 1em;
           margin: 0.7em 0 0.9em; color: #444; }
dl.about dt { font-weight: 600; } dl.about dd { margin: 0; }
.cards { display: grid; grid-template-columns: repeat(auto-fill, minmax(15em, 1fr));
         gap: 0.6em; margin: 0 0 0.9em; }
.card { border-left: 6px solid; border-radius: 4px; padding: 0.45em 0.7em; }
.card .label { font-size: 12px; text-transform: uppercase; letter-spacing: 0.04em; }
.card .value { font-size: 20px; font-weight: 700; overflow-wrap: anywhere; }
.card .detail { font-size: 13px; color: #333; overflow-wrap: anywhere; }
.card a { font-size: 12px; color: inherit; }
.overview h4 { margin: 0.6em 0 0.3em; font-size: 14px; }
ol.top-warnings { margin: 0 0 0.9em; padding-left: 1.6em; }
ol.top-warnings li { margin: 0.15em 0; overflow-wrap: anywhere; }
.timebar { display: flex; height: 14px; max-width: 60em; border-radius: 3px; overflow: hidden;
           background: #eee; }
ul.legend { list-style: none; padding: 0; margin: 0.3em 0 0; display: flex; flex-wrap: wrap;
            gap: 0.2em 1.2em; font-size: 13px; }
ul.legend i { display: inline-block; width: 0.9em; height: 0.9em; margin-right: 0.35em;
              vertical-align: -0.1em; border-radius: 2px; }
table.ranks td { font-family: system-ui, sans-serif; font-size: 13px; white-space: nowrap; }
table.ranks td.first-warning { white-space: normal; overflow-wrap: anywhere; }
"""


def overview_html(view: Overview, links: dict[str, str], warning_row: str) -> str:
    """A session's overview; `links` holds the anchor of each stage's table, `warning_row`
    the warnings table's row anchors with "{}" for the row's number."""
    parts = ['<div class="overview">\n', *(f'<p class="headline {status}">{escape(line)}</p>\n'
                                          for status, line in headlines(view.facts)),
             '<dl class="about">' + "".join(f"<dt>{escape(label)}</dt><dd>{escape(value)}</dd>"
                                            for label, value in view.about) + "</dl>\n",
             '<div class="cards">\n' + "".join(_card(fact, links) for fact in view.facts)
             + "</div>\n", _top_warnings(view, warning_row), _time_bar(view)]
    if view.notes:
        parts.append(f'<p class="note">{units.count(view.notes, "note")}: parts of this dump '
                     "could not be read (listed below)</p>\n")
    return "".join(parts) + "</div>\n"


def ranks_head(labels: list[str]) -> str:
    """The opening of the table of ranks, a column per fact of the overview."""
    head = "".join(f"<th>{escape(label)}</th>" for label in
                   ["Rank", *labels, "Most important warning"])
    return (f'<h2>Ranks at a glance</h2>\n<table class="ranks">\n<thead><tr>{head}</tr></thead>'
            "\n<tbody>\n")


def rank_row(rank: int | None, view: Overview, section: str, warning_row: str) -> str:
    """One rank's row of the table of ranks: each fact's value in its status's colour, then
    the rank's most important warning; `section` and `warning_row` as overview_html's."""
    cells = "".join(f'<td class="{fact.status}" title="{escape(fact.detail)}">'
                    f"{escape(fact.value)}</td>" for fact in view.facts)
    first = "".join(f'<a href="#{escape(warning_row.format(number))}">'
                    f"{escape(quoted(finding.message))}</a>"
                    for number, finding in view.top_warnings[:1])
    return (f'<tr><td><a href="#{escape(section)}">rank {escape(str(rank))}</a></td>{cells}'
            f'<td class="first-warning">{first}</td></tr>\n')


def _card(fact: Fact, links: dict[str, str]) -> str:
    more = (f' <a href="#{escape(links[fact.stage])}">details</a>'
            if fact.stage in links else "")
    return (f'<div class="card {fact.status}"><div class="label">{escape(fact.label)}</div>'
            f'<div class="value">{escape(fact.value)}</div>'
            f'<div class="detail">{escape(fact.detail)}{more}</div></div>\n')


def _top_warnings(view: Overview, warning_row: str) -> str:
    if not view.top_warnings:
        return ""
    items = "".join(f'<li><a href="#{escape(warning_row.format(number))}">'
                    f"{escape(quoted(finding.message))}</a></li>\n"
                    for number, finding in view.top_warnings)
    return f"<h4>Most important warnings</h4>\n<ol class=\"top-warnings\">\n{items}</ol>\n"


def _time_bar(view: Overview) -> str:
    total = sum(share.seconds for share in view.time_spent)
    if not view.time_spent or not 0 < total < float("inf"):
        return ""
    shown = view.time_spent[:len(_TIME_COLOURS)]
    segments = "".join(f'<span class="t{number}" style="width: {100 * s.seconds / total:.2f}%">'
                       "</span>" for number, s in enumerate(shown))
    legend = "".join(f'<li><i class="t{number}"></i>{escape(s.what)} '
                     f"{units.seconds(s.seconds)} ({100 * s.seconds / total:.0f}%)</li>"
                     for number, s in enumerate(shown))
    return (f"<h4>Where the time went</h4>\n<div class=\"timebar\">{segments}</div>\n"
            f'<ul class="legend">{legend}</ul>\n')
