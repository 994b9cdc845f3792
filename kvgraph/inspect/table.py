"""A table of a report (cells that are text, or a dump file shown collapsible in HTML), and
tables of a report whose layout kvgraph.inspect does not know (verify.json)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Code:
    """A cell that is a file of the dump: its path in text, its contents collapsible in HTML."""

    label: str
    file: str | None


@dataclass
class Table:
    """One table of a report: `stage` names what it is a table of (the HTML table's class)."""

    stage: str
    title: str
    columns: list[str]
    rows: list[list[Any]] = field(default_factory=list)  # str or Code cells
    notes: list[str] = field(default_factory=list)


def cell(value: Any) -> Any:
    """`value` as a table shows it (a Code cell stays one)."""
    if isinstance(value, Code) or isinstance(value, str):
        return value
    if value is None:
        return ""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.3g}"
    if isinstance(value, (list, tuple)):
        return ", ".join(str(cell(item)) for item in value)
    if isinstance(value, dict):
        return json.dumps(value, default=str)
    return str(value)


def generic_tables(stage: str, title: str, data: Any) -> list[Table]:
    """Tables of a report whose layout kvgraph.inspect does not know: its scalars as one table
    of name and value, each dict of dicts or list of dicts in it as a table of its own (a row
    per entry), each other dict or list in it in the same way, recursively."""
    if data is None:
        return []
    if isinstance(data, list):
        return [_records(stage, title, dict(enumerate(data)), "#")]
    if not isinstance(data, dict):
        return [Table(stage, title, ["value"], [[cell(data)]])]
    scalars = {k: v for k, v in data.items() if not isinstance(v, (dict, list))}
    made = [Table(stage, title, ["name", "value"], [[str(k), cell(v)] for k, v in
                                                      scalars.items()])]
    for key, value in data.items():
        if key in scalars:
            continue
        made += generic_tables(stage, f"{title}: {key}", value) if not _is_records(value) \
            else [_records(stage, f"{title}: {key}", value, "key")]
    return [table for table in made if table.rows or table.notes]


def _is_records(value: Any) -> bool:
    items = value.values() if isinstance(value, dict) else value
    return bool(items) and all(isinstance(item, dict) for item in items)


def _records(stage: str, title: str, records: Any, first: str) -> Table:
    if isinstance(records, list):
        records = dict(enumerate(records))
    if not _is_records(records):
        return Table(stage, title, [first, "value"], [[str(k), cell(v)]
                                                      for k, v in records.items()])
    columns = list(dict.fromkeys(name for record in records.values() for name in record))
    return Table(stage, title, [first, *columns], [
        [str(key), *(cell(record.get(name)) for name in columns)]
        for key, record in records.items()])
