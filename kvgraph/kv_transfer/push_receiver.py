"""The decode engine's end of a layer-by-layer push (layer_push.py): receiving what P pushes
straight into this cache's blocks, one side-channel message per layer and run."""

from __future__ import annotations

import socket
from typing import Any

from kvgraph.kv_cache.spec import KVCache
from kvgraph.kv_transfer.block_pair import RECEIVER, BlockPair
from kvgraph.kv_transfer.side_channel import recv_message


def receive_pushed_blocks(conn: socket.socket, offer: dict[str, Any] | None,
                          kv_caches: dict[str, KVCache], dst: list[int], timeout_s: float
                          ) -> None:
    """Receive P's pushes into blocks `dst` of every layer, over a pair joined at `offer`,
    until P says done; a ConnectionError when P fails, says something else or leaves a layer
    short. Each message names the layer, blocks and first tag of the sends that follow it, so
    only receives P announced are posted, and they have landed when this returns or raises."""
    pair = BlockPair(kv_caches, offer["host"], offer["port"], RECEIVER, timeout_s) if dst else None
    works: list = []
    try:
        received: dict[str, set[int]] = {layer: set() for layer in kv_caches}
        while "done" not in (message := recv_message(conn)):
            if "error" in message:
                raise ConnectionError(message["error"])
            layer, ids = message["layer"], message["dst"]
            if pair is None or layer not in received or not set(ids) <= set(dst) - received[layer]:
                raise ConnectionError(f"P pushes blocks {ids} of layer {layer!r}: expected some "
                                      f"of {dst} of this cache's layers, each once")
            received[layer] |= set(ids)
            works += pair.post(message["src"], ids, False, pair.layer_tensors[layer],
                               message["tag"])
        works, waited = [], works
        if pair is not None:
            pair.wait(waited)
        short = [layer for layer, ids in received.items() if ids != set(dst)]
        if short:
            raise ConnectionError(f"P said done with layers {short[:3]} short of blocks {dst}")
    finally:
        try:  # let announced receives land before the blocks are computed into
            if works:
                pair.wait(works)
        except ConnectionError:
            pass
        if pair is not None:
            pair.close()
