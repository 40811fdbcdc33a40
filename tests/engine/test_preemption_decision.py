"""engine/preemption.py decides and writes nothing: the victim by (priority, least computed work,
latest arrival), swap while the CPU pool has room for its blocks, recompute otherwise."""
from __future__ import annotations

import pytest

from engine.block_manager import BlockManager
from engine.preemption import choose
from engine.request import Request
from engine.sequence import Sequence
from shared.sampling import SamplingParams

BLOCK = 4


def running(bm: BlockManager, rid: str, computed: int, priority: int = 0,
            arrival: float = 0.0) -> Sequence:
    """A sequence that holds the blocks of its first `computed` tokens."""
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    seq = Sequence(Request(rid, list(range(10, 10 + computed)), params, priority, arrival, (2,)))
    bm.allocate(seq, computed)
    seq.num_computed_tokens = computed
    return seq


def state(bm: BlockManager, seqs: list[Sequence]) -> object:
    return (bm.num_free_blocks, bm.cpu.num_free, list(bm.ref_counts),
            [(s.status, s.num_computed_tokens, list(s.block_table), s.swapped) for s in seqs])


@pytest.mark.parametrize("mode,cpu_blocks,expected", [
    ("auto", 8, "swap"), ("swap", 8, "swap"), ("recompute", 8, "recompute"),
    ("auto", 2, "recompute"),  # its 3 blocks do not fit the CPU pool: recompute, even under swap
    ("swap", 2, "recompute"),
])
def test_choose_decides_swap_or_recompute_and_writes_nothing(mode: str, cpu_blocks: int,
                                                             expected: str) -> None:
    bm = BlockManager(16, BLOCK, num_cpu_blocks=cpu_blocks)
    old = running(bm, "old", 12, arrival=0.0)
    new = running(bm, "new", 12, arrival=1.0)  # 3 blocks each
    before = state(bm, [old, new])
    decision = choose([old, new], mode, bm)
    assert decision.seqs == [new] and decision.mode == expected  # the latest arrival goes
    assert state(bm, [old, new]) == before


def test_victim_order_priority_then_least_work_then_latest_arrival() -> None:
    bm = BlockManager(32, BLOCK, num_cpu_blocks=32)
    urgent = running(bm, "urgent", 4, priority=0, arrival=9.0)
    much = running(bm, "much", 16, priority=1, arrival=5.0)
    little_early = running(bm, "little_early", 4, priority=1, arrival=1.0)
    little_late = running(bm, "little_late", 4, priority=1, arrival=2.0)
    seqs = [urgent, much, little_early, little_late]
    assert choose(seqs, "auto", bm).seqs == [little_late]
    assert choose(seqs[:3], "auto", bm).seqs == [little_early]
    assert choose(seqs[:2], "auto", bm).seqs == [much]
    little_late.just_resumed = True  # resumed and not advanced since: not preempted again at once
    assert choose(seqs, "auto", bm).seqs == [little_early]
    assert choose([little_late], "auto", bm).seqs == [little_late]  # unless it is the only one
