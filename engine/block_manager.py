"""Who owns which KV block. Pure Python bookkeeping; the tensors live in kv_cache.py.

Two pools of the same shape: the device pool the model computes on and a CPU swap pool that
holds the blocks of swapped-out requests. Callers ask before they act: `can_allocate(n)` then
`allocate(req, num_tokens)`; `can_swap_out(req)` then `swap_out(req)`. Swaps return the
(src, dst) block pairs the runner must copy before the next forward.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from engine.request import Request


class BlockPool:
    """A free list and reference counts over block ids 0..num_blocks-1."""

    def __init__(self, num_blocks: int, free_order: Iterable[int] | None = None) -> None:
        self.num_blocks = num_blocks
        # free_order lets tests hand out blocks in a scrambled order to prove paging is real.
        order = list(range(num_blocks)) if free_order is None else list(free_order)
        assert sorted(order) == list(range(num_blocks)), "free_order must be a permutation of the block ids"
        self.free_blocks: deque[int] = deque(order)
        self.ref_counts = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self.free_blocks)

    def take(self) -> int:
        block_id = self.free_blocks.popleft()
        assert self.ref_counts[block_id] == 0
        self.ref_counts[block_id] = 1
        return block_id

    def release(self, block_ids: list[int]) -> None:
        # Reversed so a sequence's tail blocks are reused first, keeping its head warm for sharing.
        for block_id in reversed(block_ids):
            self.ref_counts[block_id] -= 1
            assert self.ref_counts[block_id] >= 0
            if self.ref_counts[block_id] == 0:
                self.free_blocks.append(block_id)

    @property
    def usage(self) -> float:
        return 1.0 - len(self.free_blocks) / self.num_blocks if self.num_blocks else 0.0


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, free_order: Iterable[int] | None = None,
                 num_cpu_blocks: int = 0) -> None:
        self.block_size = block_size
        self.device = BlockPool(num_blocks, free_order)
        self.cpu = BlockPool(num_cpu_blocks)

    @property
    def num_blocks(self) -> int:
        return self.device.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.device.num_free

    @property
    def ref_counts(self) -> list[int]:
        return self.device.ref_counts

    @property
    def usage(self) -> float:
        return self.device.usage

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_new_blocks(self, req: Request, num_tokens: int) -> int:
        """Blocks req still needs so that its first num_tokens tokens have slots."""
        return max(0, self.blocks_for(num_tokens) - len(req.block_table))

    def can_allocate(self, num_new_blocks: int) -> bool:
        return num_new_blocks <= self.device.num_free

    def allocate(self, req: Request, num_tokens: int) -> None:
        n = self.num_new_blocks(req, num_tokens)
        assert n <= self.device.num_free, "allocate() without can_allocate()"
        req.block_table.extend(self.device.take() for _ in range(n))

    def free(self, req: Request) -> None:
        (self.cpu if req.swapped else self.device).release(req.block_table)
        req.block_table = []
        req.swapped = False

    # ------------------------------------------------------------------ swap
    def can_swap_out(self, req: Request) -> bool:
        return len(req.block_table) <= self.cpu.num_free

    def swap_out(self, req: Request) -> list[tuple[int, int]]:
        """Move req's blocks to the CPU pool. -> (device block, cpu block) pairs to copy."""
        return self._move(req, self.device, self.cpu, swapped=True)

    def can_swap_in(self, req: Request, num_tokens: int) -> bool:
        return self.blocks_for(num_tokens) <= self.device.num_free

    def swap_in(self, req: Request) -> list[tuple[int, int]]:
        """Move req's blocks back into (possibly other) device blocks. -> (cpu block, device block) pairs."""
        return self._move(req, self.cpu, self.device, swapped=False)

    @staticmethod
    def _move(req: Request, src: BlockPool, dst: BlockPool, swapped: bool) -> list[tuple[int, int]]:
        assert req.swapped != swapped
        pairs = [(b, dst.take()) for b in req.block_table]
        src.release(req.block_table)
        req.block_table = [d for _, d in pairs]
        req.swapped = swapped
        return pairs
