"""Iteration-level scheduling: every step decides afresh which sequences compute how many tokens
(here: `schedule`), then applies what the step computed (engine/scheduler_update.py: the queues and
`update`, the other half of the same object). The scheduler is the one writer of every sequence's
tokens, counters and status (the block manager writes only block tables, and says what it did).

One token budget per step (max_num_batched_tokens) and a cap on sequences (max_num_seqs).
Order of service: running requests (in admission order, each the rest of its gap: 1 for a
decode, a chunk for a prompt), then swapped-out requests (they come back before anyone new),
then waiting requests by (priority, arrival), each from the longest cached prefix of its tokens.
When a request cannot get blocks, a running request not yet served this step is preempted
(swapped out or recomputed later: engine/preemption.py decides whom and how).

Modules that decide and return, for the scheduler to apply: engine/policy.py (prefill policies,
admission, chunks), engine/preemption.py (victims, swap or recompute), engine/groups.py (forks,
beams as one unit), engine/speculative/ (drafts, verification, counters), engine/thinking.py
(reasoning budgets).
"""
from __future__ import annotations

import logging
import time

from engine import groups, policy, preemption
from engine.block_manager import BlockManager
from engine.scheduler_update import SchedulerUpdate
from engine.sequence import Sequence, SequenceStatus
from engine.speculative import Proposer, plan_drafts
from engine.step import StepPlan
from shared.config import SchedulerConfig

log = logging.getLogger("conveyor.scheduler")


