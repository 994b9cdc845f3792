"""BlockAllocator: the free list of KV cache blocks, handed out all-or-nothing."""

from __future__ import annotations

from typing import Iterable


def blocks_for(num_tokens: int, block_size: int) -> int:
    """How many blocks of `block_size` slots hold `num_tokens` tokens."""
    return -(-num_tokens // block_size)


class BlockAllocator:
    """Owns which of `num_blocks` cache blocks are free; a block is held by one request at most.

    `allocate` gives all the blocks asked for or none (a request never holds half of what its
    next chunk needs). Freeing a block that is not held is a bug elsewhere: it raises rather
    than let two requests share the block's cache slots.
    """

    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        # Popped from the end: the lowest ids go first, and recently freed ones are reused first.
        self._free = list(range(num_blocks - 1, -1, -1))
        self._held: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, count: int) -> list[int] | None:
        """`count` free blocks, now held by the caller; None (nothing taken) if too few are free."""
        if count > len(self._free):
            return None
        blocks = [self._free.pop() for _ in range(count)]
        self._held.update(blocks)
        return blocks

    def free(self, blocks: Iterable[int]) -> None:
        """Return held blocks to the free list."""
        blocks = list(blocks)
        not_held = [b for b in blocks if b not in self._held] + _duplicates(blocks)
        if not_held:
            raise ValueError(f"freeing blocks that are not held: {sorted(set(not_held))}")
        self._held.difference_update(blocks)
        self._free.extend(reversed(blocks))


def _duplicates(blocks: list[int]) -> list[int]:
    seen: set[int] = set()
    return [b for b in blocks if b in seen or seen.add(b)]
