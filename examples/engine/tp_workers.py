"""The worker ranks (1..N-1): a worker's life, and rank 0's start-up with its workers.

A worker (`run_worker`) joins the group, builds its shard's runner exactly as rank 0 builds
its own (the same flags: the same compile and captures, so their collectives pair up), then
runs the steps rank 0 broadcasts (tp_runner.follow_steps) until rank 0 says stop. Its exit
code: 0 after a stop, 1 when rank 0 went away; an error in a step is raised (the process exits
with its traceback).

Rank 0 (`start_rank_zero`) spawns the workers with torch.multiprocessing (`spawn`) unless
torchrun started them, waits for each to join (a worker that dies first is reported, not
waited for), joins the group itself and builds its runner. It keeps `WorkerProcesses` to check
each step that every worker lives and to stop them when it closes; an exit handler stops them
too, so rank 0 never leaves a worker behind.
"""

from __future__ import annotations

import atexit
import logging
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch.distributed as dist
import torch.multiprocessing as mp

from .tp_launch import (
    JOINING_KEY,
    Rendezvous,
    join_group,
    leave_group,
    rank_device,
    torchrun_rendezvous,
)
from .step_channel import StepChannel
from .tp_runner import (EXIT_STATUS_WAIT_S, RankFailed, TensorParallelRunner, brief,
                        exit_description, follow_steps)

logger = logging.getLogger(__name__)

# Builds this rank's runner on a device: `build(device).runner` (a picklable callable, since
# spawned workers are given it).
Build = Callable[[str], Any]
# Seconds a worker has to exit after being told to stop, before it is killed.
STOP_WAIT_S = 30.0
# Seconds the workers have to exit when rank 0's start-up failed (they fail alike), before
# they are killed.
STARTUP_STOP_WAIT_S = 5.0
# Seconds between looks at the store and at the workers while they join.
POLL_S = 0.05
# Start-up errors of the flags or the model: every rank raises them alike, before any
# collective, so rank 0's is the one to report.
SHARED_ERRORS = (ValueError, LookupError, NotImplementedError, FileNotFoundError)


def run_worker(rendezvous: Rendezvous, device: str, timeout_s: float, build: Build) -> int:
    """A worker rank's whole life; its exit code (0: told to stop, 1: rank 0 went away)."""
    tp = join_group(rendezvous, rank_device(device, rendezvous), timeout_s)
    channel = StepChannel(tp)
    runner = build(rank_device(device, rendezvous)).runner
    try:
        steps = follow_steps(runner, channel)
    except RankFailed as failure:
        logger.error("%s; this worker stops", failure)
        return 1
    finally:
        runner.close()
    leave_group()
    logger.info("rank %d: stopped after %d steps", rendezvous.rank, steps)
    return 0


def _spawned_main(rendezvous: Rendezvous, device: str, timeout_s: float, build: Build,
                  log_level: int) -> None:
    """A spawned worker process's entry point."""
    logging.basicConfig(level=log_level, format=f"%(levelname)s rank {rendezvous.rank} "
                        "%(name)s: %(message)s")
    sys.exit(run_worker(rendezvous, device, timeout_s, build))


