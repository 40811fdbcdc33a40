"""Who owns which KV block. Pure Python bookkeeping; the tensors live in kv_cache.py.

Two pools of the same shape: the device pool the model computes on and a CPU pool that holds
swapped-out requests and, with prefix caching, a second tier of the cache. Blocks are reference
counted so that sequences share them: forks (n / best_of / beam search) share every block, and
prefix caching shares full prompt blocks across requests. A shared block is never written in
place: the writer gets a copy first (copy-on-write). Only the block a sequence writes next can be
shared and partial, because full blocks are never written again.

Prefix caching: a full, computed block is named by hash((parent block's hash, its token ids)), so a
hash names the whole prefix up to that block. A freed block keeps its hash and stays reusable in
the free list, which is in eviction order (least recently freed first). Evicting a hashed device
block copies it to the CPU pool while that has room; a later hit there is swapped back in.

Callers ask before they act: `can_allocate(n)` then `allocate(req, num_tokens)`. The copies the
runner must make before the next forward collect in `swap_out` (device -> CPU: swaps and
evictions), `swap_in` (CPU -> device) and `copies` (device -> device, copy-on-write).
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field

from engine.request import Request


class BlockPool:
    """Reference counts, a free list in eviction order, and the hash -> block map of cached blocks."""

    def __init__(self, num_blocks: int, free_order: Iterable[int] | None = None) -> None:
        self.num_blocks = num_blocks
        # free_order lets tests hand out blocks in a scrambled order to prove paging is real.
        order = list(range(num_blocks)) if free_order is None else list(free_order)
        assert sorted(order) == list(range(num_blocks)), "free_order must be a permutation of the block ids"
        self.free_blocks: OrderedDict[int, None] = OrderedDict.fromkeys(order)  # head = evicted first
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.cached: dict[int, int] = {}  # block hash -> block id

    @property
    def num_free(self) -> int:
        return len(self.free_blocks)

    def take(self) -> tuple[int, int | None]:
        """-> (block id, the hash it held and lost, or None). The least recently freed block goes first."""
        block_id, _ = self.free_blocks.popitem(last=False)
        assert self.ref_counts[block_id] == 0
        self.ref_counts[block_id] = 1
        return block_id, self.drop_hash(block_id)

    def touch(self, block_id: int) -> None:
        """One more user of a block: a prefix hit on a free cached block takes it off the free list."""
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
        """Name a full block. A second block with the same content stays unnamed (no de-duplication:
        it may be in some sequence's table, and rewriting tables under a running step is not worth it)."""
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


@dataclass
class PrefixHit:
    """The longest cached prefix of a request: device blocks first, then CPU-tier blocks after them."""

    device: list[int] = field(default_factory=list)
    cpu: list[int] = field(default_factory=list)
    num_free_touched: int = 0  # device hits that sit in the free list (taking them uses free room)

    def num_tokens(self, block_size: int) -> int:
        return (len(self.device) + len(self.cpu)) * block_size


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, free_order: Iterable[int] | None = None,
                 num_cpu_blocks: int = 0, enable_prefix_caching: bool = False) -> None:
        self.block_size = block_size
        self.device = BlockPool(num_blocks, free_order)
        self.cpu = BlockPool(num_cpu_blocks)
        self.enable_prefix_caching = enable_prefix_caching
        self.swap_out: list[tuple[int, int]] = []  # (device block, cpu block), this step
        self.swap_in: list[tuple[int, int]] = []  # (cpu block, device block), this step
        self.copies: list[tuple[int, int]] = []  # (device block, device block), copy-on-write, this step
        # CPU blocks read or written this step are held until the next one, so that no block is both
        # the source and the destination of copies that the runner makes as one batch.
        self._cpu_held: list[int] = []
        self.stats = {"prefix_queries": 0, "prefix_hits": 0, "prefix_cpu_hits": 0, "cow_copies": 0,
                      "evicted_to_cpu": 0}

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

    def begin_step(self) -> None:
        """Forget last step's copy lists (the runner made them) and release the CPU blocks they held."""
        self.swap_out, self.swap_in, self.copies = [], [], []
        if self._cpu_held:
            self.cpu.release(self._cpu_held)
            self._cpu_held = []

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ------------------------------------------------------------- allocate
    def _needs_cow(self, req: Request) -> bool:
        """The block req writes next is already in its table and shared: writing needs a copy."""
        i = req.num_computed_tokens // self.block_size
        return i < len(req.block_table) and self.device.ref_counts[req.block_table[i]] > 1

    def num_new_blocks(self, req: Request, num_tokens: int) -> int:
        """Blocks req still needs so that its first num_tokens tokens have slots it may write."""
        return max(0, self.blocks_for(num_tokens) - len(req.block_table)) + self._needs_cow(req)

    def can_allocate(self, num_new_blocks: int) -> bool:
        return num_new_blocks <= self.device.num_free

    def allocate(self, req: Request, num_tokens: int) -> None:
        assert self.num_new_blocks(req, num_tokens) <= self.device.num_free, "allocate() without can_allocate()"
        if self._needs_cow(req):
            i = req.num_computed_tokens // self.block_size
            old, new = req.block_table[i], self._take()
            self.copies.append((old, new))
            self.device.release([old])
            req.block_table[i] = new
            self.stats["cow_copies"] += 1
        n = max(0, self.blocks_for(num_tokens) - len(req.block_table))
        req.block_table.extend(self._take() for _ in range(n))

    def _take(self) -> int:
        """A device block; a cached block it evicts is first saved to the CPU tier when that has room."""
        block_id, h = self.device.take()
        if h is not None and self.cpu.num_blocks and h not in self.cpu.cached and self.cpu.num_free:
            cpu_id, _ = self.cpu.take()
            self.cpu.set_hash(cpu_id, h)
            self.swap_out.append((block_id, cpu_id))
            self._cpu_held.append(cpu_id)
            self.stats["evicted_to_cpu"] += 1
        return block_id

    def trim(self, req: Request, num_tokens: int) -> None:
        """Release the blocks beyond req's first num_tokens tokens (slots of rejected drafts)."""
        keep = self.blocks_for(num_tokens)
        if len(req.block_table) > keep:
            self.device.release(req.block_table[keep:])
            del req.block_table[keep:]

    def fork(self, parent: Request, child: Request) -> None:
        """child shares every block of parent (its table is already a copy of parent's)."""
        assert not parent.swapped and child.block_table == parent.block_table
        for block_id in parent.block_table:
            self.device.touch(block_id)

    def free(self, req: Request) -> None:
        (self.cpu if req.swapped else self.device).release(req.block_table)
        req.block_table = []
        req.swapped = False

    # --------------------------------------------------------- prefix cache
    def _hashes(self, req: Request, num_blocks: int) -> list[int]:
        """req.block_hashes extended to cover its first num_blocks full blocks."""
        hashes, ids, bs = req.block_hashes, req.token_ids, self.block_size
        for i in range(len(hashes), num_blocks):
            hashes.append(hash((hashes[i - 1] if i else None, tuple(ids[i * bs:(i + 1) * bs]))))
        return hashes

    def lookup(self, req: Request) -> PrefixHit:
        """The longest cached prefix of req's tokens, never the last token: one token must be computed
        to have logits to sample from. No side effects."""
        hit = PrefixHit()
        if not self.enable_prefix_caching or req.block_table:
            return hit
        dev, cpu = self.device, self.cpu
        for h in self._hashes(req, (req.num_tokens - 1) // self.block_size):
            if not hit.cpu and h in dev.cached:
                block_id = dev.cached[h]
                hit.device.append(block_id)
                hit.num_free_touched += dev.ref_counts[block_id] == 0
            elif h in cpu.cached:
                hit.cpu.append(cpu.cached[h])
            else:
                break
        return hit

    def can_allocate_hit(self, hit: PrefixHit, num_tokens: int) -> bool:
        need = self.blocks_for(num_tokens) - len(hit.device)
        return need <= self.device.num_free - hit.num_free_touched

    def allocate_hit(self, req: Request, hit: PrefixHit, num_tokens: int) -> None:
        """Start req on its cached prefix (device hits shared, CPU hits swapped into new blocks), then
        allocate up to num_tokens."""
        assert not req.block_table and req.num_computed_tokens == 0
        for block_id in hit.device:
            self.device.touch(block_id)
        for cpu_id in hit.cpu:
            self.cpu.touch(cpu_id)  # held: nothing may overwrite it before the runner reads it
            self._cpu_held.append(cpu_id)
        req.block_table = list(hit.device)
        for cpu_id in hit.cpu:
            block_id = self._take()
            self.device.set_hash(block_id, self.cpu.block_hash[cpu_id])
            self.swap_in.append((cpu_id, block_id))
            req.block_table.append(block_id)
        cached = hit.num_tokens(self.block_size)
        req.num_computed_tokens = cached
        if req.num_output_tokens == 0 and req.num_sent_tokens == 0:
            self.stats["prefix_queries"] += req.num_prompt_tokens
            self.stats["prefix_hits"] += cached
            self.stats["prefix_cpu_hits"] += len(hit.cpu) * self.block_size
            req.num_cached_tokens = cached
        self.allocate(req, num_tokens)

    def cache_blocks(self, req: Request, num_computed_before: int) -> None:
        """Name the blocks that became full and computed this step, so later requests can share them."""
        bs = self.block_size
        first, last = num_computed_before // bs, req.num_computed_tokens // bs
        if last > first and self.enable_prefix_caching and not req.swapped:
            hashes = self._hashes(req, last)
            for i in range(first, last):
                self.device.set_hash(req.block_table[i], hashes[i])

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (blocks in use keep running, just unnamed)."""
        self.device.reset()
        self.cpu.reset()

    # ------------------------------------------------------------------ swap
    def can_swap_out(self, req: Request) -> bool:
        return len(req.block_table) <= self.cpu.num_free

    def do_swap_out(self, req: Request) -> None:
        """Move req's blocks to the CPU pool; the runner copies the pairs before the next forward."""
        assert not req.swapped
        pairs = [(b, self.cpu.take()[0]) for b in req.block_table]
        self.device.release(req.block_table)
        req.block_table = [c for _, c in pairs]
        req.swapped = True
        self.swap_out += pairs

    def can_swap_in(self, req: Request, num_tokens: int) -> bool:
        return self.blocks_for(num_tokens) <= self.device.num_free

    def do_swap_in(self, req: Request) -> None:
        """Move req's blocks back into (possibly other) device blocks."""
        assert req.swapped
        pairs = [(c, self._take()) for c in req.block_table]
        self._cpu_held += req.block_table  # released next step, after the runner has read them
        req.block_table = [d for _, d in pairs]
        req.swapped = False
        self.swap_in += pairs
