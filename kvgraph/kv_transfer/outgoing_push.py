"""OutgoingPush: what a pushing prefill engine (layer_push.py) knows of one transfer: how much of
the prompt each layer has written, where the decode engine wants it, and what was sent."""

from __future__ import annotations

import socket
import threading
from typing import Sequence

from kvgraph.kv_transfer.block_pair import BlockPair


class OutgoingPush:
    """P: one transfer's prompt as it is computed (`written` blocks per layer) and, once D
    registered, where D wants it and what was sent."""

    def __init__(self, transfer_id: str, deadline: float):
        self.transfer_id, self.deadline = transfer_id, deadline
        self.request_id: str | None = None
        self.block_ids: tuple[int, ...] = ()
        self.written: dict[str, int] = {}
        self.prompt_done = False
        self.registered = False
        self.conn: socket.socket | None = None
        self.pair: BlockPair | None = None
        self.first_block, self.dst = 0, []
        self.sent: dict[str, int] = {}
        self.tag = 0
        self.works: list = []
        self.finished = threading.Event()
        self.ok, self.error = False, ""

    def unsent(self, layer: str) -> tuple[list[int], list[int]]:
        """P's and D's ids of `layer`'s blocks written and wanted but not yet sent."""
        start = self.sent.get(layer, self.first_block)
        end = min(self.written.get(layer, 0), self.first_block + len(self.dst))
        if end <= start:
            return [], []
        return (list(self.block_ids[start:end]),
                self.dst[start - self.first_block:end - self.first_block])

    def complete(self, layers: Sequence[str]) -> bool:
        wanted = self.first_block + len(self.dst)
        return self.registered and (not self.dst or self.prompt_done and all(
            self.sent.get(layer, self.first_block) >= wanted for layer in layers))