class WorkerProcesses:
    """Rank 0's handles on the worker ranks it spawned: start, join, liveness, stop."""

    def __init__(self, world_size: int, device: str, timeout_s: float, build: Build):
        self._dir = Path(tempfile.mkdtemp(prefix="kvgraph-tp-"))
        self.rendezvous = Rendezvous(0, world_size, 0, world_size, str(self._dir / "store"))
        context = mp.get_context("spawn")
        self._procs = {
            rank: context.Process(
                target=_spawned_main, name=f"kvgraph-tp-rank-{rank}",
                args=(self.rendezvous.with_rank(rank), device, timeout_s, build,
                      logging.getLogger().getEffectiveLevel()))
            for rank in range(1, world_size)}
        # Registered before the first start: an exit from here on stops whatever started.
        atexit.register(self.stop)
        for rank, proc in self._procs.items():
            proc.start()
            logger.info("spawned tensor-parallel rank %d (pid %d)", rank, proc.pid)

    @property
    def pids(self) -> dict[int, int]:
        """Each worker's process id, by rank."""
        return {rank: proc.pid for rank, proc in self._procs.items()}

    def first_dead(self, wait_s: float = 0.0) -> tuple[int, int] | None:
        """The lowest rank that has exited, with its exit code; None while all live.

        `wait_s` > 0 waits that long for one to exit (a peer's sockets close as it dies, a
        moment before its exit status can be read).
        """
        deadline = time.monotonic() + wait_s
        while True:
            for rank, proc in self._procs.items():
                if proc.exitcode is not None:
                    return rank, proc.exitcode
            if time.monotonic() >= deadline:
                return None
            time.sleep(POLL_S)

    def wait_joining(self, timeout_s: float) -> dist.Store:
        """Wait until every worker is joining the group; the store, for rank 0 to join too.

        A worker that exits first is a RankFailed at once; none joining in `timeout_s` too.
        """
        store = dist.FileStore(self.rendezvous.store_path, self.rendezvous.world_size)
        waiting = set(self._procs)
        deadline = time.monotonic() + timeout_s
        while True:
            waiting = {rank for rank in waiting
                       if not store.check([JOINING_KEY.format(rank=rank)])}
            if not waiting:
                return store
            dead = self.first_dead()
            if dead is not None:
                rank, code = dead
                raise RankFailed(f"tensor-parallel rank {rank} (pid {self.pids[rank]}) died "
                                 f"during start-up, {exit_description(code)}; its log says why",
                                 rank, code)
            if time.monotonic() > deadline:
                raise RankFailed(f"tensor-parallel ranks {sorted(waiting)} did not start within "
                                 f"{timeout_s:.0f} s (--distributed-timeout)", min(waiting))
            time.sleep(POLL_S)

    def stop(self, wait_s: float = STOP_WAIT_S) -> dict[int, int | None]:
        """Wait up to `wait_s` for every worker to exit, kill the rest; each one's exit code."""
        atexit.unregister(self.stop)
        deadline = time.monotonic() + wait_s
        for rank, proc in self._procs.items():
            if proc.pid is None:
                continue  # never started (start-up failed before it)
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                logger.warning("tensor-parallel rank %d (pid %d) did not stop within %.0f s; "
                               "killing it", rank, proc.pid, wait_s)
                proc.kill()
                proc.join(5)
        shutil.rmtree(self._dir, ignore_errors=True)
        return {rank: proc.exitcode for rank, proc in self._procs.items()}


def start_rank_zero(world_size: int, device: str, timeout_s: float, build: Build
                    ) -> tuple[Any, TensorParallelRunner]:
    """Rank 0's start-up: its workers, the group, its build; with its TensorParallelRunner.

    Workers are spawned unless torchrun started them. A failure stops the workers: an error of
    the flags or the model (ValueError and the like) is raised as it is, since every rank hits
    it alike; anything else, with a worker dead, is that worker's RankFailed.
    """
    rendezvous = torchrun_rendezvous()
    here = rank_device(device, rendezvous or Rendezvous(0, world_size, 0, world_size))
    workers = None
    try:
        if rendezvous is None:
            workers = WorkerProcesses(world_size, device, timeout_s, build)
            rendezvous = workers.rendezvous
        store = workers.wait_joining(timeout_s) if workers is not None else None
        channel = StepChannel(join_group(rendezvous, here, timeout_s, store))
        built = build(here)
    except BaseException as error:
        dead = _dead_worker(workers, error)
        if workers is not None:  # the others may be stuck in a collective with the dead one
            workers.stop(wait_s=0 if dead else STARTUP_STOP_WAIT_S)
        leave_group()
        if dead is not None and dead is not error:
            raise dead from error
        raise
    return built, TensorParallelRunner(built.runner, channel, workers, on_close=leave_group)


def _dead_worker(workers: WorkerProcesses | None, error: BaseException) -> RankFailed | None:
    """The RankFailed to report for a start-up `error`, if a dead worker explains it."""
    if isinstance(error, RankFailed):
        return error
    if workers is None or not isinstance(error, Exception) or isinstance(error, SHARED_ERRORS):
        return None
    dead = workers.first_dead(wait_s=EXIT_STATUS_WAIT_S)
    if dead is None:
        return None
    rank, code = dead
    return RankFailed(f"tensor-parallel rank {rank} (pid {workers.pids[rank]}) died during "
                      f"start-up, {exit_description(code)} (rank 0 saw {brief(error)})",
                      rank, code)
