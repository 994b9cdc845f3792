"""The step channel: messages from rank 0 to every other tensor-parallel rank, and each rank's
KV connector report back to rank 0.

Each message is a pickled `(kind, payload)`: `(STEP, (chunks, kv_connector_metadata))` for a
step to run, `(TRANSFER, kv_connector_metadata)` for a KV connector's loads and saves without a
forward, `(STOP, None)` to stop. See tp_runner.py for what the two ends do with them.
"""

from __future__ import annotations

import pickle
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from kvgraph.distributed import TensorParallelGroup

# Message kinds.
STEP, TRANSFER, STOP = "step", "transfer", "stop"
# How long a worker waits for rank 0's next message. A server may sit idle for days, so this
# is no deadline: a rank 0 that dies closes its sockets and the wait fails at once.
IDLE_TIMEOUT = timedelta(days=365)
# Bytes of a message that go in its first broadcast (a decode step of 64 requests of 57 blocks
# each takes ~11 KiB); a longer one (a long prefill's tokens) takes a second. The length
# before them takes LENGTH_BYTES.
MESSAGE_BYTES = 32 * 1024
LENGTH_BYTES = 8
# Bytes of a rank's report that go in the gather (a few request ids and block ids); a longer
# one sends the rest to rank 0 on its own.
REPORT_BYTES = 4 * 1024


class StepChannel:
    """Messages from rank 0 to every rank of the TP group: pickled, broadcast on gloo.

    One broadcast per message of up to MESSAGE_BYTES (the length goes in the same buffer as
    the bytes), a second for the rest of a longer one: a step's host overhead is one round
    trip, not torch's `broadcast_object_list`'s two. The group is gloo and its own, so a
    message never pairs with a model collective if ranks part ways, and its timeout is
    IDLE_TIMEOUT, so an idle worker waits as long as the server idles. Making it is
    collective: every rank makes it at the same point.

    Reports go back to rank 0 (`gather`) on a gloo group of their own, whose timeout is the TP
    group's: a rank that hangs after its step fails the gather instead of stalling rank 0.
    """

    def __init__(self, tp: TensorParallelGroup):
        ranks = dist.get_process_group_ranks(tp.group)
        self._ranks = ranks
        self._root = ranks[0]
        self._group = dist.new_group(ranks, backend="gloo", timeout=IDLE_TIMEOUT)
        self._reports = dist.new_group(ranks, backend="gloo",
                                       timeout=timedelta(seconds=tp.timeout_s))
        self.rank, self.world_size = tp.rank, tp.world_size
        self._buffer = torch.zeros(LENGTH_BYTES + MESSAGE_BYTES, dtype=torch.uint8)
        self._bytes = self._buffer.numpy()  # the same memory, written and read as bytes

    def send(self, kind: str, payload: Any = None) -> None:
        """Rank 0: broadcast one message to every other rank."""
        data = pickle.dumps((kind, payload), protocol=pickle.HIGHEST_PROTOCOL)
        first = min(len(data), MESSAGE_BYTES)
        self._bytes[:LENGTH_BYTES] = np.frombuffer(len(data).to_bytes(LENGTH_BYTES, "little"),
                                                   np.uint8)
        self._bytes[LENGTH_BYTES:LENGTH_BYTES + first] = np.frombuffer(data, np.uint8, first)
        self._broadcast(self._buffer)
        if len(data) > first:
            self._broadcast(torch.frombuffer(bytearray(data[first:]), dtype=torch.uint8))

    def receive(self) -> tuple[str, Any]:
        """A worker: the next message, `(kind, payload)`, once rank 0 sends it."""
        self._broadcast(self._buffer)
        length = int.from_bytes(self._bytes[:LENGTH_BYTES].tobytes(), "little")
        data = self._bytes[LENGTH_BYTES:LENGTH_BYTES + min(length, MESSAGE_BYTES)].tobytes()
        if length > MESSAGE_BYTES:
            rest = torch.empty(length - MESSAGE_BYTES, dtype=torch.uint8)
            self._broadcast(rest)
            data += rest.numpy().tobytes()
        return pickle.loads(data)

    def _broadcast(self, tensor: torch.Tensor) -> None:
        dist.broadcast(tensor, src=self._root, group=self._group)

    def gather(self, report: Any) -> list[Any] | None:
        """Every rank: send `report` to rank 0. Rank 0 gets each rank's, by rank (its own as
        it is); the others None. One gather of REPORT_BYTES from each rank, then the rest of
        any longer report, sent on its own."""
        buffer = torch.zeros(LENGTH_BYTES + REPORT_BYTES, dtype=torch.uint8)
        if self.rank == 0:
            gathered = [torch.empty_like(buffer) for _ in self._ranks]
            dist.gather(buffer, gathered, dst=self._root, group=self._reports)
            return [report, *(pickle.loads(self._whole(part, rank))
                              for part, rank in zip(gathered[1:], self._ranks[1:]))]
        data = pickle.dumps(report, protocol=pickle.HIGHEST_PROTOCOL)
        first = min(len(data), REPORT_BYTES)
        head = len(data).to_bytes(LENGTH_BYTES, "little") + data[:first]
        buffer[:len(head)] = torch.frombuffer(bytearray(head), dtype=torch.uint8)
        dist.gather(buffer, None, dst=self._root, group=self._reports)
        if len(data) > first:
            dist.send(torch.frombuffer(bytearray(data[first:]), dtype=torch.uint8),
                      dst=self._root, group=self._reports)
        return None

    def _whole(self, part: torch.Tensor, rank: int) -> bytes:
        """Rank 0: the bytes of `rank`'s gathered report, and the rest of a longer one."""
        head = part.numpy().tobytes()
        length = int.from_bytes(head[:LENGTH_BYTES], "little")
        data = head[LENGTH_BYTES:LENGTH_BYTES + min(length, REPORT_BYTES)]
        if length > REPORT_BYTES:
            rest = torch.empty(length - REPORT_BYTES, dtype=torch.uint8)
            dist.recv(rest, src=rank, group=self._reports)
            data += rest.numpy().tobytes()
        return data
