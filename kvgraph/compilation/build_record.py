"""What each piece compiler reports of one build: a BuildRecord, to the observer it was given.

Below every piece compiler (inductor, eager, the NPU ones), so each can report without
importing another; the backend's observer writes the records into the debug dump.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class BuildRecord:
    """One build of one piece, as the debug dump reports it.

    `outcome`: "built" (the piece compiler compiled it), "loaded" (a compile-cache hit),
    "fallback" (the build failed: the FX code runs) or "uncompiled" (the eager piece compiler).
    `code` is inductor's output code for its builds (a cache hit, or an NPU compiler's build,
    keeps none), else the FX code that runs;
    `why` says why a build missed the cache, or why it fell back.
    """

    name: str
    outcome: str
    seconds: float
    code: str | None = None
    why: str | None = None


BuildObserver = Callable[[BuildRecord], None]


def ignore_build(record: BuildRecord) -> None:
    """The observer of a compiler nobody listens to."""
