"""The tensor-parallel group: which ranks share a model's shards, and the collectives among them.

`torch.distributed` is the engine (NCCL on GPUs, HCCL on Ascend, gloo on the CPU). The group
is recorded once per process: `init_tensor_parallel(group)`, or, when nothing was recorded,
torch.distributed's default group (WORLD) once it is initialised; without torch.distributed a
process is tensor-parallel size 1 and every collective here is the identity.

    from kvgraph import distributed as tp
    tp.init_tensor_parallel()                 # after torch.distributed.init_process_group
    y = tp.all_reduce(x)                       # in a row-parallel linear's forward

The collectives are torch's functional collectives: Dynamo traces them into
`_c10d_functional.<op>` + `wait_tensor`, with the group's name as a string constant, and kvgraph
keeps both inside pieces and full graphs (never split apart, never dropped by a pass), so a
captured graph replays them. `all_reduce` is the one seam for another implementation later
(vLLM wraps its all-reduce in an op of its own to choose, at run time, between NCCL and a
custom one-shot kernel): models call it, never torch's collectives directly.

kvgraph's own agreement checks (see kvgraph/runtime/rank_agreement.py) run on a gloo group of
their own over the same ranks, created with `timeout_s`, so a rank that fails or diverges is
reported, never waited on forever.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from kvgraph.errors import ConfigError, GraphError

logger = logging.getLogger(__name__)

# The first NCCL whose collectives a CUDA graph can capture: with older ones the capture may
# succeed and the replay hang.
MIN_CAPTURABLE_NCCL = (2, 9, 6)
# Seconds kvgraph's own collectives (agreement checks) wait for a peer before failing.
DEFAULT_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class TensorParallelGroup:
    """The ranks one model is sharded over: this process's `rank` among `world_size`.

    `group` is None at size 1 (no torch.distributed). `cpu_group` is a gloo group over the same
    ranks for kvgraph's host-side checks, made on first use: making a group is itself
    collective, so every rank of torch.distributed's default group asks for it at the same
    point (a ModelRunner does, when it is built).
    """

    group: dist.ProcessGroup | None
    rank: int = 0
    world_size: int = 1
    timeout_s: float = DEFAULT_TIMEOUT_S
    _cpu_group: list = field(default_factory=list, repr=False, compare=False)

    @property
    def cpu_group(self) -> dist.ProcessGroup | None:
        """A gloo group of its own over the TP ranks (None at size 1), for kvgraph's host-side
        exchanges: never the TP group itself, so an exchange cannot be mistaken for a model
        collective by a rank that is one step behind."""
        if self.group is None:
            return None
        if not self._cpu_group:
            ranks = dist.get_process_group_ranks(self.group)
            self._cpu_group.append(dist.new_group(
                ranks, backend="gloo", timeout=timedelta(seconds=self.timeout_s)))
        return self._cpu_group[0]

    @property
    def backend(self) -> str | None:
        """The group's torch.distributed backend ("nccl", "hccl", "gloo"), None at size 1."""
        return None if self.group is None else str(dist.get_backend(self.group))

    def check_capturable(self) -> None:
        """Raise GraphError if the group's collectives cannot be captured in a device graph."""
        if self.backend != "nccl":
            return
        version = tuple(torch.cuda.nccl.version())
        if version < MIN_CAPTURABLE_NCCL:
            raise GraphError(
                f"NCCL {'.'.join(map(str, version))} cannot be captured in CUDA graphs (a "
                f"captured collective may hang on replay); NCCL >= "
                f"{'.'.join(map(str, MIN_CAPTURABLE_NCCL))} is needed, or graph_mode='none'")

    def describe(self) -> str:
        return (f"rank {self.rank} of {self.world_size}" +
                (f" ({self.backend})" if self.group is not None else ""))


# The dim-0 forms (`*_tensor` is their deprecated name in newer torch).
_all_gather_dim0 = getattr(funcol, "all_gather_single", funcol.all_gather_tensor)
_reduce_scatter_dim0 = getattr(funcol, "reduce_scatter_single", funcol.reduce_scatter_tensor)

_SINGLE = TensorParallelGroup(None)
_recorded: list[TensorParallelGroup] = []  # at most one: the process's TP group


