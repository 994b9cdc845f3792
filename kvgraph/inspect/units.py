"""How kvgraph.inspect writes durations and sizes: short, and the same in every report."""

from __future__ import annotations

_BYTE_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


def seconds(value: float | None) -> str:
    """`value` seconds as "1.23 s" or "4.5 ms"; "" when unknown."""
    if value is None:
        return ""
    if abs(value) >= 0.9995:  # what would round to "1e+03 ms"
        return f"{value:.2f} s"
    return f"{value * 1000:.3g} ms"


def size(value: int | float | None) -> str:
    """`value` bytes as "36.0 KiB"; "" when unknown."""
    if value is None:
        return ""
    amount, unit = float(value), 0
    while abs(amount) >= 1024 and unit < len(_BYTE_UNITS) - 1:
        amount, unit = amount / 1024, unit + 1
    return f"{int(amount)} B" if unit == 0 else f"{amount:.1f} {_BYTE_UNITS[unit]}"


def count(number: int | None, noun: str, plural: str | None = None) -> str:
    """`number` with `noun`, plural unless it is 1: "1 graph", "3 graphs"."""
    return f"{number} {noun}" if number == 1 else f"{number} {plural or noun + 's'}"
