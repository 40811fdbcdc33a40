"""Sliding windows in the KV cache: which leading blocks of a sequence no layer reads again.
Arithmetic only; engine/block_manager.py releases the blocks.

`window` is set only when EVERY layer of the model has one: the largest of them, as
engine/build.py's release_window decides. A block whose every position is older than what the
sequence's next computed token can see (positions < num_computed_tokens - window + 1) is never read
again, so the block manager gives it back (a reference, as for any shared block) and points its
table entry at its `placeholder`, a block kept out of the pool that nobody writes and so holds
zeros: kernels may gather it, the window masks it, and 0 * 0 leaks nothing. `seq.released_blocks`
counts those leading entries; everything that walks a table (fork, free, swap) skips them. A
released full block keeps its hash like any freed one, so other requests can still hit it. A model
with one global layer (Gemma's alternating layers) needs every block: there `window` is None and
nothing is released.
"""
from __future__ import annotations

from engine.block_pool import blocks_for


def releasable(window: int | None, block_size: int, num_computed: int) -> int:
    """Leading blocks no layer reads again once num_computed tokens are computed: the next token, at
    position num_computed, sees positions num_computed - window + 1 and later."""
    return max(0, (num_computed - window + 1) // block_size) if window is not None else 0


def max_live_blocks(window: int | None, block_size: int, max_new_tokens: int) -> int | None:
    """The most blocks one sequence holds while computing at most max_new_tokens tokens a step (its
    window's and the new tokens'); None without a window (then: its whole context)."""
    if window is None:
        return None
    return blocks_for(window + max_new_tokens + block_size - 2, block_size)
