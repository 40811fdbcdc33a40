"""Who owns which KV block. Pure Python bookkeeping; the tensors live in kv_cache.py.

Two pools of the same shape: the device pool the model computes on and a CPU pool that holds
swapped-out requests and, with prefix caching, a second tier of the cache. Blocks are reference
counted so that sequences share them: forks (n / best_of / beam search) share every block, and
prefix caching shares full prompt blocks across requests. A shared block is never written in
place: the writer gets a copy first (copy-on-write). Only the block a sequence writes next can be
shared and partial, because full blocks are never written again.

Prefix caching (engine/prefix_cache.py: how blocks are named, and what a hit is): a full, computed
block is named by its prefix's hash and stays reusable after it is freed, until it is evicted.

Callers ask before they act: `can_allocate(n)` then `allocate(seq, num_tokens)`. The block manager
writes a sequence's block table, `swapped` flag and block hashes, never its counters: what the
scheduler needs to know (how many tokens a prefix hit covers) comes back as a return value; so do
the copies the runner must make before the next forward (`take_moves()` -> `BlockMoves`: swaps and
evictions device -> CPU, swaps CPU -> device, copy-on-write device -> device).

Sliding windows (engine/window.py says which blocks and why): blocks that a sequence's window has
passed go back to the pool, and their table entries point at `placeholder`; `seq.released_blocks`
counts those leading entries, and everything that walks a table (fork, free, swap) skips them.
"""
from __future__ import annotations

from collections.abc import Iterable

