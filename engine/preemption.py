"""Whom to preempt when a step cannot get blocks, and how: a decision the scheduler applies
(engine/scheduler.py `_preempt`, the only writer of the sequences' fields).

The victim is the lowest priority, then the least computed work (cheapest to redo), then the latest
arrival, and never a sequence that was just resumed and has not advanced since (no preempt/resume
ping-pong). A request's beams leave as one unit (engine/groups.py). `swap` copies their blocks to
the CPU pool; `recompute` frees them and prefills prompt + generated tokens again; `auto` and
`swap` swap while the CPU pool has room, and recompute when it has none. Outputs are identical
either way.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from engine import groups
from engine.block_manager import BlockManager
from engine.sequence import Sequence


@dataclass(frozen=True, slots=True)
class Preemption:
    seqs: list[Sequence]  # one sequence, or a request's beams: they leave the batch together
    mode: Literal["swap", "recompute"]


def victim(candidates: list[Sequence]) -> Sequence:
    """The sequence to preempt among candidates (running, not yet served this step)."""
    settled = [s for s in candidates if not s.just_resumed] or candidates
    return max(settled, key=lambda s: (s.request.priority, -s.num_computed_tokens,
                                       s.request.arrival_time))


def choose(candidates: list[Sequence], preemption_mode: str, bm: BlockManager) -> Preemption:
    """The unit to preempt among candidates, and whether it is swapped (asks bm, read-only)."""
    seqs = groups.unit_of(victim(candidates))
    swap = preemption_mode != "recompute" and bm.can_swap_out(seqs)
    return Preemption(seqs, "swap" if swap else "recompute")
