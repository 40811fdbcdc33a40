"""Finding a request's longest cached prefix: pure lookups over the two block pools, no side
effects. The block manager (engine/block_manager.py) names the blocks and takes the hits;
this says what a hit is.

A full, computed block is named by hash((parent block's hash, its token ids)), so a hash names the
whole prefix up to that block. A freed block keeps its hash and stays reusable
(engine/block_pool.py: one pool's reference counts, free list in eviction order, and names).
Evicting a hashed device block copies it to the CPU pool while that has room; a later hit there is
swapped back in.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.block_pool import BlockPool


@dataclass
class PrefixHit:
    """The longest cached prefix of a request: device blocks first, then CPU-tier blocks after
    them."""

    device: list[int] = field(default_factory=list)
    cpu: list[int] = field(default_factory=list)
    num_free_touched: int = 0  # device hits that sit in the free list (taking them uses free room)

    def num_tokens(self, block_size: int) -> int:
        return (len(self.device) + len(self.cpu)) * block_size


def longest_prefix(hashes: list[int], device: BlockPool, cpu: BlockPool) -> PrefixHit:
    """The blocks named by the leading hashes, device ones while they last, then CPU-tier ones (a
    device block after a CPU one would not save the swap in before it)."""
    hit = PrefixHit()
    for h in hashes:
        if not hit.cpu and h in device.cached:
            block_id = device.cached[h]
            hit.device.append(block_id)
            hit.num_free_touched += device.ref_counts[block_id] == 0
        elif h in cpu.cached:
            hit.cpu.append(cpu.cached[h])
        else:
            break
    return hit