class Scheduler(SchedulerUpdate):
    """schedule() -> StepPlan: who computes how many tokens this step. The queues, add / abort and
    update() -> Deltas are SchedulerUpdate's (engine/scheduler_update.py)."""

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, max_model_len: int,
                 proposer: Proposer | None = None) -> None:
        super().__init__(config, block_manager, max_model_len)
        self.proposer = proposer
        self.num_steps = 0
        self.steps_since_admission = 0
        self.num_preemptions = {"swap": 0, "recompute": 0}
        self.num_stalled_steps = 0

    # ---------------------------------------------------------------- schedule
    def schedule(self) -> StepPlan:
        self.num_steps += 1
        self.bm.begin_step()
        self._moved = False  # set when a sequence is admitted, resumed, forked or preempted
        plan = StepPlan()
        budget = self.config.max_num_batched_tokens
        admit = self._admission_open()
        prefill_first = self.config.prefill_policy == "prefill_first"
        prompts_first = prefill_first and admit and self._room(budget)
        if not prompts_first:
            budget = self._schedule_running(plan, budget)
        if not plan.preempted:
            budget = self._schedule_swapped(plan, budget)
        if admit and not plan.preempted and not self.swapped:
            budget = self._schedule_waiting(plan, budget)
        if prompts_first and not plan.seqs:  # nothing could be admitted after all
            self._schedule_running(plan, budget)
        plan.swap_out, plan.swap_in, plan.copies = self.bm.take_moves()
        if not plan and not self._moved and self.has_work():
            # Work waits and nothing can move: a scheduling bug (a state this scheduler should never
            # reach). Counted (conveyor_engine_stalled_steps_total) so it can never go unnoticed.
            self.num_stalled_steps += 1
            if self.num_stalled_steps == 1:
                log.error("scheduler stalled: %d running, %d waiting, %d swapped, %d free blocks, "
                          "nothing schedulable", len(self.running), len(self.waiting),
                          len(self.swapped), self.bm.num_free_blocks)
        return plan

    def _admission_open(self) -> bool:
        if not self.waiting:
            return False
        self.steps_since_admission += 1
        return policy.admission_open(self.config, self.num_steps, self.steps_since_admission,
                                     len(self.waiting), len(self.running), len(self.swapped))

    def _room(self, budget: int) -> bool:
        return budget > 0 and len(self.running) < self.config.max_num_seqs

    def _schedule_running(self, plan: StepPlan, budget: int) -> int:
        i, others_waiting = 0, bool(self.waiting)
        # Drafts get only the budget that no prompt's prefill could take this step (and the decodes
        # after them): they never delay a first token.
        reserved = self._prompt_demand() if self.proposer is not None else 0
        planned: set[int] = set()  # served this step (beams with the first of their group)
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            unit = groups.unit_of(seq)
            # Nothing for beams served ahead of their place, or that computed this step's token and
            # wait for the rest of their group to step.
            ns = [] if id(seq) in planned else policy.split(self.config, unit, budget,
                                                            others_waiting)
            if not any(ns):
                i += 1
                continue
            spare = budget - reserved - (len(self.running) - i - 1)
            drafts = plan_drafts(self.proposer, unit, ns, spare, self.max_model_len, self.bm)
            ns[0] += drafts.num if drafts is not None else 0
            if not self._reserve(unit, ns, plan, i, planned):
                continue  # the unit itself was preempted; running[i] is now the next sequence
            for s, n in zip(unit, ns):
                if n:
                    plan.add(s, n, drafts if s is seq else None)
            planned.update(map(id, unit))
            budget -= sum(ns)
            i += 1
        return budget

    def _prompt_demand(self) -> int:
        """Prompt tokens this step's prefills could take: the rest of every prompt still prefilling,
        and the whole of each waiting one that has a seat (a queue longer than the seats left,
        behind a full batch, takes none this step)."""
        seats = max(0, self.config.max_num_seqs - len(self.running))
        return (sum(max(0, s.num_tokens - 1 - s.num_computed_tokens) for s in self.running)
                + sum(s.num_tokens - s.num_computed_tokens for s in self.waiting[:seats]))

    def _reserve(self, unit: list[Sequence], ns: list[int], plan: StepPlan, first_candidate: int,
                 planned: set[int]) -> bool:
        """Get blocks for each sequence of unit to compute its next n tokens, preempting sequences
        not yet served this step. -> False when unit itself had to go."""
        wants = [(s, s.num_computed_tokens + n) for s, n in zip(unit, ns) if n]
        while need := sum(self.bm.num_new_blocks(s, num_tokens) for s, num_tokens in wants):
            if self.bm.can_allocate(need):
                for s, num_tokens in wants:
                    self.bm.allocate(s, num_tokens)
                return True
            candidates = [s for s in self.running[first_candidate:] if id(s) not in planned]
            decision = preemption.choose(candidates, self.config.preemption_mode, self.bm)
            self._preempt(decision, plan)
            if unit[0] in decision.seqs:
                return False
        return True  # its slots are there and its own already: most decode steps

    def _preempt(self, decision: preemption.Preemption, plan: StepPlan) -> None:
        """Apply a preemption: its sequences leave the batch together, swapped or to recompute."""
        seqs, mode = decision.seqs, decision.mode
        swap = mode == "swap"
        queue = self.swapped if swap else self.waiting
        if swap:
            self.bm.do_swap_out(seqs)
        for seq in seqs:
            self.running.remove(seq)
            seq.draft_computed = 0  # draft K/V is neither swapped nor kept
            if not swap:
                self.bm.free(seq)
                seq.num_computed_tokens = 0
            queue.insert(policy.place(queue, seq), seq)
            seq.status = SequenceStatus.PREEMPTED
            plan.preempted.append(seq)
        events = seqs[0].request.events
        events["preempted"] = events.get("preempted", 0) + 1
        self.num_preemptions[mode] += len(seqs)
        self._moved = True

    def _schedule_swapped(self, plan: StepPlan, budget: int) -> int:
        while self.swapped and budget > 0:
            used = self._start_unit(groups.unit_of(self.swapped[0]), self.swapped, plan, budget)
            if used is None:
                break
            budget -= used
        return budget

    def _schedule_waiting(self, plan: StepPlan, budget: int) -> int:
        long_prefills = policy.num_long_prefills(self.config, self.running)
        i = 0
        while i < len(self.waiting) and self._room(budget):
            seq = self.waiting[i]
            unit = groups.unit_of(seq)
            if len(unit) > 1:  # a request's beams, back from a recompute: all of them or none
                used = self._start_unit(unit, self.waiting, plan, budget)
            else:
                admission = policy.admit(self.config, self.bm, seq, budget, long_prefills,
                                         not plan.seqs, others_waiting=len(self.waiting) > 1)
                if admission.verdict == "pass":
                    i += 1  # let shorter prompts behind it get their first token
                    continue
                used = None
                if admission.verdict == "start":
                    used = self._admit(self.waiting.pop(i), admission, plan)
                long_prefills += admission.is_long
            if used is None:
                break
            budget -= used
            self.steps_since_admission = 0
        return budget

    def _admit(self, seq: Sequence, admission: policy.Admission, plan: StepPlan) -> int:
        """Apply policy.admit's start: blocks from its prefix hit, or past a fork's
        shared ones. -> tokens."""
        n, hit = admission.num_tokens, admission.hit
        if hit is None:
            self.bm.allocate(seq, seq.num_computed_tokens + n)
        else:
            seq.num_computed_tokens = self.bm.allocate_hit(seq, hit,
                                                           hit.num_tokens(self.bm.block_size) + n)
            if seq.num_output_tokens == 0 and seq.num_sent_tokens == 0:  # first admission
                seq.request.num_cached_tokens = seq.num_computed_tokens
        self._start(seq, plan, n)
        self._fork(groups.fork_if_ready(seq))  # when its prompt is cached but for the last token
        return n

    def _start_unit(self, unit: list[Sequence], queue: list[Sequence], plan: StepPlan,
                    budget: int) -> int | None:
        """Apply policy.restart: unit starts from queue, swapped back in or (waiting) beams to
        recompute, with no prefix lookup (their own blocks were freed; a hit would only save time).
        -> tokens, or None."""
        swap = queue is self.swapped
        ns = policy.restart(self.config, self.bm, unit, budget, swap, len(self.running))
        if ns is None:
            return None
        if swap:
            self.bm.do_swap_in(unit)
        for s, n in zip(unit, ns):
            queue.remove(s)
            if n:
                self.bm.allocate(s, s.num_computed_tokens + n)
            self._start(s, plan, n)
        return sum(ns)

    def _start(self, seq: Sequence, plan: StepPlan, n: int) -> None:
        seq.just_resumed = seq.status == SequenceStatus.PREEMPTED
        seq.status = SequenceStatus.RUNNING
        seq.request.events.setdefault("scheduled", time.time())
        self.running.append(seq)
        self._moved = True
        if n:  # 0: a request about to fork whose prompt is cached but for the last token
            plan.add(seq, n)
