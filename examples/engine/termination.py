"""SIGTERM in the server's child processes: stop when the parent says, not on the spot.

`timeout`, systemd and `kill -TERM -PGID` signal a whole process group: the server, its engine
process and the engine's tensor-parallel ranks at once. A child that died on the spot would
fail the requests the server is still finishing in its grace period, and the server would log
an engine that "exited unexpectedly". So a child takes SIGTERM as notice: it goes on until its
parent stops it in order, and ends itself only if that has not happened within `wait_s` (a
SIGTERM sent to the child alone). A second SIGTERM ends it at once.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from types import FrameType

logger = logging.getLogger(__name__)

# Seconds the server lets requests in flight go on after SIGTERM (--shutdown-timeout).
DEFAULT_SHUTDOWN_S = 10.0
# Seconds the server waits for its engine process to stop once told, before terminating it.
ENGINE_STOP_S = 10.0


def defer_sigterm(who: str, wait_s: float) -> None:
    """From now on, a SIGTERM to this process ends it `wait_s` seconds later, unless it has
    exited by then (its parent stopped it); call from the main thread."""

    def on_sigterm(signum: int, frame: FrameType | None) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the next SIGTERM, the timer's included
        logger.info("%s: SIGTERM; going on until the server stops it, at most %.0f s", who,
                    wait_s)
        timer = threading.Timer(wait_s, os.kill, (os.getpid(), signal.SIGTERM))
        timer.daemon = True
        timer.start()

    signal.signal(signal.SIGTERM, on_sigterm)
