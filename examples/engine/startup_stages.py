"""The engine's start-up, stage by stage: a line as each stage begins, its time when it ends,
and one summary line of where the start-up's time went.

Start-up is minutes on a cold cache (inductor compiling every piece); the lines say what is
running meanwhile, and the long stages (piece builds, captures) add kvgraph's own progress: a
bar on a terminal, a line every few seconds elsewhere.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Iterator

logger = logging.getLogger(__name__)


class StartupStages:
    """Times the stages of one rank's start-up, in the order they ran."""

    def __init__(self, who: str = "engine"):
        self.who = who
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def stage(self, name: str, doing: str) -> Iterator[None]:
        """Say `doing` ("loading weights from ..."), run the stage, record it as `name`."""
        logger.info("%s: %s", self.who, doing)
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = time.perf_counter() - start


def stage_times(seconds: dict[str, float]) -> str:
    """Where a start-up's time went: "load weights 2.1 s, compile 160.2 s, ..."."""
    return ", ".join(f"{name} {spent:.1f} s" for name, spent in seconds.items())
