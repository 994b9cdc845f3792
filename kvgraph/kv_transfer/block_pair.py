"""BlockPair: two processes' KV caches joined by a torch.distributed group of two, moving runs of
blocks from one cache into the other without a copy on either side.

Every tensor of every layer's tuple is `[num_blocks, ...]`, so a run of consecutive block ids is
one contiguous byte range: it is sent straight from the sender's cache and received straight
into the receiver's (gloo on the CPU; NCCL or HCCL where they run), with no staging buffer. A
transfer pairs the sender's block ids with the receiver's; both sides cut it into the same runs
(wherever either side's ids stop being consecutive) and exchange one message per run and tensor.
The two caches must have the same layout (compatibility.py checks it before a pair is used).

The group is the pair's own (a TCPStore the sender hosts, a process group of two of the caches'
device's backend: gloo, NCCL or HCCL), apart from any tensor-parallel group either process has.
NCCL and HCCL were not run here (no device in CI): their groups are made as torch's and
torch_npu's documentation say.
"""

from __future__ import annotations

import datetime
from typing import Sequence

import torch
import torch.distributed as dist

from kvgraph.kv_cache.spec import KVCache

SENDER, RECEIVER = "sender", "receiver"
# Tags of one transfer: its own base, then one per message, so messages never cross.
MESSAGES_PER_TAG = 2**20


def pair_group(device_type: str, store: dist.Store, rank: int, timeout: datetime.timedelta
               ) -> dist.ProcessGroup:
    """A process group of two on `store` for caches on `device_type`: gloo on the CPU, NCCL on
    CUDA, HCCL on Ascend (torch_npu adds `ProcessGroupHCCL` to torch.distributed)."""
    if device_type == "cpu":
        return dist.ProcessGroupGloo(store, rank, 2, timeout)
    if device_type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, 2, options)
    if device_type == "npu":
        return dist.ProcessGroupHCCL(store, rank, 2, timeout)
    raise ValueError(f"KV block pairs move caches on cpu, cuda or npu devices, not "
                     f"{device_type!r}")


def host_pair_store(host: str, timeout_s: float) -> dist.TCPStore:
    """A pair's store, hosted by its sender on a port the OS picks (read back as `.port`, for
    the offer): a port found free and bound later could be taken by another socket meanwhile
    (the pair's receiver then waited out its timeout)."""
    return dist.TCPStore(host, 0, 2, is_master=True,
                         timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False)


def paired_runs(src: Sequence[int], dst: Sequence[int]) -> list[tuple[int, int, int]]:
    """`(src_start, dst_start, length)` of each stretch in which both `src` and `dst` ids run
    consecutively, in order."""
    if len(src) != len(dst):
        raise ValueError(f"a transfer pairs each sent block with a received one: got "
                         f"{len(src)} source and {len(dst)} destination block ids")
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst):
        if runs and s == runs[-1][0] + runs[-1][2] and d == runs[-1][1] + runs[-1][2]:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    return runs


class BlockPair:
    """One side (`role`: SENDER or RECEIVER) of a pair of caches joined at `host:port` (a
    sender may bring the `store` it hosts there: host_pair_store)."""

    def __init__(self, kv_caches: dict[str, KVCache], host: str, port: int, role: str,
                 timeout_s: float = 60.0, store: dist.TCPStore | None = None):
        if role not in (SENDER, RECEIVER):
            raise ValueError(f"role: expected {SENDER!r} or {RECEIVER!r}, got {role!r}")
        self.role = role
        self.tensors = [t for _, cache in sorted(kv_caches.items()) for t in cache]
        # Each layer's tensors' numbers in `tensors`, for moving one layer's blocks (`post`).
        self.layer_tensors: dict[str, list[int]] = {}
        for name, cache in sorted(kv_caches.items()):
            first = sum(len(ids) for ids in self.layer_tensors.values())
            self.layer_tensors[name] = list(range(first, first + len(cache)))
        self.num_blocks = self.tensors[0].shape[0] if self.tensors else 0
        timeout = datetime.timedelta(seconds=timeout_s)
        rank = 0 if role == SENDER else 1
        self.peer = 1 - rank
        # The sender hosts the store: it is up first, as the one whose blocks are asked for.
        if store is None:
            store = dist.TCPStore(host, port, 2, is_master=role == SENDER, timeout=timeout)
        self.device = self.tensors[0].device if self.tensors else torch.device("cpu")
        self.group = pair_group(self.device.type, dist.PrefixStore("kvgraph-kv-pair", store),
                                rank, timeout)
        self.bytes_moved = 0

    def send(self, src_ids: Sequence[int], dst_ids: Sequence[int], tag: int = 0) -> None:
        """Send blocks `src_ids` of this cache to the receiver's `dst_ids`; returns when sent."""
        self.wait(self.post(src_ids, dst_ids, True, first_tag=tag * MESSAGES_PER_TAG))

    def recv(self, src_ids: Sequence[int], dst_ids: Sequence[int], tag: int = 0) -> None:
        """Receive the sender's blocks `src_ids` into this cache's `dst_ids`; returns when they
        are written."""
        self.wait(self.post(src_ids, dst_ids, False, first_tag=tag * MESSAGES_PER_TAG))

    def post(self, src_ids: Sequence[int], dst_ids: Sequence[int], sending: bool,
             tensors: Sequence[int] | None = None, first_tag: int = 0) -> list:
        """Start moving blocks `src_ids` into `dst_ids` of the tensors numbered `tensors` (all
        by default; `layer_tensors` numbers a layer's), one message per run and tensor, tagged
        `first_tag` on; returns their works, not waited for (`wait`), so the caller may go on
        computing while they move. Both sides must post the same ids, tensors and tags."""
        local = src_ids if sending else dst_ids
        bad = [b for b in local if not 0 <= b < self.num_blocks]
        if bad:
            raise ValueError(f"block ids {bad[:5]} are outside this cache's {self.num_blocks} "
                             "blocks")
        if not sending and len(set(dst_ids)) != len(dst_ids):
            raise ValueError("a block cannot receive twice in one transfer: destination ids "
                             f"{list(dst_ids)} repeat")
        chosen = [self.tensors[i] for i in tensors] if tensors is not None else self.tensors
        works, index = [], first_tag
        op = self.group.send if sending else self.group.recv
        for src, dst, length in paired_runs(src_ids, dst_ids):
            start = src if sending else dst
            for tensor in chosen:
                view = tensor[start:start + length]  # contiguous: the run's bytes in place
                works.append(op([view], self.peer, index))
                index += 1
                self.bytes_moved += view.numel() * view.element_size()
        return works

    def wait(self, works: Sequence) -> None:
        """Wait for works `post` started: the blocks are sent (may be overwritten) or written."""
        try:
            for work in works:
                work.wait()
            if self.device.type != "cpu":
                # A device backend's wait only orders this thread's stream after the transfer:
                # the blocks are whole (to be freed, or read by the model) once it has run.
                torch.accelerator.current_stream(self.device).synchronize()
        except RuntimeError as error:  # the peer died or timed out
            raise ConnectionError(f"KV block transfer with the {self._peer_role} failed: "
                                  f"{error}") from error

    @property
    def _peer_role(self) -> str:
        return RECEIVER if self.role == SENDER else SENDER

    def close(self) -> None:
        """Let go of the group (and the store the sender hosts)."""
        self.group = None
