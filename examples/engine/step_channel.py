"""The step channel: messages from rank 0 to every other tensor-parallel rank.

Each message is a pickled `(kind, payload)`: `(STEP, chunks)` for a step to run, `(STOP,
None)` to stop. See tp_runner.py for what the two ends do with them.
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
STEP, STOP = "step", "stop"
# How long a worker waits for rank 0's next message. A server may sit idle for days, so this
# is no deadline: a rank 0 that dies closes its sockets and the wait fails at once.
IDLE_TIMEOUT = timedelta(days=365)
# Bytes of a message that go in its first broadcast (a decode step of 64 requests of 57 blocks
# each takes ~11 KiB); a longer one (a long prefill's tokens) takes a second. The length
# before them takes LENGTH_BYTES.
MESSAGE_BYTES = 32 * 1024
LENGTH_BYTES = 8


class StepChannel:
    """Messages from rank 0 to every rank of the TP group: pickled, broadcast on gloo.

    One broadcast per message of up to MESSAGE_BYTES (the length goes in the same buffer as
    the bytes), a second for the rest of a longer one: a step's host overhead is one round
    trip, not torch's `broadcast_object_list`'s two. The group is gloo and its own, so a
    message never pairs with a model collective if ranks part ways, and its timeout is
    IDLE_TIMEOUT, so an idle worker waits as long as the server idles. Making it is
    collective: every rank makes it at the same point.
    """

    def __init__(self, tp: TensorParallelGroup):
        ranks = dist.get_process_group_ranks(tp.group)
        self._root = ranks[0]
        self._group = dist.new_group(ranks, backend="gloo", timeout=IDLE_TIMEOUT)
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