def init_tensor_parallel(group: dist.ProcessGroup | None = None, *,
                         timeout_s: float = DEFAULT_TIMEOUT_S) -> TensorParallelGroup:
    """Record the process's tensor-parallel group (default: WORLD); once per process.

    torch.distributed must be initialised first. Recording the same group again returns it;
    another group is a ConfigError (models, runners and compiled graphs already use the first).
    """
    if not dist.is_available() or not dist.is_initialized():
        raise ConfigError("tensor_parallel", "init_tensor_parallel needs torch.distributed "
                          "initialised first (torch.distributed.init_process_group); without "
                          "it a process runs tensor-parallel size 1 and needs no call")
    if not timeout_s > 0:
        raise ConfigError("tensor_parallel", f"timeout_s must be > 0, got {timeout_s!r}")
    group = group or dist.group.WORLD
    _forget_destroyed()
    if _recorded:
        if _recorded[0].group is not group:
            raise ConfigError("tensor_parallel", "a tensor-parallel group was already recorded "
                              f"in this process ({_recorded[0].describe()}); it is recorded "
                              "once, before any model is sharded or compiled")
        return _recorded[0]
    tp = TensorParallelGroup(group, dist.get_rank(group), dist.get_world_size(group), timeout_s)
    _recorded.append(tp)
    logger.info("kvgraph: tensor parallelism over %s", tp.describe())
    return tp


def tensor_parallel_group() -> TensorParallelGroup:
    """The process's TP group: the recorded one, else WORLD once torch.distributed is
    initialised (recorded then), else size 1. A group recorded before `destroy_process_group`
    is forgotten."""
    _forget_destroyed()
    if _recorded:
        return _recorded[0]
    initialised = dist.is_available() and dist.is_initialized()
    return init_tensor_parallel() if initialised else _SINGLE


def _forget_destroyed() -> None:
    """Forget a recorded group that `destroy_process_group` has ended."""
    if _recorded and not (dist.is_initialized()
                          and _recorded[0].group in dist.distributed_c10d._world.pg_map):
        _recorded.clear()


def reset_tensor_parallel() -> None:
    """Forget the recorded group (after `destroy_process_group`; for tests and tools)."""
    _recorded.clear()


def tp_rank() -> int:
    """This process's rank in the TP group (0 at size 1)."""
    return tensor_parallel_group().rank


def tp_world_size() -> int:
    """The TP group's size (1 without torch.distributed)."""
    return tensor_parallel_group().world_size


def _group(group: TensorParallelGroup | None) -> TensorParallelGroup:
    return group or tensor_parallel_group()


def all_reduce(x: torch.Tensor, group: TensorParallelGroup | None = None) -> torch.Tensor:
    """The sum of `x` over the TP ranks (a new tensor); `x` itself at size 1.

    The seam for a run-time choice of all-reduce implementation: everything kvgraph's example
    models reduce goes through here.
    """
    tp = _group(group)
    if tp.world_size == 1:
        return x
    return funcol.all_reduce(x, "sum", tp.group)


def all_gather(x: torch.Tensor, dim: int = -1, group: TensorParallelGroup | None = None
               ) -> torch.Tensor:
    """Every rank's `x` concatenated along `dim`, in rank order; `x` itself at size 1."""
    tp = _group(group)
    if tp.world_size == 1:
        return x
    dim = dim % x.dim()
    # Gathered along dim 0 (each rank's block whole), then that dim moved back into place.
    gathered = _all_gather_dim0(x.movedim(dim, 0).contiguous(), 0, tp.group)
    return gathered.movedim(0, dim)


def reduce_scatter(x: torch.Tensor, dim: int = 0, group: TensorParallelGroup | None = None
                   ) -> torch.Tensor:
    """The sum of `x` over the ranks, split along `dim` into world-size parts; this rank's
    part. `dim`'s size must divide by the world size. `x` itself at size 1."""
    tp = _group(group)
    if tp.world_size == 1:
        return x
    dim = dim % x.dim()
    if x.shape[dim] % tp.world_size:
        raise ValueError(f"reduce_scatter: dim {dim} of shape {tuple(x.shape)} does not divide "
                         f"by the tensor-parallel size {tp.world_size}")
    moved = x.movedim(dim, 0).contiguous()
    return _reduce_scatter_dim0(moved, "sum", 0, tp.group).movedim(0, dim)
