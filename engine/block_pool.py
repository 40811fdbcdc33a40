"""One pool of KV blocks (the device's, or the CPU swap pool): who holds each block (reference
counts), which are free and in what order they are evicted, and the hash -> block map of cached
ones. Pure Python, no tensors. Only engine/block_manager.py uses the pool: the manager decides
which blocks a sequence holds; the pool keeps count. `blocks_for` is the engine's one block count
of a token count (the manager, engine/window.py and engine/admission.py use it).

A freed block keeps its hash and stays reusable in the free list, which is in eviction order (least
recently freed first): a later request with the same prefix takes it back instead of recomputing it.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable


def blocks_for(num_tokens: int, block_size: int) -> int:
    """The blocks that hold num_tokens tokens: the last one may be partial."""
    return -(-num_tokens // block_size)


class BlockPool:
    """Reference counts, a free list in eviction order, and the hash -> block map of cached
    blocks."""

    def __init__(self, num_blocks: int, free_order: Iterable[int] | None = None) -> None:
        self.num_blocks = num_blocks
        # free_order lets tests hand out blocks in a scrambled order to prove paging is real.
        order = list(range(num_blocks)) if free_order is None else list(free_order)
        assert sorted(order) == list(range(num_blocks)), \
            "free_order must be a permutation of the block ids"
        # head = evicted first
        self.free_blocks: OrderedDict[int, None] = OrderedDict.fromkeys(order)
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.cached: dict[int, int] = {}  # block hash -> block id

    @property
    def num_free(self) -> int:
        return len(self.free_blocks)

    def take(self) -> tuple[int, int | None]:
        """-> (block id, the hash it held and lost, or None). The least recently freed block goes
        first."""
        block_id, _ = self.free_blocks.popitem(last=False)
        assert self.ref_counts[block_id] == 0
        self.ref_counts[block_id] = 1
        return block_id, self.drop_hash(block_id)

    def touch(self, block_id: int) -> None:
        """One more user of a block: a prefix hit on a free cached block takes it off the free
        list."""
        if self.ref_counts[block_id] == 0:
            del self.free_blocks[block_id]
        self.ref_counts[block_id] += 1

    def release(self, block_ids: list[int]) -> None:
        # Reversed so a sequence's tail blocks are evicted first, keeping its head warm for sharing.
        # A block without a hash holds nothing reusable: it goes to the head, to be taken before any
        # cached block is evicted.
        for block_id in reversed(block_ids):
            self.ref_counts[block_id] -= 1
            assert self.ref_counts[block_id] >= 0
            if self.ref_counts[block_id] == 0:
                self.free_blocks[block_id] = None
                if self.block_hash[block_id] is None:
                    self.free_blocks.move_to_end(block_id, last=False)

    def set_hash(self, block_id: int, h: int) -> None:
        """Name a full block. A second block with the same content stays unnamed (no
        de-duplication: it may be in some sequence's table, and rewriting tables under a running
        step is not worth it)."""
        if self.block_hash[block_id] is None and h not in self.cached:
            self.block_hash[block_id] = h
            self.cached[h] = block_id

    def drop_hash(self, block_id: int) -> int | None:
        h = self.block_hash[block_id]
        if h is not None:
            self.block_hash[block_id] = None
            del self.cached[h]
        return h

    def reset(self) -> None:
        for block_id in list(self.cached.values()):
            self.drop_hash(block_id)

    @property
    def usage(self) -> float:
        return 1.0 - len(self.free_blocks) / self.num_blocks if self.num_blocks else 0.0
