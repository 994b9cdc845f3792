"""Progress of a long start-up phase: a bar on a terminal, a log line every few seconds elsewhere.

Log files and pipes get whole lines (never a bar's carriage-return frames), and the count is
what the phase's summary counts. An item may carry a tag (a piece build "from the compile
cache"): the bar and the lines say how many of the items so far had each tag.
"""

from __future__ import annotations

import logging
import sys
import time
from collections import Counter
from typing import Any, TextIO

logger = logging.getLogger("kvgraph")

LOG_INTERVAL_S = 5.0


class Progress:
    """Counts `total` items of `what` (e.g. "descriptors captured") as they finish."""

    def __init__(self, what: str, total: int, stream: TextIO | None = None,
                 interval: float = LOG_INTERVAL_S):
        self.what, self.total, self.done = what, total, 0
        self.tags: Counter[str] = Counter()
        self.interval = interval
        self._start = self._logged = time.perf_counter()
        stream = stream or sys.stderr
        self._bar = _bar(what, total, stream) if total and _is_terminal(stream) else None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._bar is not None:
            self._bar.close()

    def advance(self, tag: str | None = None) -> None:
        """One more item done (tagged `tag`): the bar moves, or a line is logged if `interval`
        has passed."""
        self.done += 1
        if tag:
            self.tags[tag] += 1
        if self._bar is not None:
            if tag:
                self._bar.set_postfix_str(self.tag_counts())
            self._bar.update(1)
            return
        now = time.perf_counter()
        if now - self._logged >= self.interval and self.done < self.total:
            self._logged = now
            tags = f" ({self.tag_counts()})" if self.tags else ""
            logger.info("kvgraph: %d of %d %s%s, %.0f s so far", self.done, self.total,
                        self.what, tags, now - self._start)

    def tag_counts(self) -> str:
        """How many items so far had each tag: "3 from the compile cache"."""
        return ", ".join(f"{count} {tag}" for tag, count in self.tags.items())


def _is_terminal(stream: TextIO) -> bool:
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


def _bar(what: str, total: int, stream: TextIO) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc=f"kvgraph: {what}", file=stream, leave=False)
