"""Iteration-level scheduling: every step decides afresh which sequences compute how many tokens,
then applies what the step computed. The scheduler is the one writer of every sequence's tokens,
counters and status (the block manager writes only block tables, and says what it did).

One token budget per step (max_num_batched_tokens) and a cap on sequences (max_num_seqs).
Order of service: running requests (in admission order, each the rest of its gap: 1 for a
decode, a chunk for a prompt), then swapped-out requests (they come back before anyone new),
then waiting requests by (priority, arrival), each from the longest cached prefix of its tokens.
When a request cannot get blocks, a running request not yet served this step is preempted
(swapped out or recomputed later).

Modules that decide and return, for the scheduler to apply: engine/policy.py (prefill policies,
admission, chunks, victims), engine/groups.py (forks, beams as one unit), engine/speculative/
(drafts, verification, counters), engine/thinking.py (reasoning budgets).
"""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from engine import groups, policy, pooling, prompt_logprobs, structured, thinking
from engine.block_manager import BlockManager
from engine.sequence import LogprobEntry, Sequence, SequenceStatus, stop_reason
from engine.speculative import Proposer, SpecStats, computed_after, plan_drafts
from engine.step import Delta, Drafts, StepOutput, StepPlan
from shared.config import SchedulerConfig

if TYPE_CHECKING:
    import torch

