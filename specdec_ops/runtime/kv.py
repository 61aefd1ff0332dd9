"""KV-block bookkeeping on the host: which request owns which cache block."""
from __future__ import annotations

from typing import Sequence

# Block 0 is the null block: no request owns it, and every write of a padded row or token lands there.
NULL_BLOCK = 0


class BlockPool:
    """A free list of KV-cache block ids; block 0 (the null block) is never handed out."""

    def __init__(self, num_blocks: int, seed: int | None = None):
        self.free = list(range(1, num_blocks))
        if seed is not None:  # hand blocks out in a shuffled order, as a long-running engine would
            import random

            random.Random(seed).shuffle(self.free)

    def allocate(self, count: int) -> list[int]:
        if count > len(self.free):
            raise ValueError(f"BlockPool: {count} blocks requested, {len(self.free)} free")
        blocks, self.free = self.free[:count], self.free[count:]
        return blocks

    def release(self, blocks: Sequence[int]) -> None:
        self.free.extend(blocks)
