"""The process's C allocator told to keep the memory steps free, so the next step's large CPU
tensors reuse pages already faulted in.

torch's CPU allocator has no cache: every step allocates its activations anew from the C
library's malloc. glibc serves a block past its mmap threshold (128 KiB at first, raised as such
blocks are freed, to at most 32 MiB) with a fresh mapping and unmaps it when freed, and trims the
heap's free top: each time, the pages go back to Linux, which faults them in and zeroes them
again on first touch. A prefill's larger activations meet that every layer (the small Llama's
gate/up output at 1024 tokens is 11.5 MB). On a 2-core AMD EPYC Zen 4 VM (one thread, a
prefill of 16 x 64 tokens, fp32; docs/performance.md, "Freed memory kept") a prefill took 3,800-9,400 page
faults and 465-478 ms, and under the torch profiler, whose own allocations move glibc's
threshold, 533-876 ms, its 8 gate/up matmuls 270-620 ms; with freed memory kept, 0 faults,
459-470 ms, the matmuls 215 ms.

`keep_freed_memory()` sets glibc's M_MMAP_MAX to 0 (every block from the heap) and
M_TRIM_THRESHOLD to its largest (the heap's top is not given back): the process keeps its
high-water mark of allocations for reuse, as tcmalloc and jemalloc (which vLLM's CPU guide
preloads) do. Call it after loading the weights: memory freed before it is still returned
(a load's copies); after it, nothing is. glibc on Linux only; elsewhere it says why and changes
nothing.
"""

from __future__ import annotations

import ctypes
import logging
import platform
import sys
from dataclasses import dataclass

logger = logging.getLogger(__name__)

# mallopt's parameters (malloc.h).
M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4
LARGEST_TRIM_THRESHOLD = 2**31 - 1  # mallopt takes an int


@dataclass(frozen=True)
class MallocPolicy:
    """What `keep_freed_memory` did: whether freed memory now stays in the process, or why not."""

    kept: bool
    reason: str | None = None


def keep_freed_memory() -> MallocPolicy:
    """Make glibc's malloc keep what is freed (no mappings for large blocks, no trimming),
    logged; where the process's C library is not glibc, say why and change nothing."""
    libc_name = platform.libc_ver()[0]
    if not sys.platform.startswith("linux") or libc_name != "glibc":
        reason = f"the C library is not glibc ({sys.platform}, {libc_name or 'unknown'})"
        logger.info("kvgraph: freed memory goes back to the system as the allocator decides: %s",
                    reason)
        return MallocPolicy(False, reason)
    mallopt = ctypes.CDLL(None).mallopt  # the process's own C library
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    if not (mallopt(M_MMAP_MAX, 0) and mallopt(M_TRIM_THRESHOLD, LARGEST_TRIM_THRESHOLD)):
        reason = "glibc's mallopt refused M_MMAP_MAX or M_TRIM_THRESHOLD"
        logger.warning("kvgraph: freed memory goes back to the system: %s", reason)
        return MallocPolicy(False, reason)
    logger.info("kvgraph: freed memory stays in the process (glibc: no mmap for large blocks, "
                "no trimming), so each step's tensors reuse pages already faulted in")
    return MallocPolicy(True)
