"""What the scheduler's configuration decides, as functions of the queues: whether new requests are
admitted this step, how many tokens a sequence computes now and the order of a queue (whom to
preempt: engine/preemption.py). They decide and return; the scheduler (engine/scheduler.py)
applies.

Admission (`admit`) decides, for the next waiting sequence in order, whether it starts now and with
how many tokens, given the budget left, the long prefills running and the free blocks; it asks the
block manager (read-only) and leaves every write to the scheduler.

The prefill policy changes only the order of service and how prompts may be cut:
  chunked        prompts are cut to fit the budget left after decodes (Sarathi-Serve).
  prefill_first  while prompts wait, a step serves only prompts; decodes pause (vLLM V0, TGI).
  mixed          a prompt joins a step only whole, next to the decodes (Orca).
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Literal

from engine import groups
from engine.block_manager import BlockManager
from engine.prefix_cache import PrefixHit
from engine.sequence import Sequence
from shared.config import SchedulerConfig

# waiting_served_ratio's escape hatch (TGI's max_waiting_tokens): admit anyway after this many
# steps.
MAX_WAITING_STEPS = 20


def admission_open(cfg: SchedulerConfig, step: int, steps_waited: int, num_waiting: int,
                   num_running: int, num_swapped: int) -> bool:
    """schedule_interval and waiting_served_ratio hold new requests back to keep decode batches
    steady; with nothing running, the door is always open. step: this step's number, from 1;
    steps_waited: steps since a request was last admitted, this one included."""
    if not num_running and not num_swapped:
        return True
    if (step - 1) % cfg.schedule_interval:
        return False
    if cfg.waiting_served_ratio > 0 and steps_waited < MAX_WAITING_STEPS:
        return num_waiting >= cfg.waiting_served_ratio * num_running
    return True


@dataclass(frozen=True)
class Admission:
    """What admission decided for one waiting sequence. verdict: `start` it now with
    num_tokens tokens; `pass` over it (it is long and enough long prefills run: shorter
    prompts behind it go first); or `stop` admitting this step (it does not fit, and a later
    request does not overtake it)."""

    verdict: Literal["start", "pass", "stop"]
    num_tokens: int = 0
    hit: PrefixHit | None = None  # the prefix it starts on; None: it holds blocks already (a fork)
    is_long: bool = False  # counts against max_long_prefills


def num_long_prefills(cfg: SchedulerConfig, running: list[Sequence]) -> int:
    """Running sequences with more than long_prompt_tokens still to compute."""
    return sum(s.num_tokens - s.num_computed_tokens > cfg.long_prompt_tokens for s in running)


def admit(cfg: SchedulerConfig, bm: BlockManager, seq: Sequence, budget: int, long_prefills: int,
          batch_empty: bool, others_waiting: bool) -> Admission:
    """Whether waiting seq starts now, and with how many tokens, from the longest cached prefix of
    its tokens. An embedding pools every row, so it never starts on a cached prefix
    (engine/pooling.py)."""
    hit = bm.lookup(seq) if seq.request.pooling is None else PrefixHit()
    cached = hit.num_tokens(bm.block_size)
    left = remaining(seq, cached)
    is_long = left > cfg.long_prompt_tokens
    if is_long and long_prefills >= cfg.max_long_prefills:
        return Admission("pass")
    if cfg.prefill_policy == "mixed" and left > budget and not batch_empty:
        return Admission("stop")  # a prompt joins only whole, unless it alone exceeds the budget
    n = chunk(cfg, left, budget, others_waiting)
    if seq.block_table:  # holds shared blocks already (a forked sequence): no prefix lookup
        fits = bm.can_allocate(bm.num_new_blocks(seq, seq.num_computed_tokens + n))
        return Admission("start", n, None, is_long) if fits else Admission("stop")
    if not bm.can_allocate_hit(hit, cached + n):
        return Admission("stop")  # FCFS within what fits
    return Admission("start", n, hit, is_long)


def restart(cfg: SchedulerConfig, bm: BlockManager, unit: list[Sequence], budget: int,
            swapped: bool, num_running: int) -> list[int] | None:
    """The tokens each sequence of unit (one sequence, or a request's beams: all of them or none)
    computes as it starts again, swapped back in or (waiting) recomputed. -> None when it does not
    fit now: in the CPU-to-device swap, the free blocks, or max_num_seqs."""
    ns = split(cfg, unit, budget, others_waiting=not swapped)
    wants = [s.num_computed_tokens + n for s, n in zip(unit, ns)]
    fits = bm.can_swap_in(unit, wants) if swapped else bm.can_allocate(sum(map(bm.blocks_for, ns)))
    return ns if fits and num_running + len(unit) <= cfg.max_num_seqs else None


def split(cfg: SchedulerConfig, unit: list[Sequence], budget: int,
          others_waiting: bool) -> list[int]:
    """The tokens each sequence of unit (one sequence, or a request's beams) computes now, in turn
    from one budget."""
    ns = []
    for s in unit:
        ns.append(chunk(cfg, remaining(s), budget, others_waiting))
        budget -= ns[-1]
    return ns


def chunk(cfg: SchedulerConfig, remaining: int, budget: int, others_waiting: bool) -> int:
    """Tokens to compute now. A long prefill is cut to long_prefill_threshold while others wait,
    so they get budget (and their first token) this step; alone, it takes the whole budget."""
    n = min(remaining, budget)
    cut = others_waiting and cfg.prefill_policy != "mixed"  # mixed never cuts a prompt
    if cut and n > cfg.long_prompt_tokens:
        n = cfg.long_prompt_tokens
    return n


def remaining(seq: Sequence, cached: int = 0) -> int:
    """Tokens seq may compute now (one short of its prompt while its request has not forked)."""
    computed = max(cached, seq.num_computed_tokens)
    return seq.num_tokens - computed - groups.holds_last_prompt_token(seq)


def place(queue: list[Sequence], seq: Sequence) -> int:
    """Where seq goes in a waiting or swapped queue, kept in (priority, arrival)
    order; FCFS among equals."""
    return bisect.bisect_right([_order(s) for s in queue], _order(seq))


def _order(seq: Sequence) -> tuple[int, float]:
    return (seq.request.priority, seq.request.arrival_time)
