"""What the scheduler's configuration decides, as functions of the queues: whether new requests are
admitted this step, how many tokens a sequence computes now, the order of a queue, and whom to
preempt. They decide and return; the scheduler (engine/scheduler.py) applies.

The prefill policy changes only the order of service and how prompts may be cut:
  chunked        prompts are cut to fit the budget left after decodes (Sarathi-Serve).
  prefill_first  while prompts wait, a step serves only prompts; decodes pause (vLLM V0, TGI).
  mixed          a prompt joins a step only whole, next to the decodes (Orca).
Preemption takes the lowest priority, then the least computed work (cheapest to redo), then the
latest arrival, and never a sequence that was just resumed and has not advanced since (no
preempt/resume ping-pong). `swap` copies its blocks to the CPU pool; `recompute` frees them and
prefills prompt + generated tokens again; `auto` swaps while the CPU pool has room. Outputs are
identical either way.
"""
from __future__ import annotations

import bisect

from engine import groups
from engine.sequence import Sequence
from shared.config import SchedulerConfig

# waiting_served_ratio's escape hatch (TGI's max_waiting_tokens): admit anyway after this many steps.
MAX_WAITING_STEPS = 20


def admission_open(cfg: SchedulerConfig, step: int, steps_waited: int, num_waiting: int, num_running: int,
                   num_swapped: int) -> bool:
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


def split(cfg: SchedulerConfig, unit: list[Sequence], budget: int, others_waiting: bool) -> list[int]:
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
    return seq.num_tokens - max(cached, seq.num_computed_tokens) - groups.holds_last_prompt_token(seq)


def victim(candidates: list[Sequence]) -> Sequence:
    """The sequence to preempt among candidates (running, not yet served this step)."""
    settled = [s for s in candidates if not s.just_resumed] or candidates
    return max(settled, key=lambda s: (s.request.priority, -s.num_computed_tokens, s.request.arrival_time))


def place(queue: list[Sequence], seq: Sequence) -> int:
    """Where seq goes in a waiting or swapped queue, kept in (priority, arrival) order; FCFS among equals."""
    return bisect.bisect_right([_order(s) for s in queue], _order(seq))


def _order(seq: Sequence) -> tuple[int, float]:
    return (seq.request.priority, seq.request.arrival_time)
