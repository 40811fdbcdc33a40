"""Who owns which KV block. Pure Python bookkeeping; the tensors live in kv_cache.py.

Callers ask before they act: `can_allocate(n)` then `allocate(req, num_tokens)`.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from engine.request import Request


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, free_order: Iterable[int] | None = None) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        # free_order lets tests hand out blocks in a scrambled order to prove paging is real.
        order = list(range(num_blocks)) if free_order is None else list(free_order)
        assert sorted(order) == list(range(num_blocks)), "free_order must be a permutation of the block ids"
        self.free_blocks: deque[int] = deque(order)
        self.ref_counts = [0] * num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_new_blocks(self, req: Request, num_tokens: int) -> int:
        """Blocks req still needs so that its first num_tokens tokens have slots."""
        return max(0, self.blocks_for(num_tokens) - len(req.block_table))

    def can_allocate(self, num_new_blocks: int) -> bool:
        return num_new_blocks <= len(self.free_blocks)

    def allocate(self, req: Request, num_tokens: int) -> None:
        n = self.num_new_blocks(req, num_tokens)
        assert n <= len(self.free_blocks), "allocate() without can_allocate()"
        for _ in range(n):
            block_id = self.free_blocks.popleft()
            assert self.ref_counts[block_id] == 0
            self.ref_counts[block_id] = 1
            req.block_table.append(block_id)

    def free(self, req: Request) -> None:
        # Reversed so a request's tail blocks are reused first, keeping its head warm for later sharing.
        for block_id in reversed(req.block_table):
            self.ref_counts[block_id] -= 1
            assert self.ref_counts[block_id] >= 0
            if self.ref_counts[block_id] == 0:
                self.free_blocks.append(block_id)
        req.block_table = []

    @property
    def usage(self) -> float:
        return 1.0 - len(self.free_blocks) / self.num_blocks
