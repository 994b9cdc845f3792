"""BlockAllocator: the KV cache blocks, handed out all-or-nothing, and the prefix cache over them.

Prefix caching: a full block whose tokens are computed is registered under its chain hash (the
hash of its parent block's hash and its own tokens, so it names the whole prefix up to it). A
later request whose prompt starts with the same blocks shares them instead of computing them
again. A shared block is full, so no request writes it again; it is held by reference count.
A freed block with a hash stays cached, and reusable, until an allocation needs it back.
"""

from __future__ import annotations

import collections
from typing import Iterable, Sequence

from kvgraph.kv_transfer.block_hashes import BlockHash


def blocks_for(num_tokens: int, block_size: int) -> int:
    """How many blocks of `block_size` slots hold `num_tokens` tokens."""
    return -(-num_tokens // block_size)


class BlockAllocator:
    """Owns which of `num_blocks` cache blocks are free, held (and by how many) or cached.

    `allocate` gives all the fresh blocks asked for or none (a request never holds half of what
    its next chunk needs), taking never-cached free blocks first and then evicting the least
    recently freed cached ones. `share` holds cached blocks once more. Freeing a block that is
    not held is a bug elsewhere: it raises rather than let two requests write one block.
    `enable_prefix_caching=False` keeps every block to one request: nothing is cached.
    """

    def __init__(self, num_blocks: int, enable_prefix_caching: bool = True):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        # Popped from the end: the lowest ids go first, and recently freed ones are reused first.
        self._free = list(range(num_blocks - 1, -1, -1))
        # Free blocks with a hash, least recently freed first: the order they are evicted in.
        self._cached_free: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._refs: dict[int, int] = {}  # held block -> how many requests hold it
        self._hash_of: dict[int, BlockHash] = {}
        self._block_of: dict[BlockHash, int] = {}
        self.num_evictions = 0

    @property
    def num_free(self) -> int:
        """Blocks no request holds, cached ones included (an allocation may evict them)."""
        return len(self._free) + len(self._cached_free)

    @property
    def num_cached(self) -> int:
        """Blocks registered in the prefix cache, held or free."""
        return len(self._block_of)

    def is_shared(self, block: int) -> bool:
        """Whether more than one request holds `block` (a prefix cache hit's)."""
        return self._refs.get(block, 0) > 1

    def allocate(self, count: int) -> list[int] | None:
        """`count` fresh blocks, now held by the caller; None (nothing taken) if too few free."""
        if count > self.num_free:
            return None
        blocks = [self._free.pop() if self._free else self._evict() for _ in range(count)]
        self._refs.update(dict.fromkeys(blocks, 1))
        return blocks

    def share(self, hashes: Sequence[BlockHash]) -> list[int]:
        """The cached blocks of the longest cached run of `hashes` from the first, now held."""
        blocks = []
        for block_hash in hashes:
            block = self._block_of.get(block_hash)
            if block is None:
                break
            self._cached_free.pop(block, None)
            self._refs[block] = self._refs.get(block, 0) + 1
            blocks.append(block)
        return blocks

    def register(self, block: int, block_hash: BlockHash) -> None:
        """Cache held, full, computed `block` under `block_hash`.

        Not when caching is off, nor when another block has the hash: that one stays, as
        requests may be sharing it.
        """
        assert block in self._refs, f"registering block {block}, which is not held"
        if self.enable_prefix_caching and block_hash not in self._block_of:
            self._hash_of[block] = block_hash
            self._block_of[block_hash] = block

    def free(self, blocks: Iterable[int]) -> None:
        """Release one hold on each of `blocks`; a block no request holds any more is free."""
        blocks = list(blocks)
        not_held = [b for b in blocks if b not in self._refs] + _duplicates(blocks)
        if not_held:
            raise ValueError(f"freeing blocks that are not held: {sorted(set(not_held))}")
        for block in reversed(blocks):  # a request's last blocks are evicted first
            self._refs[block] -= 1
            if self._refs[block] == 0:
                del self._refs[block]
                self._release(block)

    def stats(self) -> dict[str, int]:
        """The prefix cache's size and how many cached blocks allocations took back."""
        return {"prefix_cache_blocks": self.num_cached,
                "prefix_cache_evictions": self.num_evictions}

    def _release(self, block: int) -> None:
        if block in self._hash_of:
            self._cached_free[block] = None
        else:
            self._free.append(block)

    def _evict(self) -> int:
        """The least recently freed cached block, its hash forgotten."""
        block, _ = self._cached_free.popitem(last=False)
        del self._block_of[self._hash_of.pop(block)]
        self.num_evictions += 1
        return block


def _duplicates(blocks: list[int]) -> list[int]:
    seen: set[int] = set()
    return [b for b in blocks if b in seen or seen.add(b)]
