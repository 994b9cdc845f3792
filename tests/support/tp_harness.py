"""Run a function on spawned ranks joined by torch.distributed (gloo), for tensor-parallel tests.

    results = run_ranks(fn, tmp_path, world_size=2, args=(...))   # [rank 0's, rank 1's, ...]

Each rank is a spawned process with one compute thread, a gloo process group over a `FileStore`
in `tmp_path` (no fixed ports) with a 60 s timeout, and kvgraph's TP group recorded. `fn(rank,
*args)` must be importable (a module-level function); what it returns is saved with torch.save
and handed back. A rank that raises or dies fails the test with that rank's traceback, and its
peers are killed; so are all ranks past `deadline_s`.
"""

from __future__ import annotations

import os
import queue
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Sequence

import pytest
import torch
import torch.multiprocessing as mp

PROCESS_GROUP_TIMEOUT_S = 60


def run_ranks(fn: Callable[..., Any], tmp_path: Path, world_size: int = 2,
              args: Sequence[Any] = (), deadline_s: float = 300.0,
              timeout_s: float = PROCESS_GROUP_TIMEOUT_S) -> list[Any]:
    """Each rank's result of `fn(rank, *args)`, in rank order; pytest.fail on any rank's error."""
    ctx = mp.get_context("spawn")
    messages = ctx.Queue()
    store = tmp_path / f"store-{time.monotonic_ns()}"
    procs = [ctx.Process(target=_rank_main, name=f"rank-{rank}",
                         args=(fn, rank, world_size, str(store), str(tmp_path), tuple(args),
                               timeout_s, messages), daemon=True)
             for rank in range(world_size)]
    for proc in procs:
        proc.start()
    try:
        return _collect(procs, messages, tmp_path, world_size, time.monotonic() + deadline_s)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            proc.join(timeout=10)


def _collect(procs: list, messages: Any, tmp_path: Path, world_size: int,
             deadline: float) -> list[Any]:
    done: set[int] = set()
    while len(done) < world_size:
        try:
            status, rank, text = messages.get(timeout=0.5)
        except queue.Empty:
            for rank, proc in enumerate(procs):
                if rank not in done and proc.exitcode not in (None, 0):
                    pytest.fail(f"rank {rank} died (exit code {proc.exitcode}) without a result")
            if time.monotonic() > deadline:
                pytest.fail(f"ranks {sorted(set(range(world_size)) - done)} did not finish "
                            "before the deadline (a hang: a collective nobody else joined?)")
            continue
        if status == "error":
            pytest.fail(f"rank {rank} failed:\n{text}")
        done.add(rank)
    return [torch.load(tmp_path / f"result-rank{rank}.pt", weights_only=False)
            for rank in range(world_size)]


def _rank_main(fn: Callable[..., Any], rank: int, world_size: int, store_path: str,
               out_dir: str, args: tuple, timeout_s: float, messages: Any) -> None:
    import torch.distributed as dist

    from kvgraph import distributed as tp

    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        store = dist.FileStore(store_path, world_size)
        # Every rank has started before the group's timeout counts: a test may give the group a
        # few seconds, and on a loaded machine one rank's start-up (importing torch) can lag
        # the other's by seconds. The store's own wait is 5 minutes, as `deadline_s`.
        store.set(f"started/{rank}", "1")
        store.wait([f"started/{peer}" for peer in range(world_size)])
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout_s))
        tp.init_tensor_parallel(timeout_s=timeout_s)
        result = fn(rank, *args)
        torch.save(result, Path(out_dir) / f"result-rank{rank}.pt")
        messages.put(("ok", rank, ""))
    except BaseException:  # noqa: BLE001 - the parent reports it
        messages.put(("error", rank, traceback.format_exc()))
        return
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - the result is already delivered
        pass
