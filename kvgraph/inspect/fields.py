"""What each value of a dump must be where inspect reads it (its kind: text, a finite number, a
list, an object whose fields have kinds of their own; at most MAX_DEPTH deep), and `clean`,
which keeps what is and leaves out what is not, with a note naming where it was.

The reports trust what `clean` kept: a field of the wrong kind is left out of its object (an
item out of its list), as if the dump had not written it. A named field may be null ("not
known"); an item of a list, or a value of a map whose values are added up, may not.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Union

# Levels of nesting a value may have. kvgraph writes at most six; the reports recurse once a
# level (Python's json, dataclasses.asdict, the verify tables), and Python gives out near 1000.
MAX_DEPTH = 64
_SHOWN = 40  # characters of a key a note quotes


@dataclass(frozen=True)
class Scalar:
    """A kind of JSON value with nothing inside: `name` as a note says it."""

    name: str
    accepts: Callable[[Any], bool]


def _is_number(value: Any) -> bool:
    """A finite int or float (not a bool): what the reports add, compare and format."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an int too large for a float
        return False


ANY = Scalar("anything", lambda value: True)
TEXT = Scalar("text", lambda value: isinstance(value, str))
NUMBER = Scalar("a finite number", _is_number)
INTEGER = Scalar("an integer", lambda value: isinstance(value, int)
                 and not isinstance(value, bool))


@dataclass(frozen=True)
class ListOf:
    """A JSON list whose every item is of kind `item`."""

    item: Kind
    name: str = "a list"


@dataclass(frozen=True)
class Record:
    """A JSON object: the kinds of the fields inspect reads, and `others`, that of the rest."""

    fields: Mapping[str, Kind] = field(default_factory=dict)
    others: Kind = ANY
    name: str = "an object"


Kind = Union[Scalar, ListOf, Record]
LIST = ListOf(ANY)

# An event as kvgraph/compilation/debug.py writes it; its data's kind is its stage's, in DATA.
EVENT = Record({"seq": INTEGER, "time": NUMBER, "stage": TEXT, "name": TEXT,
                "compile": INTEGER, "file": TEXT, "seconds": NUMBER, "data": ANY})
_VERIFIED = Record({"failures": NUMBER, "max_rel": NUMBER, "cache_max_rel": NUMBER})
_VERIFY = Record({"failures": NUMBER, "descriptors": Record(others=_VERIFIED)})
_CAPTURED = Record({"descriptor": TEXT, "seconds": NUMBER, "capture_seconds": NUMBER,
                    "bytes": NUMBER})
_PIECE = Record({"inputs_from": LIST, "outputs_to": LIST})
_PASS = Record({"seconds": NUMBER, "removed": LIST, "added": LIST, "changed": LIST})
# The data of each stage's events, and each runtime report (<stage>.json), by stage; the fields
# named are those the reports compute with, the rest they only show.
DATA: dict[str, Kind] = {
    "runner": Record(), "config": Record({"capture_sizes": ListOf(NUMBER)}),
    "cache": Record(), "passes": ListOf(_PASS),
    "split": Record({"pieces": ListOf(_PIECE), "seconds": NUMBER}),
    "build": Record(), "counters": Record(others=NUMBER), "warning": Record(),
    "trace": Record({"total_seconds": NUMBER, "backend_seconds": NUMBER}),
    "capture": Record({"seconds": NUMBER, "bytes": NUMBER, "failed": LIST,
                       "table": ListOf(_CAPTURED)}),
    "stats": Record({"hits": Record(others=NUMBER), "graphs": Record({"graph_bytes": NUMBER}),
                     "compile": Record({"dynamo_graphs": NUMBER}), "verify": _VERIFY}),
    "verify": _VERIFY,
}


def clean(value: Any, kind: Kind, where: str, say: Callable[[str], None],
          path: str = "") -> Any:
    """`value` as far as it is of `kind`; what is not is left out, and `say` gets a note naming
    it by `where` (its file, its line) and its `path` inside. None when `value` itself is not."""
    kept = _clean(value, kind, where, say, path)
    return None if kept is _LEFT_OUT else kept


def too_deep(value: Any) -> bool:
    """Whether `value` nests lists and objects deeper than MAX_DEPTH (an iterative walk: a
    recursive one would fail at the depth it measures)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            if depth > MAX_DEPTH:
                return True
            stack += [(inner, depth + 1) for inner in
                      (item.values() if isinstance(item, dict) else item)]
    return False


def describe(value: Any) -> str:
    """What `value` is, as a note says it: "text", "a list", "nan"."""
    if value is None:
        return "null"
    for kinds, said in ((bool, "a boolean"), (str, "text"), (list, "a list"),
                        (dict, "an object")):
        if isinstance(value, kinds):
            return said
    if isinstance(value, float):
        return "a number" if math.isfinite(value) else repr(value)
    return "an integer" if _is_number(value) else "an integer too large for a float"


_LEFT_OUT = object()


def _clean(value: Any, kind: Kind, where: str, say: Callable[[str], None], path: str) -> Any:
    if not _accepts(kind, value):
        named = f'{where}: "{path}"' if path else where
        say(f"{named} is {describe(value)}, not {kind.name}; ignored")
        return _LEFT_OUT
    if isinstance(kind, Record):
        kept = {}
        for key, inner in value.items():
            inner_kind = kind.fields.get(key, kind.others)
            if inner is None and (key in kind.fields or inner_kind is ANY):
                # a field's null: not known, whatever its kind (a map's values are added up)
                kept[key] = None
                continue
            cleaned = _clean(inner, inner_kind, where, say, _join(path, key))
            if cleaned is not _LEFT_OUT:
                kept[key] = cleaned
        return kept
    if isinstance(kind, ListOf) and kind.item is not ANY:
        items = (_clean(item, kind.item, where, say, f"{path}[{index}]")
                 for index, item in enumerate(value))
        return [item for item in items if item is not _LEFT_OUT]
    return value


def _accepts(kind: Kind, value: Any) -> bool:
    if isinstance(kind, Record):
        return isinstance(value, dict)
    if isinstance(kind, ListOf):
        return isinstance(value, list)
    return kind.accepts(value)


def _join(path: str, key: str) -> str:
    shown = " ".join(key.split())  # a key with a newline must not break a note's line
    shown = shown if len(shown) <= _SHOWN else shown[:_SHOWN - 3] + "..."
    return f"{path}.{shown}" if path else shown
