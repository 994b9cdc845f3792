"""One side of a BlockPair, in a process of its own: `python -m tests.support.kv_pair_worker
ROLE PORT KIND SRC DST [DIE_AFTER]` (ids comma-separated). Both sides fill their caches from
seeds of their own; the receiver prints, as JSON, whether each received block equals the
sender's (recomputed from the sender's seed) and whether every message was received straight
into its cache. With DIE_AFTER the sender sends only its first DIE_AFTER blocks, then dies
mid-transfer; the receiver then prints the error its receive raised and how long it took."""

from __future__ import annotations

import json
import os
import sys
import time

import torch

from kvgraph.kv_transfer.block_pair import SENDER, BlockPair

NUM_BLOCKS = 16


def caches(kind: str, seed: int, dtype=torch.float32) -> dict:
    """A model's caches as kvgraph allocates them: standard (key, value) or MLA (kv_c, k_pe)."""
    generator = torch.Generator().manual_seed(seed)
    shapes = [(4, 2, 8), (4, 2, 8)] if kind == "standard" else [(4, 32), (4, 8)]
    return {f"model.layers.{i}.attn": tuple(
        torch.randn(NUM_BLOCKS, *shape, generator=generator).to(dtype) for shape in shapes)
        for i in range(3)}


class RecordingGroup:
    """The pair's group, recording each tensor a message is received into."""

    def __init__(self, group):
        self.group, self.received = group, []

    def send(self, tensors, peer, tag):
        return self.group.send(tensors, peer, tag)

    def recv(self, tensors, peer, tag):
        self.received += tensors
        return self.group.recv(tensors, peer, tag)


def main(role: str, port: int, kind: str, src: list[int], dst: list[int],
         die_after: int | None = None) -> None:
    mine = caches(kind, seed=1 if role == SENDER else 2)
    pair = BlockPair(mine, "127.0.0.1", port, role, timeout_s=60)
    if role == SENDER:
        pair.send(src[:die_after], dst[:die_after], tag=3)
        if die_after is not None:
            os._exit(3)  # gone mid-transfer, as a killed prefill server is
        return
    before = {name: tuple(t.clone() for t in cache) for name, cache in mine.items()}
    pair.group = RecordingGroup(pair.group)
    if die_after is not None:
        start = time.monotonic()
        try:
            pair.recv(src, dst, tag=3)
        except ConnectionError as error:
            print(json.dumps({"error": str(error), "seconds": time.monotonic() - start}))
        return
    pair.recv(src, dst, tag=3)
    sent = caches(kind, seed=1)
    untouched = [b for b in range(NUM_BLOCKS) if b not in dst]
    in_place = {t.untyped_storage().data_ptr() for t in pair.group.received} <= {
        t.untyped_storage().data_ptr() for cache in mine.values() for t in cache}
    print(json.dumps({
        "equal": all(torch.equal(mine[n][i][d], sent[n][i][s]) for n in mine
                     for i in range(len(mine[n])) for s, d in zip(src, dst)),
        "untouched": all(torch.equal(mine[n][i][untouched], before[n][i][untouched])
                         for n in mine for i in range(len(mine[n]))),
        "in_place": in_place, "messages": len(pair.group.received),
        "bytes": pair.bytes_moved}))


if __name__ == "__main__":
    ids = [[int(b) for b in arg.split(",")] for arg in sys.argv[4:6]]
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3], *ids,
         *(int(arg) for arg in sys.argv[6:7]))
