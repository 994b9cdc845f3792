"""How many compute threads torch runs a process's model with: chosen once, set, and logged.

One OpenMP thread per core the process owns, less one core for the process's other threads
(the server's event loop and the engine loop's own Python between steps), shared evenly among
the tensor-parallel ranks on the node; at least one. Torch's default (every core) is the worst
choice on a shared machine: OpenMP threads spin at their barriers, so one thread preempted by
another process stalls the rest (a batch-1 decode step of the small Llama took 385 ms at two
threads on a busy 2-core VM, 29.5 ms at one). vLLM's CPU backend makes the same choice: one
thread per core it is given, a core left for its server processes.

Inter-op threads are left alone: they run only TorchScript forks and other inter-op tasks,
which nothing on the serving path launches.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

# The cores left to the process's other threads, unless its platform says otherwise.
from kvgraph.runtime.platforms.base import SERVING_CORES

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ThreadChoice:
    """The compute threads of one process (one rank), the cores it saw, and why."""

    threads: int
    cores: int
    why: str


def choose_threads(cores: int, ranks: int = 1, requested: int | None = None,
                   serving_cores: int = SERVING_CORES) -> ThreadChoice:
    """`requested` threads when given (each rank's own), else each of `ranks` ranks' share of
    `cores` with `serving_cores` left over (the platform's), at least one."""
    if cores < 1 or ranks < 1:
        raise ValueError(f"cores and ranks must be >= 1, got cores={cores}, ranks={ranks}")
    if requested is not None:
        if requested < 1:
            raise ValueError(f"threads must be >= 1, got {requested}")
        return ThreadChoice(requested, cores, "as asked (--threads)")
    threads = max(1, (cores - serving_cores) // ranks)
    shared = f", shared by the node's {ranks} ranks" if ranks > 1 else ""
    return ThreadChoice(threads, cores, f"default: one per core less {serving_cores} for the "
                        f"process's other threads{shared}, at least 1")


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask, which taskset and cgroup cpusets
    narrow), not every core of the machine."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def set_compute_threads(requested: int | None = None, ranks: int = 1,
                        who: str = "this process", serving_cores: int = SERVING_CORES
                        ) -> ThreadChoice:
    """Choose this process's compute threads (see `choose_threads`), give them to torch, log
    one line. Call it before compiling: inductor's CPU kernels keep the thread count they were
    built with."""
    choice = choose_threads(usable_cores(), ranks, requested, serving_cores)
    torch.set_num_threads(choice.threads)
    logger.info("%s: %d compute thread%s (%d cores usable; %s)", who, choice.threads,
                "" if choice.threads == 1 else "s", choice.cores, choice.why)
    return choice


def bind_compute_threads(threads: int, ranks: int = 1, who: str = "this process"
                         ) -> list[int]:
    """Bind torch's `threads` compute threads to the first usable cores, one each (kvgraph's
    `kvgraph_cpu::bind_compute_threads`); the cores they run on, logged. Nothing is bound, and
    it says why, with several ranks on the node (each would need a slice of its own), more
    threads than cores, or without kvgraph's CPU kernels.

    Call it after compiling: the calling thread is bound too, and every thread and process it
    starts afterwards inherits its one core (inductor's compile workers would share it)."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    why_not = ("several ranks share this node" if ranks > 1
               else f"{threads} threads for {len(cores)} usable cores" if threads > len(cores)
               else None)
    if why_not is None:
        from kvgraph.cpu.build import KernelBuildError, load_kernels
        try:
            load_kernels()
        except KernelBuildError as error:
            why_not = str(error)
    if why_not is not None:
        logger.warning("%s: compute threads not bound: %s", who, why_not)
        return []
    placed = list(torch.ops.kvgraph_cpu.bind_compute_threads(cores[:threads]))
    logger.info("%s: compute threads bound to cores %s", who, placed or "(not on this OS)")
    return placed
