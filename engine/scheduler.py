"""Iteration-level scheduling: every step decides afresh which requests compute how many tokens.

One token budget per step (max_num_batched_tokens) and a cap on sequences (max_num_seqs).
Running requests are served first, in admission order, each the rest of its gap (1 for a decode,
a chunk for a prompt); waiting requests are admitted with what is left, by (priority, arrival).
The prefill policy only changes that order and how prompts may be cut:
  chunked        prompts are cut to fit the budget left after decodes (Sarathi-Serve).
  prefill_first  while prompts wait, a step serves only prompts; decodes pause (vLLM V0, TGI).
  mixed          a prompt joins a step only whole, next to the decodes (Orca).
When a request cannot get blocks, the running request that wastes least to redo (lowest priority,
then latest arrival) is preempted by recompute: its blocks are freed and it waits again with its
prompt and generated tokens, which are prefilled anew; outputs do not change.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from engine.block_manager import BlockManager
from engine.request import Request, RequestStatus
from shared.config import SchedulerConfig


@dataclass
class StepPlan:
    """What one step computes: requests[i] computes its next num_new_tokens[i] tokens."""

    requests: list[Request] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def __bool__(self) -> bool:
        return bool(self.requests)


@dataclass
class Finished:
    request: Request
    new_token_ids: list[int]


def _order(req: Request) -> tuple[int, float]:
    return (req.priority, req.arrival_time)


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.bm = block_manager
        self.waiting: list[Request] = []  # sorted by (priority, arrival_time)
        self.running: list[Request] = []  # admission order
        self.num_preemptions = 0

    def add(self, req: Request) -> None:
        keys = [_order(r) for r in self.waiting]
        self.waiting.insert(bisect.bisect_right(keys, _order(req)), req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def abort(self, req: Request) -> None:
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.bm.free(req)
        req.status = RequestStatus.FINISHED_ABORTED

    # ---------------------------------------------------------------- schedule
    def schedule(self) -> StepPlan:
        plan = StepPlan()
        budget = self.config.max_num_batched_tokens
        policy = self.config.prefill_policy
        prompts_first = policy == "prefill_first" and self._can_admit(budget)
        if not prompts_first:
            budget = self._schedule_running(plan, budget)
        if not plan.preempted:
            budget = self._schedule_waiting(plan, budget, whole_prompts=policy == "mixed")
        if prompts_first and not plan.requests:  # nothing could be admitted after all
            self._schedule_running(plan, budget)
        return plan

    def _schedule_running(self, plan: StepPlan, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if not self._reserve(req, n, plan, protect=i):
                continue  # req itself was preempted; running[i] is now the next request
            plan.requests.append(req)
            plan.num_new_tokens.append(n)
            budget -= n
            i += 1
        return budget

    def _reserve(self, req: Request, n: int, plan: StepPlan, protect: int) -> bool:
        """Get blocks for req's next n tokens, preempting requests not yet scheduled this step."""
        need = self.bm.num_new_blocks(req, req.num_computed_tokens + n)
        while not self.bm.can_allocate(need):
            candidates = self.running[protect:]
            victim = max(candidates, key=_order)
            self._preempt(victim, plan)
            if victim is req:
                return False
        self.bm.allocate(req, req.num_computed_tokens + n)
        return True

    def _preempt(self, req: Request, plan: StepPlan) -> None:
        self.running.remove(req)
        self.bm.free(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        self.add(req)
        plan.preempted.append(req)
        self.num_preemptions += 1

    def _can_admit(self, budget: int) -> bool:
        return bool(self.waiting) and len(self.running) < self.config.max_num_seqs and budget > 0

    def _schedule_waiting(self, plan: StepPlan, budget: int, whole_prompts: bool) -> int:
        while self._can_admit(budget):
            req = self.waiting[0]
            remaining = req.num_tokens - req.num_computed_tokens
            if whole_prompts and remaining > budget and plan.requests:
                break  # mixed: a prompt joins only whole, unless it alone exceeds the budget
            n = min(remaining, budget)
            need = self.bm.num_new_blocks(req, req.num_computed_tokens + n)
            if not self.bm.can_allocate(need):
                break  # FCFS: do not let a later, smaller request overtake
            self.bm.allocate(req, req.num_computed_tokens + n)
            self.waiting.pop(0)
            self.running.append(req)
            req.status = RequestStatus.RUNNING
            plan.requests.append(req)
            plan.num_new_tokens.append(n)
            budget -= n
        return budget

    # ---------------------------------------------------------------- update
    def update(self, plan: StepPlan, sampled: list[int], max_model_len: int) -> list[Finished]:
        """Advance every scheduled request; sampled holds one token per request that reached the
        end of its known tokens this step, in plan order. Returns the deltas; frees finished ones."""
        deltas: list[Finished] = []
        j = 0
        for req, n in zip(plan.requests, plan.num_new_tokens):
            req.num_computed_tokens += n
            if req.num_computed_tokens < req.num_tokens:
                continue  # a prompt chunk that does not reach the end samples nothing
            token = sampled[j]
            j += 1
            req.token_ids.append(token)
            self._check_stop(req, token, max_model_len)
            new = req.token_ids[req.num_prompt_tokens + req.num_sent_tokens:]
            req.num_sent_tokens += len(new)
            deltas.append(Finished(req, new))
            if req.status.finished:
                self.running.remove(req)
                self.bm.free(req)
        assert j == len(sampled)
        return deltas

    @staticmethod
    def _check_stop(req: Request, token: int, max_model_len: int) -> None:
        p = req.params
        if token in req.stop_ids and req.num_output_tokens > p.min_tokens:
            req.status = RequestStatus.FINISHED_STOPPED
        elif req.num_output_tokens >= p.max_tokens or req.num_tokens >= max_model_len:
            req.status = RequestStatus.FINISHED_LENGTH
