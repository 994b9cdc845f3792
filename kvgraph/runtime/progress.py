"""Progress of a long start-up phase: a bar on a terminal, a log line every few seconds elsewhere.

Log files and pipes get whole lines (never a bar's carriage-return frames), and the count is
what the phase's summary counts.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any, TextIO

logger = logging.getLogger("kvgraph")

LOG_INTERVAL_S = 5.0


class Progress:
    """Counts `total` items of `what` (e.g. "descriptors captured") as they finish."""

    def __init__(self, what: str, total: int, stream: TextIO | None = None,
                 interval: float = LOG_INTERVAL_S):
        self.what, self.total, self.done = what, total, 0
        self.interval = interval
        self._start = self._logged = time.perf_counter()
        stream = stream or sys.stderr
        self._bar = _bar(what, total, stream) if total and _is_terminal(stream) else None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._bar is not None:
            self._bar.close()

    def advance(self) -> None:
        """One more item done: the bar moves, or a line is logged if `interval` has passed."""
        self.done += 1
        if self._bar is not None:
            self._bar.update(1)
            return
        now = time.perf_counter()
        if now - self._logged >= self.interval and self.done < self.total:
            self._logged = now
            logger.info("kvgraph: %d of %d %s, %.0f s so far", self.done, self.total, self.what,
                        now - self._start)


def _is_terminal(stream: TextIO) -> bool:
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


def _bar(what: str, total: int, stream: TextIO) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc=f"kvgraph: {what}", file=stream, leave=False)