log = logging.getLogger("conveyor.scheduler")


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, max_model_len: int,
                 proposer: Proposer | None = None) -> None:
        self.config = config
        self.max_model_len = max_model_len  # the engine's limit, narrowed by model, backend, pool, draft
        self.bm = block_manager
        self.proposer = proposer
        self.spec_stats = SpecStats()
        self.waiting: list[Sequence] = []  # sorted by (priority, arrival_time)
        self.swapped: list[Sequence] = []  # sorted by (priority, arrival_time)
        self.running: list[Sequence] = []  # admission order
        self.num_steps = 0
        self.steps_since_admission = 0
        self.num_preemptions = {"swap": 0, "recompute": 0}
        self.num_stalled_steps = 0
        self._moved = False

    def add(self, seq: Sequence, matcher: Any = None) -> None:
        """matcher: a constrained root's compiled grammar (xgrammar)."""
        seq.matcher = matcher
        if seq.group is not None:
            groups.start(seq)
        self.waiting.insert(policy.place(self.waiting, seq), seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def abort(self, seq: Sequence) -> None:
        """Every live sequence of seq's request ends, its blocks freed."""
        for s in groups.end(seq):
            self.drop(s, SequenceStatus.FINISHED_ABORTED)
        seq.status = SequenceStatus.FINISHED_ABORTED

    def stop_sequence(self, seq: Sequence) -> list[Delta]:
        """One streaming choice of a request ends early (a stop string in its text); the others go on."""
        self.drop(seq, SequenceStatus.FINISHED_STOPPED)
        return self._group_deltas(seq)

    def drop(self, seq: Sequence, status: SequenceStatus) -> None:
        """Out of whichever queue holds it, its blocks (device or swapped) freed."""
        for queue in (self.running, self.waiting, self.swapped):
            if seq in queue:
                queue.remove(seq)
                break
        self.bm.free(seq)
        seq.status = status

    # ---------------------------------------------------------------- schedule
    def schedule(self) -> StepPlan:
        self.num_steps += 1
        self.bm.begin_step()
        self._moved = False  # set when a sequence is admitted, resumed, forked or preempted
        plan = StepPlan()
        budget = self.config.max_num_batched_tokens
        admit = self._admission_open()
        prompts_first = self.config.prefill_policy == "prefill_first" and admit and self._room(budget)
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
                log.error("scheduler stalled: %d running, %d waiting, %d swapped, %d free blocks, nothing "
                          "schedulable", len(self.running), len(self.waiting), len(self.swapped),
                          self.bm.num_free_blocks)
        return plan

    def _admission_open(self) -> bool:
        if not self.waiting:
            return False
        self.steps_since_admission += 1
        return policy.admission_open(self.config, self.num_steps, self.steps_since_admission, len(self.waiting),
                                     len(self.running), len(self.swapped))

    def _room(self, budget: int) -> bool:
        return budget > 0 and len(self.running) < self.config.max_num_seqs

    def _schedule_running(self, plan: StepPlan, budget: int) -> int:
        i, others_waiting = 0, bool(self.waiting)
        planned: set[int] = set()  # served this step (beams with the first of their group)
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            unit = groups.unit_of(seq)
            # Nothing for beams served ahead of their place, or that computed this step's token and wait
            # for the rest of their group to step.
            ns = [] if id(seq) in planned else policy.split(self.config, unit, budget, others_waiting)
            if not any(ns):
                i += 1
                continue
            drafts = plan_drafts(self.proposer, unit, ns, budget, self.max_model_len, self.bm)
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

    def _reserve(self, unit: list[Sequence], ns: list[int], plan: StepPlan, first_candidate: int,
                 planned: set[int]) -> bool:
        """Get blocks for each sequence of unit to compute its next n tokens, preempting sequences not yet
        served this step. -> False when unit itself had to go."""
        wants = [(s, s.num_computed_tokens + n) for s, n in zip(unit, ns) if n]
        while need := sum(self.bm.num_new_blocks(s, num_tokens) for s, num_tokens in wants):
            if self.bm.can_allocate(need):
                for s, num_tokens in wants:
                    self.bm.allocate(s, num_tokens)
                return True
            candidates = [s for s in self.running[first_candidate:] if id(s) not in planned]
            victims = groups.unit_of(policy.victim(candidates))
            self._preempt(victims, plan)
            if unit[0] in victims:
                return False
        return True  # its slots are there and its own already: most decode steps

    def _preempt(self, seqs: list[Sequence], plan: StepPlan) -> None:
        """seqs (one sequence, or a request's beams) leave the batch together, swapped or to recompute."""
        swap = self.config.preemption_mode != "recompute" and self.bm.can_swap_out(seqs)
        mode, queue = ("swap", self.swapped) if swap else ("recompute", self.waiting)  # swap while the CPU has room
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
                admission = policy.admit(self.config, self.bm, seq, budget, long_prefills, not plan.seqs,
                                         others_waiting=len(self.waiting) > 1)
                if admission.verdict == "pass":
                    i += 1  # let shorter prompts behind it get their first token
                    continue
                used = self._admit(self.waiting.pop(i), admission, plan) if admission.verdict == "start" else None
                long_prefills += admission.is_long
            if used is None:
                break
            budget -= used
            self.steps_since_admission = 0
        return budget

    def _admit(self, seq: Sequence, admission: policy.Admission, plan: StepPlan) -> int:
        """Apply policy.admit's start: blocks from its prefix hit, or past a fork's shared ones. -> tokens."""
        n, hit = admission.num_tokens, admission.hit
        if hit is None:
            self.bm.allocate(seq, seq.num_computed_tokens + n)
        else:
            seq.num_computed_tokens = self.bm.allocate_hit(seq, hit, hit.num_tokens(self.bm.block_size) + n)
            if seq.num_output_tokens == 0 and seq.num_sent_tokens == 0:  # first admission
                seq.request.num_cached_tokens = seq.num_computed_tokens
        self._start(seq, plan, n)
        self._fork(groups.fork_if_ready(seq))  # when its prompt is cached but for the last token
        return n

    def _start_unit(self, unit: list[Sequence], queue: list[Sequence], plan: StepPlan, budget: int) -> int | None:
        """Apply policy.restart: unit starts from queue, swapped back in or (waiting) beams to recompute,
        with no prefix lookup (their own blocks were freed; a hit would only save time). -> tokens, or None."""
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

    def _fork(self, forks: list[tuple[Sequence, Sequence]]) -> None:
        """Each (parent, child): the child shares its parent's blocks and runs from now on."""
        self._moved = True
        for parent, child in forks:
            self.bm.fork(parent, child)
            self.running.append(child)

    # ---------------------------------------------------------------- update
    def update(self, plan: StepPlan, output: StepOutput) -> list[Delta]:
        """Apply what the step computed: advance every scheduled sequence, append the sampled tokens (one
        per sequence the plan says samples, in plan order), stop and free finished sequences. -> what each
        request's client gets. Anything that goes wrong for one request (its sampling, its beam scoring)
        ends that request with an error, not the step."""
        deltas: list[Delta] = []
        assert plan.num_sampled == len(output.tokens)
        prompt_logprobs.record(plan, output)
        for i, (seq, n, sampled) in enumerate(zip(plan.seqs, plan.num_new_tokens, plan.sampled)):
            if seq.status.finished:
                continue  # its request failed earlier in this step
            if seq.request.pooling is not None:  # an embedding's chunk: pooled, never sampled
                deltas += self._pooled(seq, n, output.pooled.get(i))
                continue
            drafts = plan.drafts.get(i) if plan.drafts else None
            if output.errors and sampled in output.errors:
                deltas.append(self._fail(seq, output.errors[sampled]))
                continue
            try:
                deltas += self._advance(seq, n, drafts, output, sampled)
            except Exception as e:
                log.exception("request %s: applying its step failed", seq.request.request_id)
                deltas.append(self._fail(seq, f"{type(e).__name__}: {e}"))
        prompt_logprobs.attach(deltas)
        return deltas

    def fail(self, plan: StepPlan, why: str) -> list[Delta]:
        """The step itself failed (its forward): every request it computed or preempted ends with an
        error, its blocks freed; the other requests go on. -> one error delta per request."""
        # One per request: the first of its sequences fails the others with it.
        return [self._fail(seq, why) for seq in plan.seqs + plan.preempted if not seq.status.finished]

    def _fail(self, seq: Sequence, why: str) -> Delta:
        """seq's request ends with an error: every sequence of it stops and frees its blocks."""
        self.abort(seq)
        seq.request.events["finished"] = time.time()
        return Delta(seq.request, [], seq.index, "error", True, error=why)

    def _advance(self, seq: Sequence, n: int, drafts: Drafts | None, output: StepOutput,
                 sampled: int | None) -> list[Delta]:
        """seq computed its n scheduled tokens; sampled: its entry in output, if it sampled. A beam's
        candidates wait for its siblings': the last of them steps the search (engine/groups.py)."""
        if drafts is not None:
            assert output.accepted is not None and sampled is not None
            self._update_spec(seq, drafts.num, output.accepted[sampled], output.tokens[sampled])
            return [self._delta(seq)]
        before = seq.num_computed_tokens
        seq.num_computed_tokens += n
        self.bm.computed(seq, before)
        if sampled is None:  # a prompt chunk that does not reach the end samples nothing
            self._fork(groups.fork_if_ready(seq))  # after a chunk that ends one short of the prompt
            return []
        token, entry = output.tokens[sampled], output.logprobs[sampled] if output.logprobs else None
        seq.just_resumed = False
        g = seq.group
        if g is not None and g.beam is not None:
            assert entry is not None, "the sampler gives every beam its candidates"
            step = groups.beam_step([(seq, entry)], self.max_model_len)
            return self._apply_beam_step(step) if step is not None else []
        self._append(seq, token, entry)
        if seq.status.finished:
            self._finish(seq)
        return self._group_deltas(seq) if g is not None else [self._delta(seq)]

    def _pooled(self, seq: Sequence, n: int, part: torch.Tensor | None) -> list[Delta]:
        """An embedding computed n more tokens: add its part (a preempted recompute starts afresh); its
        last chunk ends it at once, its blocks freed, with its pooled total."""
        seq.pooled = pooling.accumulate(seq.pooled if seq.num_computed_tokens else None, part)
        seq.num_computed_tokens += n
        if self.bm.window is not None:
            self.bm.release_out_of_window(seq)
        if seq.num_computed_tokens < seq.num_tokens:
            return []
        seq.status = SequenceStatus.FINISHED_STOPPED
        self._finish(seq)
        return [Delta(seq.request, [], seq.index, "stop", True, pooled=seq.pooled)]

    def _update_spec(self, seq: Sequence, num_drafts: int, accepted: tuple[int, ...], token: int) -> None:
        """A verified step: the accepted drafts and the token after them join the sequence (up to a
        stop); the K/V of rejected drafts is dropped with the blocks that only they used."""
        before, drafted = seq.num_computed_tokens, seq.num_tokens + num_drafts - 1
        self.spec_stats.verified(num_drafts, len(accepted))
        seq.just_resumed = False
        for t in (*accepted, token):
            self._append(seq, t, None)
            if seq.status.finished:
                break
        seq.num_computed_tokens, seq.draft_computed = computed_after(before, drafted, len(accepted), seq.num_tokens)
        if seq.status.finished:
            self._finish(seq)
            return
        self.bm.trim(seq, seq.num_tokens)  # first, as before the window release (the free list's order)
        self.bm.computed(seq, before)

    def _append(self, seq: Sequence, token: int, entry: LogprobEntry | None) -> None:
        why = stop_reason(seq, token, self.max_model_len)
        seq.token_ids.append(token)
        seq.thinking = thinking.after(seq)
        if entry is not None:
            seq.cumulative_logprob += entry[0]
            if seq.logprobs is not None:
                seq.logprobs.append(entry)
        if seq.num_sent_tokens == 0:
            seq.request.events.setdefault("first_token", time.time())
        ended = seq.matcher is not None and structured.advance(seq, token)  # the grammar is complete
        if ended or why == "stop":
            seq.status = SequenceStatus.FINISHED_STOPPED
        elif why == "length":
            seq.status = SequenceStatus.FINISHED_LENGTH

    def _finish(self, seq: Sequence) -> None:
        seq.request.events["finished"] = time.time()
        self.running.remove(seq)
        self.bm.free(seq)

    def _delta(self, seq: Sequence, request_finished: bool | None = None) -> Delta:
        """The tokens (and logprobs) of seq not yet sent."""
        new = seq.token_ids[seq.num_prompt_tokens + seq.num_sent_tokens:]
        lps = seq.logprobs[seq.num_sent_tokens:] if seq.logprobs is not None else None
        seq.num_sent_tokens += len(new)
        finished = seq.status.finished if request_finished is None else request_finished
        return Delta(seq.request, new, seq.index, seq.status.finish_reason, finished, lps)

    def _group_deltas(self, seq: Sequence) -> list[Delta]:
        """After a sequence of a group appended a token (or was stopped): what the client gets now."""
        done, best = groups.settle(seq)
        if done and seq.status.finished:  # the request's timestamps are the root's, whichever ended last
            seq.request.events["finished"] = time.time()
        return [self._delta(seq, done)] if best is None else best

    def _apply_beam_step(self, step: groups.BeamStep) -> list[Delta]:
        request = step.request
        request.events.setdefault("first_token", time.time())
        self._fork(step.forks)
        for seq, token, score in step.appends:
            seq.token_ids.append(token)
            seq.cumulative_logprob = score
        for seq in step.ended:
            self.drop(seq, SequenceStatus.FINISHED_STOPPED)
        if step.deltas:
            request.events["finished"] = time.time()
        return step.deltas

