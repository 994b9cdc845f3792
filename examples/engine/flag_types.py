"""argparse types for the entry points' numeric flags: every number bounded where it is parsed.

A value outside its range is refused by argparse, which names the flag ("argument --threads:
must lie in [1, 8] (...), got 100000") and exits 2, before anything is built. Unbounded, such a
value surfaced much later, far from its cause: `--threads 100000` exhausted the machine's
threads, `--burst-gap-ms inf` stopped the engine at its first request, `--port 70000` raised
after the whole engine had been built.
"""

from __future__ import annotations

import argparse
import math
from typing import Callable

from .threads import usable_cores

# Compute threads per usable core, at most: beyond a few, more OpenMP threads only wait at
# each other's barriers (threads.py), and each costs a stack and a kernel task.
MAX_THREADS_PER_CORE = 4
# Seconds in a day: the longest wait any flag may ask for.
MAX_SECONDS = 86400.0


def int_in(low: int, high: int, why: str = "") -> Callable[[str], int]:
    """An argparse type: an integer in [low, high]; `why` says what bounds it."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(
                f"must lie in [{low}, {high}]{f' ({why})' if why else ''}, got {value}")
        return value

    return parse


def float_in(low: float, high: float, why: str = "", low_open: bool = False
             ) -> Callable[[str], float]:
    """An argparse type: a finite number in [low, high] ((low, high] if `low_open`)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        above_low = value > low if low_open else value >= low
        if not (math.isfinite(value) and above_low and value <= high):
            bracket = "(" if low_open else "["
            raise argparse.ArgumentTypeError(
                f"must be a finite number in {bracket}{low:g}, {high:g}]"
                f"{f' ({why})' if why else ''}, got {text}")
        return value

    return parse


def seconds(low: float = 0.0, high: float = MAX_SECONDS, low_open: bool = True
            ) -> Callable[[str], float]:
    """An argparse type: a duration in seconds, finite and at most a day."""
    return float_in(low, high, "seconds, at most a day" if high == MAX_SECONDS else "seconds",
                    low_open)


def compute_threads(text: str) -> int:
    """An argparse type: compute threads, at most MAX_THREADS_PER_CORE per usable core."""
    cores = usable_cores()
    return int_in(1, MAX_THREADS_PER_CORE * cores,
                  f"{MAX_THREADS_PER_CORE} per usable core; this process may use {cores}")(text)


positive_int = int_in(1, 2**31 - 1)
port = int_in(0, 65535, "a TCP port; 0 picks a free one")
