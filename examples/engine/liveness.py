"""Whether an engine can still serve: a step that has run too long, a tensor-parallel rank gone.

The server's /health answers 503 when the engine cannot serve (examples/serve.py): a load
balancer or an orchestrator then stops sending it requests, or restarts it. "Alive" alone is not
enough: an engine loop blocked in a step forever, with its thread or process still there, holds
every request in flight and takes new ones it will never answer.
"""

from __future__ import annotations

import time
from typing import Any

# Seconds a step may run before /health calls the engine stuck (--stuck-step-timeout). A step
# takes milliseconds on a device and at most seconds on the CPU (a 1024-token prefill of the
# 1B preset on one core); this is far beyond either, so only an engine that is really stuck
# (a hung collective, a deadlock, a stopped process) is reported.
DEFAULT_STUCK_STEP_S = 120.0
# Seconds between an idle engine's looks at its tensor-parallel ranks: a rank that dies while no
# request runs is reported then, not when the next request arrives and fails.
IDLE_CHECK_S = 1.0


class StepWatch:
    """When the step in progress began, and whether it has run longer than `limit_s`.

    Written by the engine's loop (`begin` before a step, `end` after) and read from any
    thread: `_since` is one reference, replaced whole, so a reader sees one value or the other.
    """

    def __init__(self, limit_s: float = DEFAULT_STUCK_STEP_S):
        if not 0 < limit_s < float("inf"):
            raise ValueError(f"a step's time limit must be a finite number of seconds > 0, "
                             f"got {limit_s}")
        self.limit_s = limit_s
        self._since: float | None = None

    def begin(self) -> None:
        self._since = time.monotonic()

    def end(self) -> None:
        self._since = None

    def overdue(self) -> str | None:
        """Why the engine is stuck (a step over its limit), or None."""
        since = self._since
        if since is None:
            return None
        ran = time.monotonic() - since
        if ran <= self.limit_s:
            return None
        return (f"the engine is stuck: a step has run for {ran:.0f} s, longer than the "
                f"{self.limit_s:g} s one may take (--stuck-step-timeout)")


def check_ranks(runner: Any) -> None:
    """Raise the engine's EngineDeadError if one of its tensor-parallel ranks has died (a
    TensorParallelRunner says; a one-rank runner has none to lose)."""
    check = getattr(runner, "check_ranks", None)
    if check is not None:
        check()
