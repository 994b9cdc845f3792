"""BurstWindow: how long an idle serving loop waits for the rest of a burst of requests.

Clients send requests in bursts (a batch job, or `vllm bench serve` refilling its concurrency
as a wave of requests ends), and the server hands them to the engine a few milliseconds apart.
An idle engine that steps on the first arrival prefills it alone; the rest join the next step,
and from then on that first request runs one step ahead of them: it ends a step early, its
successor arrives alone again, and every later wave splits the same way, each join stalling
the requests already decoding for a whole prefill (the inter-token latency's p99). Waiting a
moment while arrivals keep coming prefills the burst in one step and keeps the wave together.
"""

from __future__ import annotations

import argparse
import logging
import time
from dataclasses import dataclass
from typing import Callable, Iterator, TypeVar

from kvgraph.runtime.platforms import get_platform

logger = logging.getLogger(__name__)
Message = TypeVar("Message")

# The whole wait is at most this many gaps: a steady trickle must not hold the first request.
# The default gap is the device platform's (`default_burst_gap_ms`: 3 ms on the CPU, whose
# prefill steps take tens of milliseconds; off on an accelerator, whose steps take a few).
MAX_GAPS = 4
# The longest gap (--burst-gap-ms): a second's wait before an idle engine's first step is far
# beyond any burst's spread, and an unbounded one (inf, 1e300) stopped the engine loop.
MAX_GAP_MS = 1000.0


@dataclass(frozen=True)
class BurstWindow:
    """After a request reaches an idle engine, take others while each comes within `gap_s` of
    the last, for at most `MAX_GAPS` gaps in all; `gap_s` 0 steps at once."""

    gap_s: float = 0.0

    def __post_init__(self) -> None:
        if not 0 <= self.gap_s <= MAX_GAP_MS / 1000:  # also refuses NaN
            raise ValueError(f"the burst window's gap must lie in [0, {MAX_GAP_MS / 1000:g}] "
                             f"seconds, got {self.gap_s}")

    @classmethod
    def for_device(cls, device: str, gap_ms: float | None) -> BurstWindow:
        """`gap_ms` when given, else the default of the device's platform."""
        if gap_ms is None:
            gap_ms = get_platform(device).default_burst_gap_ms
        return cls(gap_ms / 1000)

    def gather(self, receive: Callable[[float], Message | None],
               full: Callable[[], bool]) -> Iterator[Message]:
        """The messages that arrive within the window: `receive(timeout)` returns the next or
        None when none came in time; the wait ends early once `full()` says the engine cannot
        take more this step."""
        if self.gap_s == 0:
            return
        deadline = time.monotonic() + MAX_GAPS * self.gap_s
        while not full():
            left = deadline - time.monotonic()
            if left <= 0:
                return
            message = receive(min(self.gap_s, left))
            if message is None:
                return
            yield message


def burst_window(args: argparse.Namespace) -> BurstWindow:
    """The server's burst window from its flags (`--device`, `--burst-gap-ms`), logged."""
    window = BurstWindow.for_device(args.device, args.burst_gap_ms)
    if window.gap_s:
        logger.info("burst window: an idle engine waits for requests arriving within %.1f ms "
                    "of each other (%.1f ms at most) before its first step", window.gap_s * 1e3,
                    MAX_GAPS * window.gap_s * 1e3)
    else:
        logger.info("burst window: off (an idle engine steps on the first request)")
    return window
