"""Python's cyclic garbage collector kept off what start-up built, as vLLM does after its own.

A loaded, compiled and captured model leaves hundreds of thousands of objects that live as long
as the engine (modules, compiled pieces, Dynamo's and inductor's caches), and every full
collection walks all of them: one took ~340 ms for the small Llama on the CPU, a pause for the
step that meets it (measured: docs/serving.md). `gc.freeze()` moves them to a generation the
collector never visits; what steps allocate afterwards is collected as before. A process that
drops its engine and builds another (tests do) may `gc.unfreeze()` to hand the old one's objects
back.

The objects are unfrozen again at exit: the interpreter's last collection skips the frozen
generation, so extension objects held in cycles there were never released, and nanobind
(Triton's bindings, which Dynamo imports whenever Triton is installed) printed ~30 lines of
"leaked instance/type/function" at every exit.
"""

from __future__ import annotations

import atexit
import gc
import logging
import time

logger = logging.getLogger(__name__)


def freeze_startup_objects() -> int:
    """Collect once, then freeze every object that survives; returns how many were frozen."""
    start = time.perf_counter()
    gc.collect()
    gc.freeze()
    atexit.unregister(gc.unfreeze)  # once per process, however many engines froze
    atexit.register(gc.unfreeze)
    frozen = gc.get_freeze_count()
    logger.info("froze %d start-up objects out of the garbage collector's scans (%.2f s)",
                frozen, time.perf_counter() - start)
    return frozen
