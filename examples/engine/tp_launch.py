"""Where each tensor-parallel rank finds the others, and how it joins them.

Two launches, one group:

- spawned (`--tensor-parallel-size N` alone): the process the user started is rank 0. It makes
  a `FileStore` in a fresh temp dir (no port to pick or collide on) and spawns ranks 1..N-1
  (see tp_workers.py), each given the store's path.
- torchrun (RANK, WORLD_SIZE and MASTER_ADDR in the environment): every process runs the
  script; the rendezvous is torchrun's (`env://`). Rank 0 serves, the others follow it.

Each rank then initialises torch.distributed with its platform's backend (gloo on the CPU, nccl
on CUDA, hccl on Ascend; the step broadcast is gloo everywhere) and a timeout, records it as
kvgraph's tensor-parallel group and takes its platform's device for its rank
(`cuda:<local rank>` for `--device cuda`); its build then takes its share of the node's cores
as compute threads (threads.py, with `ranks_on_node`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from kvgraph import distributed as kvgraph_tp
from kvgraph.runtime.platforms import get_platform

# What torchrun (torch.distributed.run) sets in every process it starts.
TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR")
# The store key a spawned rank sets just before it initialises torch.distributed.
JOINING_KEY = "kvgraph/joining/{rank}"


@dataclass(frozen=True)
class Rendezvous:
    """One rank's place: `rank` of `world_size`, `local_rank` of `local_world_size` on its
    node; `store_path` is the spawned launch's FileStore, None under torchrun (`env://`)."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    store_path: str | None = None

    def with_rank(self, rank: int) -> Rendezvous:
        """The same rendezvous for spawned rank `rank` (one node: local rank = rank)."""
        return Rendezvous(rank, self.world_size, rank, self.world_size, self.store_path)


def torchrun_rendezvous() -> Rendezvous | None:
    """This process's place under torchrun; None when it was not started by torchrun."""
    if not all(name in os.environ for name in TORCHRUN_VARIABLES):
        return None
    world_size = int(os.environ["WORLD_SIZE"])
    return Rendezvous(int(os.environ["RANK"]), world_size,
                      int(os.environ.get("LOCAL_RANK", os.environ["RANK"])),
                      int(os.environ.get("LOCAL_WORLD_SIZE", world_size)))


def tensor_parallel_size(requested: int | None) -> int:
    """The TP size: `--tensor-parallel-size`, else torchrun's WORLD_SIZE, else 1.

    Under torchrun every process is one rank of the one model, so a flag that disagrees with
    WORLD_SIZE is refused rather than serving two half-models.
    """
    launched = torchrun_rendezvous()
    if launched is None:
        return requested or 1
    if requested is not None and requested != launched.world_size:
        raise ValueError(f"--tensor-parallel-size {requested} does not match torchrun's "
                         f"WORLD_SIZE={launched.world_size}; give the same size to both (or "
                         "leave the flag out under torchrun)")
    return launched.world_size


def rank_device(device: str, rendezvous: Rendezvous) -> str:
    """The device this rank runs on, its platform's for its local rank (`<type>:<local rank>`
    for an accelerator; the CPU, which the ranks share)."""
    platform = get_platform(device)
    shared = platform.rank_device(0) == platform.rank_device(1)  # the CPU: every rank's
    if ":" in device and not shared:
        raise ValueError(f"--device {device} names one device, but {rendezvous.world_size} "
                         f"tensor-parallel ranks need one each; give --device {platform.name} "
                         f"and rank r runs on {platform.name}:<local rank r>")
    return platform.rank_device(rendezvous.local_rank)


def join_group(rendezvous: Rendezvous, device: str, timeout_s: float,
               store: dist.Store | None = None) -> kvgraph_tp.TensorParallelGroup:
    """Initialise torch.distributed for this rank and record kvgraph's TP group.

    Every collective on the group (the model's, kvgraph's agreement checks) fails after
    `timeout_s` instead of waiting forever on a rank that is gone. A spawned rank says it is
    joining (JOINING_KEY) first, so rank 0 can tell a rank that died before it from a slow one.
    """
    platform = get_platform(device)  # loads torch_npu for "npu", which registers hccl
    platform.set_device(rendezvous.local_rank)
    timeout = timedelta(seconds=timeout_s)
    if rendezvous.store_path is None:
        dist.init_process_group(platform.distributed_backend, init_method="env://",
                                timeout=timeout)
    else:
        store = store or dist.FileStore(rendezvous.store_path, rendezvous.world_size)
        store.set(JOINING_KEY.format(rank=rendezvous.rank), "1")
        dist.init_process_group(platform.distributed_backend, store=store, rank=rendezvous.rank,
                                world_size=rendezvous.world_size, timeout=timeout)
    tp = kvgraph_tp.init_tensor_parallel(timeout_s=timeout_s)
    # Made now, while every rank is there: making a group waits on the store, which does not
    # notice a rank that died (a collective on a made group does, at once).
    tp.cpu_group
    return tp


def ranks_on_node(world_size: int) -> int:
    """How many of the `world_size` ranks share this node's cores: torchrun's
    LOCAL_WORLD_SIZE, or all of them when this process spawned them."""
    launched = torchrun_rendezvous()
    return world_size if launched is None else launched.local_world_size


def leave_group() -> None:
    """Tear down torch.distributed and forget kvgraph's TP group (a later engine may start
    afresh in this process)."""
    if dist.is_initialized():
        dist.destroy_process_group()
    kvgraph_tp.reset_tensor_parallel()
