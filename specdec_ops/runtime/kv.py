"""KV-block bookkeeping on the host: which request owns which cache block, and each slot's block-table row.

Two guards keep one request's KV from aliasing another's:

- `BlockPool` hands out block ids 1..num_blocks-1 (block 0, the null block, never) and records the owner of every
  allocated block; releasing a block twice, a block outside the pool or the null block raises.
- `BlockTable` holds the device tensor of block-table rows ([num_slots + 1, blocks_per_req] int32; the last row is
  the spare slot that padded rows map to, always null) and refuses a block id outside the pool, the null block, a
  block that another slot holds, and a slot outside the table. A slot's row is replaced as a whole, so a slot
  that gets new blocks gives up its old ones in the same call.

Both raise ValueError naming the argument and what was expected. They run on the host, outside every captured
graph; the kernels still clamp every block id into the cache, so even a wrong table cannot address memory out of
bounds, but with these checks no request can write another's blocks.
"""
from __future__ import annotations

import random
from typing import Hashable, Sequence

import torch

# Block 0 is the null block: no request owns it, and every write of a padded row or token lands there.
NULL_BLOCK = 0


def _block_ids(where: str, blocks: Sequence[int], num_blocks: int) -> list[int]:
    """The block ids as Python ints, each checked to lie in [1, num_blocks)."""
    ids = []
    for index, block in enumerate(blocks):
        if isinstance(block, torch.Tensor):
            block = block.item() if block.numel() == 1 and not block.is_floating_point() else block
        if isinstance(block, bool) or not isinstance(block, int):
            raise ValueError(f"{where}: blocks[{index}] must be an int block id, got {block!r}")
        if block == NULL_BLOCK:
            raise ValueError(f"{where}: blocks[{index}] is the null block {NULL_BLOCK}, which no request owns")
        if not 0 < block < num_blocks:
            raise ValueError(f"{where}: blocks[{index}] = {block} lies outside the pool's block ids "
                             f"[1, {num_blocks})")
        ids.append(block)
    if len(set(ids)) != len(ids):
        raise ValueError(f"{where}: blocks {ids} name a block more than once")
    return ids


class BlockPool:
    """A free list of KV-cache block ids 1..num_blocks-1 with the owner of every allocated block.

    Args:
        num_blocks: blocks in the cache, the null block included (>= 1).
        seed: when given, blocks are handed out in an order shuffled by this seed (as a long-running engine's
            would be), which tests use to catch code that assumes contiguous blocks.
    """

    def __init__(self, num_blocks: int, seed: int | None = None):
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"BlockPool: num_blocks must be an int >= 1 (the null block included), "
                             f"got {num_blocks!r}")
        self.num_blocks = num_blocks
        self.free = list(range(1, num_blocks))
        if seed is not None:
            random.Random(seed).shuffle(self.free)
        self.owners: dict[int, Hashable] = {}  # allocated block -> its owner (None when not given)

    @property
    def num_free(self) -> int:
        return len(self.free)

    def allocate(self, count: int, owner: Hashable = None) -> list[int]:
        """Takes `count` free blocks for `owner` (any hashable, e.g. a request slot) and returns their ids."""
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError(f"BlockPool.allocate: count must be an int >= 0, got {count!r}")
        if count > len(self.free):
            raise ValueError(f"BlockPool: {count} blocks requested, {len(self.free)} free")
        blocks, self.free = self.free[:count], self.free[count:]
        for block in blocks:
            self.owners[block] = owner
        return blocks

    def owner(self, block: int) -> Hashable:
        """The owner that allocated `block`; ValueError when the block is free."""
        if block not in self.owners:
            raise ValueError(f"BlockPool.owner: block {block} is not allocated")
        return self.owners[block]

    def release(self, blocks: Sequence[int]) -> None:
        """Gives allocated blocks back; a free block, the null block or an id outside the pool is refused.

        Nothing is released when any block is refused.
        """
        ids = _block_ids("BlockPool.release", blocks, self.num_blocks)
        for index, block in enumerate(ids):
            if block not in self.owners:
                raise ValueError(f"BlockPool.release: blocks[{index}] = {block} is not allocated (released twice, "
                                 f"or never handed out)")
        for block in ids:
            del self.owners[block]
        self.free.extend(ids)


class BlockTable:
    """Block-table rows of request slots on the device, with the slot that holds each block.

    Args:
        num_slots: request slots; the tensor has one more row, the spare slot of padded rows (always null).
        blocks_per_req: columns, the blocks one request can hold (ceil(max_model_len / block_size)).
        num_blocks: blocks in the cache, the null block included.
        device: where the table lives.

    ``tensor`` is [num_slots + 1, blocks_per_req] int32; captured graphs read it, so it is updated in place.
    """

    def __init__(self, num_slots: int, blocks_per_req: int, num_blocks: int, device: torch.device | str):
        self.num_slots = num_slots
        self.blocks_per_req = blocks_per_req
        self.num_blocks = num_blocks
        self.tensor = torch.zeros(num_slots + 1, blocks_per_req, dtype=torch.int32, device=device)
        self.holder: dict[int, int] = {}  # block -> slot whose row holds it
        self.rows: dict[int, list[int]] = {}  # slot -> its blocks

    def _check_slot(self, where: str, slot) -> int:
        if isinstance(slot, torch.Tensor) and slot.numel() == 1 and not slot.is_floating_point():
            slot = slot.item()
        if isinstance(slot, bool) or not isinstance(slot, int) or not 0 <= slot < self.num_slots:
            raise ValueError(f"{where}: slot must lie in [0, {self.num_slots}) and be an int, got {slot!r}")
        return slot

    def assign(self, slot: int, blocks: Sequence[int], where: str = "BlockTable.assign") -> None:
        """Gives `slot` the blocks `blocks` in position order (the rest of its row is null), in place of its old ones.

        Refused: a slot outside [0, num_slots), more than blocks_per_req blocks, an id outside [1, num_blocks)
        or repeated, and a block that another slot holds.
        """
        slot = self._check_slot(where, slot)
        if len(blocks) > self.blocks_per_req:
            raise ValueError(f"{where}: {len(blocks)} blocks given, a request holds at most "
                             f"blocks_per_req = {self.blocks_per_req}")
        ids = _block_ids(where, blocks, self.num_blocks)
        for index, block in enumerate(ids):
            other = self.holder.get(block)
            if other is not None and other != slot:
                raise ValueError(f"{where}: blocks[{index}] = {block} belongs to slot {other}, not to slot {slot}")
        self.clear(slot)
        for block in ids:
            self.holder[block] = slot
        self.rows[slot] = ids
        row = torch.full((self.blocks_per_req,), NULL_BLOCK, dtype=torch.int32)
        row[: len(ids)] = torch.tensor(ids, dtype=torch.int32)
        # A pinned, non-blocking copy: the host does not wait for rounds queued on the device (the caching host
        # allocator keeps the pinned row alive until the copy has run).
        on_cuda = self.tensor.device.type == "cuda"
        self.tensor[slot].copy_(row.pin_memory() if on_cuda else row, non_blocking=on_cuda)

    def clear(self, slot: int) -> list[int]:
        """Empties `slot`'s row (all null) and returns the blocks it held."""
        slot = self._check_slot("BlockTable.clear", slot)
        ids = self.rows.pop(slot, [])
        for block in ids:
            del self.holder[block]
        if ids:
            self.tensor[slot].fill_(NULL_BLOCK)
        return ids

    def blocks(self, slot: int) -> list[int]:
        """The blocks `slot` holds, in position order."""
        return list(self.rows.get(self._check_slot("BlockTable.blocks", slot), []))
