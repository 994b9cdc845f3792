"""Chain hashes of full token blocks: the name of a block's whole prefix, for prefix caching and
for KV connectors that store or look up blocks by content."""

from __future__ import annotations

import hashlib
from array import array
from typing import Sequence

# A chain hash: a digest, not Python's `hash`, whose collisions (hash(-1) == hash(-2)) are easy
# to make, and would hand one prompt another prompt's keys and values.
BlockHash = bytes


def chain_hashes(token_ids: Sequence[int], block_size: int,
                 known: Sequence[BlockHash] = ()) -> list[BlockHash]:
    """The chain hash of every full block of `token_ids` (the hash of its parent block's hash and
    its own tokens); `known` are its first ones, already computed."""
    hashes = list(known)
    parent = hashes[-1] if hashes else b""
    for start in range(len(hashes) * block_size, len(token_ids) - block_size + 1, block_size):
        tokens = array("q", token_ids[start:start + block_size]).tobytes()
        parent = hashlib.sha256(parent + tokens).digest()
        hashes.append(parent)
    return hashes