from engine import window as sliding
from engine.block_pool import BlockPool, blocks_for
from engine.prefix_cache import PrefixHit, longest_prefix
from engine.prompt_logprobs import bypasses_cache
from engine.sequence import Sequence
from engine.step import BlockMoves


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, free_order: Iterable[int] | None = None,
                 num_cpu_blocks: int = 0, enable_prefix_caching: bool = False,
                 window: int | None = None) -> None:
        """num_blocks: the device cache's blocks. With a window the last of them is the placeholder
        and the pool holds the others."""
        self.block_size = block_size
        self.window = window
        self.placeholder = num_blocks - 1 if window is not None else -1
        if window is not None:
            assert num_blocks > 1, "a windowed cache needs a block besides the placeholder"
            num_blocks -= 1
            if free_order is not None:
                free_order = [b for b in free_order if b != num_blocks]
        self.device = BlockPool(num_blocks, free_order)
        self.cpu = BlockPool(num_cpu_blocks)
        self.enable_prefix_caching = enable_prefix_caching
        self._moves = BlockMoves([], [], [])  # since the last take_moves()
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
        """Release the CPU blocks last step's copies held (the runner has made them)."""
        if self._cpu_held:
            self.cpu.release(self._cpu_held)
            self._cpu_held = []

    def take_moves(self) -> BlockMoves:
        """-> the copies the runner must make before the next forward; they are the caller's now."""
        moves, self._moves = self._moves, BlockMoves([], [], [])
        return moves

    def blocks_for(self, num_tokens: int) -> int:
        return blocks_for(num_tokens, self.block_size)

    # ------------------------------------------------------- sliding window
    def releasable(self, num_computed: int) -> int:
        return sliding.releasable(self.window, self.block_size, num_computed)

    def release_out_of_window(self, seq: Sequence) -> None:
        """Give back seq's blocks that its window has passed (one reference each: a fork keeps its
        own)."""
        r, old = self.releasable(seq.num_computed_tokens), seq.released_blocks
        if r > old:
            assert not seq.swapped and r <= len(seq.block_table)
            self.device.release(seq.block_table[old:r])
            seq.block_table[old:r] = [self.placeholder] * (r - old)
            seq.released_blocks = r

    def max_live_blocks(self, max_new_tokens: int) -> int | None:
        return sliding.max_live_blocks(self.window, self.block_size, max_new_tokens)

    # ------------------------------------------------------------- allocate
    def _needs_cow(self, seq: Sequence) -> bool:
        """The block seq writes next is already in its table and shared: writing needs a copy."""
        i = seq.num_computed_tokens // self.block_size
        return i < len(seq.block_table) and self.device.ref_counts[seq.block_table[i]] > 1

    def num_new_blocks(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks seq still needs so that its first num_tokens tokens have slots it may write."""
        return max(0, self.blocks_for(num_tokens) - len(seq.block_table)) + self._needs_cow(seq)

    def can_allocate(self, num_new_blocks: int) -> bool:
        return num_new_blocks <= self.device.num_free

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        assert self.num_new_blocks(seq, num_tokens) <= self.device.num_free, \
            "allocate() without can_allocate()"
        if self._needs_cow(seq):
            i = seq.num_computed_tokens // self.block_size
            old, new = seq.block_table[i], self._take()
            self._moves.copies.append((old, new))
            self.device.release([old])
            seq.block_table[i] = new
            self.stats["cow_copies"] += 1
        self._extend(seq, num_tokens)

    def _extend(self, seq: Sequence, num_tokens: int) -> None:
        n = max(0, self.blocks_for(num_tokens) - len(seq.block_table))
        seq.block_table.extend(self._take() for _ in range(n))

    def _take(self) -> int:
        """A device block; a cached block it evicts is first saved to the CPU tier when that has
        room."""
        block_id, h = self.device.take()
        if h is not None and self.cpu.num_blocks and h not in self.cpu.cached and self.cpu.num_free:
            cpu_id, _ = self.cpu.take()
            self.cpu.set_hash(cpu_id, h)
            self._moves.swap_out.append((block_id, cpu_id))
            self._cpu_held.append(cpu_id)
            self.stats["evicted_to_cpu"] += 1
        return block_id

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Release the blocks beyond seq's first num_tokens tokens (slots of rejected drafts)."""
        keep = self.blocks_for(num_tokens)
        assert keep >= seq.released_blocks
        if len(seq.block_table) > keep:
            self.device.release(seq.block_table[keep:])
            del seq.block_table[keep:]

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """child shares every block of parent (its table is already a copy of parent's)."""
        assert not parent.swapped and child.block_table == parent.block_table
        assert child.released_blocks == parent.released_blocks
        for block_id in parent.block_table[parent.released_blocks:]:
            self.device.touch(block_id)

    def free(self, seq: Sequence) -> None:
        (self.cpu if seq.swapped else self.device).release(seq.block_table[seq.released_blocks:])
        seq.block_table = []
        seq.released_blocks = 0
        seq.swapped = False

    # --------------------------------------------------------- prefix cache
    def _hashes(self, seq: Sequence, num_blocks: int) -> list[int]:
        """seq.block_hashes extended to cover its first num_blocks full blocks."""
        hashes, ids, bs = seq.block_hashes, seq.token_ids, self.block_size
        # the first block's parent: different salts never share a block
        salt = seq.params.cache_salt
        root = None if salt is None else ("cache_salt", salt)
        for i in range(len(hashes), num_blocks):
            hashes.append(hash((hashes[i - 1] if i else root, tuple(ids[i * bs:(i + 1) * bs]))))
        return hashes

    def lookup(self, seq: Sequence) -> PrefixHit:
        """The longest cached prefix of seq's tokens, never the last token: one token must be
        computed to have logits to sample from; none at all for a request that still has prompt
        tokens to score (a cached prefix has no logits). No side effects."""
        if not self.enable_prefix_caching or seq.block_table or bypasses_cache(seq):
            return PrefixHit()
        return longest_prefix(self._hashes(seq, (seq.num_tokens - 1) // self.block_size),
                              self.device, self.cpu)

    def can_allocate_hit(self, hit: PrefixHit, num_tokens: int) -> bool:
        # Table entries below r are out of the window already: neither taken nor allocated.
        r, nd = self.releasable(hit.num_tokens(self.block_size)), len(hit.device)
        touched = hit.num_free_touched if not r else sum(self.device.ref_counts[b] == 0
                                                         for b in hit.device[r:])
        need = self.blocks_for(num_tokens) - max(r, nd)
        return need <= self.device.num_free - touched

    def allocate_hit(self, seq: Sequence, hit: PrefixHit, num_tokens: int) -> int:
        """Start seq on its cached prefix (device hits shared, CPU hits swapped into new
        blocks), then allocate up to num_tokens. Hit blocks its window has passed already are
        not taken at all (the placeholder stands in). -> the tokens the prefix covers: seq's
        computed tokens from now."""
        assert not seq.block_table and seq.num_computed_tokens == 0
        cached = hit.num_tokens(self.block_size)
        r, nd = self.releasable(cached), len(hit.device)
        cpu_hits = hit.cpu[max(0, r - nd):]
        for block_id in hit.device[r:]:
            self.device.touch(block_id)
        for cpu_id in cpu_hits:
            self.cpu.touch(cpu_id)  # held: nothing may overwrite it before the runner reads it
            self._cpu_held.append(cpu_id)
        seq.block_table = [self.placeholder] * r + hit.device[r:]
        seq.released_blocks = r
        for cpu_id in cpu_hits:
            block_id, h = self._take(), self.cpu.block_hash[cpu_id]
            assert h is not None, "a CPU-tier hit is a hashed block"
            self.device.set_hash(block_id, h)
            self._moves.swap_in.append((cpu_id, block_id))
            seq.block_table.append(block_id)
        # a first admission, not a recompute
        if seq.num_output_tokens == 0 and seq.num_sent_tokens == 0:
            self.stats["prefix_queries"] += seq.num_prompt_tokens
            self.stats["prefix_hits"] += cached
            self.stats["prefix_cpu_hits"] += len(hit.cpu) * self.block_size
        # the next write starts a block of its own: never a shared one
        self._extend(seq, num_tokens)
        return cached

    def computed(self, seq: Sequence, num_computed_before: int) -> None:
        """seq computed tokens from num_computed_before on: name the blocks that
        filled, then release."""
        if self.enable_prefix_caching:
            self.cache_blocks(seq, num_computed_before)
        if self.window is not None:
            self.release_out_of_window(seq)

    def cache_blocks(self, seq: Sequence, num_computed_before: int) -> None:
        """Name the blocks that became full and computed this step, so later requests can share
        them."""
        bs = self.block_size
        first, last = num_computed_before // bs, seq.num_computed_tokens // bs
        if last > first and self.enable_prefix_caching and not seq.swapped:
            hashes = self._hashes(seq, last)
            for i in range(first, last):
                self.device.set_hash(seq.block_table[i], hashes[i])

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (blocks in use keep running, just unnamed)."""
        self.device.reset()
        self.cpu.reset()

    # ------------------------------------------------------------------ swap A request's beams move
    # as one (they step together): a block several of them share is copied once and stays shared, so
    # the group comes back into as many blocks as it left. Released (out-of-window) entries stay
    # placeholders both ways: only live blocks move.
    def can_swap_out(self, seqs: list[Sequence]) -> bool:
        return len(_distinct(seqs)) <= self.cpu.num_free

    def do_swap_out(self, seqs: list[Sequence]) -> None:
        """Move seqs' blocks to the CPU pool; the runner copies the pairs before the next
        forward."""
        self._moves.swap_out.extend(self._relocate(seqs, to_cpu=True))

    def can_swap_in(self, seqs: list[Sequence], num_tokens: list[int]) -> bool:
        """Room for seqs' blocks, the new ones each needs for its first num_tokens tokens, and a
        copy of each shared block one of them writes next."""
        need = len(_distinct(seqs))
        for seq, n in zip(seqs, num_tokens):
            need += max(0, self.blocks_for(n) - len(seq.block_table))
            i = seq.num_computed_tokens // self.block_size
            need += i < len(seq.block_table) and self.cpu.ref_counts[seq.block_table[i]] > 1
        return need <= self.device.num_free

    def do_swap_in(self, seqs: list[Sequence]) -> None:
        """Move seqs' blocks back into (possibly other) device blocks, shared as they were."""
        self._moves.swap_in.extend(self._relocate(seqs, to_cpu=False))

    def _relocate(self, seqs: list[Sequence], to_cpu: bool) -> list[tuple[int, int]]:
        """seqs' live blocks into new blocks of the other pool. -> (old block, new block) pairs."""
        new_pool = self.cpu if to_cpu else self.device
        moved: dict[int, int] = {}  # old block -> its new copy
        for seq in seqs:
            assert seq.swapped != to_cpu
            r, live = seq.released_blocks, seq.block_table[seq.released_blocks:]
            for b in live:
                if b in moved:
                    new_pool.touch(moved[b])
                else:
                    moved[b] = self.cpu.take()[0] if to_cpu else self._take()
            if to_cpu:
                self.device.release(live)
            else:
                self._cpu_held += live  # released next step, after the runner has read them
            seq.block_table[r:] = [moved[b] for b in live]
            seq.swapped = to_cpu
        return list(moved.items())


def _distinct(seqs: list[Sequence]) -> set[int]:
    return {b for seq in seqs for b in seq.block_table[seq.released_blocks:]}
