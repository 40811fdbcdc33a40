"""Iteration-level scheduling: every step decides afresh which sequences compute how many tokens,
then applies what the step computed. The scheduler is the one writer of every sequence's tokens,
counters and status (the block manager writes only block tables, and says what it did).

One token budget per step (max_num_batched_tokens) and a cap on sequences (max_num_seqs).
Order of service: running requests (in admission order, each the rest of its gap: 1 for a
decode, a chunk for a prompt), then swapped-out requests (they come back before anyone new),
then waiting requests by (priority, arrival). The prefill policy only changes that order and how
prompts may be cut:
  chunked        prompts are cut to fit the budget left after decodes (Sarathi-Serve).
  prefill_first  while prompts wait, a step serves only prompts; decodes pause (vLLM V0, TGI).
  mixed          a prompt joins a step only whole, next to the decodes (Orca).
When a request cannot get blocks, a running request not yet served this step is preempted: the
lowest priority, then the least computed work (cheapest to redo), never one that was just resumed
and has not advanced since (no preempt/resume ping-pong). `swap` copies its blocks to the CPU
pool; `recompute` frees them and prefills prompt + generated tokens again; `auto` swaps while the
CPU pool has room. Outputs are identical either way.

Sharing: a waiting request starts on the longest cached prefix of its tokens (prefix caching), so
only its suffix is computed. A request that runs several sequences (n / best_of, beam search) is
one sequence until its prompt is computed but for the last token, then forks (engine/groups.py).

Speculative decoding: a decoding request that may speculate asks the proposer for up to k
drafts (fewer near max_tokens, max_model_len or the end of the budget), which the plan carries,
and computes its last token plus the drafts: the budget counts every verified token. Drafts
never cause a preemption: when the blocks for them are not free, the request decodes plainly.
After verification the rejected drafts' blocks go back to the pool.
"""
from __future__ import annotations

import bisect
import time

from engine import groups
from engine.block_manager import BlockManager
from engine.sequence import LogprobEntry, Sequence, SequenceStatus
from engine.spec import Proposer
from engine.step import Delta, Drafts, StepOutput, StepPlan
from shared.config import SchedulerConfig

# waiting_served_ratio's escape hatch (TGI's max_waiting_tokens): admit anyway after this many steps.
MAX_WAITING_STEPS = 20


def _order(seq: Sequence) -> tuple[int, float]:
    return (seq.request.priority, seq.request.arrival_time)


def _victim_order(seq: Sequence) -> tuple[int, int, float]:
    """The max is preempted: lowest priority, then least computed work, then latest arrival."""
    return (seq.request.priority, -seq.num_computed_tokens, seq.request.arrival_time)


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, proposer: Proposer | None = None) -> None:
        self.config = config
        self.bm = block_manager
        self.proposer = proposer
        # Speculative decoding counters: verification steps (a request with drafts), drafts, accepted.
        self.spec_stats = {"spec_verifications": 0, "spec_draft_tokens": 0, "spec_accepted_tokens": 0}
        self.waiting: list[Sequence] = []  # sorted by (priority, arrival_time)
        self.swapped: list[Sequence] = []  # sorted by (priority, arrival_time)
        self.running: list[Sequence] = []  # admission order
        self.num_steps = 0
        self.steps_since_admission = 0
        self.num_preemptions = {"swap": 0, "recompute": 0}

    def add(self, seq: Sequence) -> None:
        if seq.group is not None:
            groups.start(seq)
        _insert(self.waiting, seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def abort(self, root: Sequence) -> None:
        """Every live sequence of root's request ends, its blocks freed."""
        g = root.group
        for seq in (list(g.seqs) if g is not None else [root]):
            self.drop(seq, SequenceStatus.FINISHED_ABORTED)
        root.status = SequenceStatus.FINISHED_ABORTED
        if g is not None:
            g.seqs = []

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
        plan.swap_out, plan.swap_in, plan.copies = self.bm.swap_out, self.bm.swap_in, self.bm.copies
        return plan

    def _admission_open(self) -> bool:
        """schedule_interval and waiting_served_ratio hold new requests back to keep decode batches
        steady; with nothing running, the door is always open."""
        if not self.waiting:
            return False
        self.steps_since_admission += 1
        if not self.running and not self.swapped:
            return True
        cfg = self.config
        if (self.num_steps - 1) % cfg.schedule_interval:
            return False
        if cfg.waiting_served_ratio > 0 and self.steps_since_admission < MAX_WAITING_STEPS:
            return len(self.waiting) >= cfg.waiting_served_ratio * len(self.running)
        return True

    def _room(self, budget: int) -> bool:
        return budget > 0 and len(self.running) < self.config.max_num_seqs

    def _schedule_running(self, plan: StepPlan, budget: int) -> int:
        i, others_waiting = 0, bool(self.waiting)
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = self._chunk(_remaining(seq), budget, others_waiting)
            if n == 0:  # a beam waiting for its siblings (preempted) before the group can step
                i += 1
                continue
            drafts = None
            if seq.request.speculate and n == 1 and self.proposer is not None:
                drafts = self._plan_drafts(seq, budget - 1)
                n += drafts.num if drafts is not None else 0
            if not self._reserve(seq, n, plan, first_candidate=i):
                continue  # seq itself was preempted; running[i] is now the next sequence
            plan.add(seq, n, drafts)
            budget -= n
            i += 1
        return budget

    def _chunk(self, remaining: int, budget: int, others_waiting: bool) -> int:
        """Tokens to compute now. A long prefill is cut to long_prefill_threshold while others wait,
        so they get budget (and their first token) this step; alone, it takes the whole budget."""
        n = min(remaining, budget)
        cut = others_waiting and self.config.prefill_policy != "mixed"  # mixed never cuts a prompt
        if cut and n > self.config.long_prefill_threshold:
            n = self.config.long_prefill_threshold
        return n

    def _plan_drafts(self, seq: Sequence, budget: int) -> Drafts | None:
        """Drafts seq verifies this step, if it is decoding: at most k, never past max_tokens or
        max_model_len, and none unless their blocks are free already."""
        assert self.proposer is not None
        p = seq.params
        if seq.num_computed_tokens != seq.num_tokens - 1 or seq.num_output_tokens < p.min_tokens:
            return None
        k = min(self.proposer.k, budget, p.max_tokens - seq.num_output_tokens - 1,
                self.config.max_model_len - seq.num_tokens - 1)
        if k <= 0:
            return None
        drafts = self.proposer.plan(seq, k)
        if not drafts.num or not self.bm.can_allocate(self.bm.num_new_blocks(seq, seq.num_tokens + drafts.num)):
            return None
        return drafts

    def _reserve(self, seq: Sequence, n: int, plan: StepPlan, first_candidate: int) -> bool:
        """Get blocks for seq's next n tokens, preempting sequences not yet served this step."""
        num_tokens = seq.num_computed_tokens + n
        while need := self.bm.num_new_blocks(seq, num_tokens):
            if self.bm.can_allocate(need):
                self.bm.allocate(seq, num_tokens)
                return True
            candidates = self.running[first_candidate:]
            victim = max([s for s in candidates if not s.just_resumed] or candidates, key=_victim_order)
            self._preempt(victim, plan)
            if victim is seq:
                return False
        return True  # its slots are there and its own already: most decode steps

    def _preempt(self, seq: Sequence, plan: StepPlan) -> None:
        self.running.remove(seq)
        seq.draft_computed = 0  # draft K/V is neither swapped nor kept
        mode = self.config.preemption_mode
        if mode == "auto":
            mode = "swap" if self.bm.can_swap_out(seq) else "recompute"
        if mode == "swap" and self.bm.can_swap_out(seq):
            self.bm.do_swap_out(seq)
            _insert(self.swapped, seq)
        else:
            mode = "recompute"
            self.bm.free(seq)
            seq.num_computed_tokens = 0
            _insert(self.waiting, seq)
        seq.status = SequenceStatus.PREEMPTED
        events = seq.request.events
        events["preempted"] = events.get("preempted", 0) + 1
        plan.preempted.append(seq)
        self.num_preemptions[mode] += 1

    def _schedule_swapped(self, plan: StepPlan, budget: int) -> int:
        while self.swapped and self._room(budget):
            seq = self.swapped[0]
            n = min(_remaining(seq), budget)
            if not self.bm.can_swap_in(seq, seq.num_computed_tokens + n):
                break
            self.swapped.pop(0)
            self.bm.do_swap_in(seq)
            self.bm.allocate(seq, seq.num_computed_tokens + n)
            self._start(seq, plan, n)
            budget -= n
        return budget

    def _schedule_waiting(self, plan: StepPlan, budget: int) -> int:
        cfg = self.config
        long_prefills = sum(s.num_tokens - s.num_computed_tokens > cfg.long_prefill_threshold for s in self.running)
        i = 0
        while i < len(self.waiting) and self._room(budget):
            seq = self.waiting[i]
            hit = self.bm.lookup(seq)
            cached = hit.num_tokens(self.bm.block_size)
            remaining = _remaining(seq, cached)
            is_long = remaining > cfg.long_prefill_threshold
            if is_long and long_prefills >= cfg.max_long_prefills:
                i += 1  # let shorter prompts behind it get their first token
                continue
            if cfg.prefill_policy == "mixed" and remaining > budget and plan.seqs:
                break  # a prompt joins only whole, unless it alone exceeds the budget
            n = self._chunk(remaining, budget, others_waiting=len(self.waiting) > 1)
            if seq.block_table:  # holds shared blocks already (a forked sequence): no prefix lookup
                if not self.bm.can_allocate(self.bm.num_new_blocks(seq, seq.num_computed_tokens + n)):
                    break
                self.bm.allocate(seq, seq.num_computed_tokens + n)
            else:
                if not self.bm.can_allocate_hit(hit, cached + n):
                    break  # FCFS within what fits: a later request does not overtake for memory
                seq.num_computed_tokens = self.bm.allocate_hit(seq, hit, cached + n)
                if seq.num_output_tokens == 0 and seq.num_sent_tokens == 0:  # first admission
                    seq.request.num_cached_tokens = seq.num_computed_tokens
            self.waiting.pop(i)
            long_prefills += is_long
            self._start(seq, plan, n)
            budget -= n
            self.steps_since_admission = 0
            if groups.ready_to_fork(seq):  # its prompt is cached but for the last token
                self._fork(seq)
        return budget

    def _start(self, seq: Sequence, plan: StepPlan, n: int) -> None:
        seq.just_resumed = seq.status == SequenceStatus.PREEMPTED
        seq.status = SequenceStatus.RUNNING
        seq.request.events.setdefault("scheduled", time.time())
        self.running.append(seq)
        if n:  # 0: a request about to fork whose prompt is cached but for the last token
            plan.add(seq, n)

    def _fork(self, root: Sequence) -> None:
        for child in groups.fork(root):
            self.bm.fork(root, child)
            self.running.append(child)

    # ---------------------------------------------------------------- update
    def update(self, plan: StepPlan, output: StepOutput) -> list[Delta]:
        """Apply what the step computed: advance every scheduled sequence, append the sampled tokens
        (one per sequence that reached the end of its known tokens, in plan order), stop and free
        finished sequences. -> what each request's client gets."""
        deltas: list[Delta] = []
        beams: dict[int, list[tuple[Sequence, LogprobEntry]]] = {}
        bs, caching = self.bm.block_size, self.bm.enable_prefix_caching
        tokens, logprobs, j = output.tokens, output.logprobs, 0
        for i, (seq, n) in enumerate(zip(plan.seqs, plan.num_new_tokens)):
            if plan.drafts and i in plan.drafts:
                assert output.accepted is not None
                self._update_spec(seq, plan.drafts[i].num, output.accepted[j], tokens[j])
                j += 1
                deltas.append(self._delta(seq))
                continue
            before = seq.num_computed_tokens
            seq.num_computed_tokens = computed = before + n
            if caching and computed // bs > before // bs:
                self.bm.cache_blocks(seq, before)
            if computed < len(seq.token_ids):
                if groups.ready_to_fork(seq):  # a chunk that ends one short of the prompt
                    self._fork(seq)
                continue  # a prompt chunk that does not reach the end samples nothing
            token, entry = tokens[j], logprobs[j] if logprobs else None
            j += 1
            seq.just_resumed = False
            g = seq.group
            if g is not None and g.beam is not None:
                assert entry is not None, "the sampler gives every beam its candidates"
                beams.setdefault(id(g), []).append((seq, entry))
                continue
            self._append(seq, token, entry)
            if seq.status.finished:
                self._finish(seq)
            deltas += self._group_deltas(seq) if g is not None else [self._delta(seq)]
        assert j == len(tokens)
        for cands in beams.values():
            step = groups.beam_step(cands, self.config.max_model_len)
            if step is not None:
                deltas += self._apply_beam_step(step)
        return deltas

    def _update_spec(self, seq: Sequence, num_drafts: int, accepted: tuple[int, ...], token: int) -> None:
        """A verified step: the accepted drafts and the token after them join the sequence (up to a
        stop); the K/V of rejected drafts is dropped with the blocks that only they used."""
        before, a = seq.num_computed_tokens, len(accepted)
        drafted = seq.num_tokens + num_drafts - 1  # a draft model wrote K/V this far when it proposed
        st = self.spec_stats
        st["spec_verifications"] += 1
        st["spec_draft_tokens"] += num_drafts
        st["spec_accepted_tokens"] += a
        seq.just_resumed = False
        for t in (*accepted, token):
            self._append(seq, t, None)
            if seq.status.finished:
                break
        seq.num_computed_tokens = min(before + 1 + a, seq.num_tokens - 1)
        seq.draft_computed = min(drafted, seq.num_computed_tokens)
        if seq.status.finished:
            self._finish(seq)
            return
        if self.bm.enable_prefix_caching:
            self.bm.cache_blocks(seq, before)
        self.bm.trim(seq, seq.num_tokens)

    def _append(self, seq: Sequence, token: int, entry: LogprobEntry | None) -> None:
        seq.token_ids.append(token)
        if entry is not None:
            seq.cumulative_logprob += entry[0]
            if seq.logprobs is not None:
                seq.logprobs.append(entry)
        if seq.num_sent_tokens == 0:
            seq.request.events.setdefault("first_token", time.time())
        p, num_tokens = seq.params, len(seq.token_ids)
        num_output = num_tokens - seq.num_prompt_tokens
        if token in seq.stop_ids and num_output > p.min_tokens:
            seq.status = SequenceStatus.FINISHED_STOPPED
        elif num_output >= p.max_tokens or num_tokens >= self.config.max_model_len:
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
        status = seq.status
        finished = status.finished if request_finished is None else request_finished
        return Delta(seq.request, new, seq.index, status.finish_reason, finished, lps)

    def _group_deltas(self, seq: Sequence) -> list[Delta]:
        """After a sequence of a group appended a token (or was stopped): what the client gets now."""
        g = groups.group_of(seq)
        if seq.status.finished:
            groups.retire(seq)
            if g.done:  # the request's timestamps are the root's, whichever sequence ended last
                seq.request.events["finished"] = time.time()
        if g.streams:
            return [self._delta(seq, g.done)]
        return groups.best_of(seq) if g.done else []

    def _apply_beam_step(self, step: groups.BeamStep) -> list[Delta]:
        request = step.request
        request.events.setdefault("first_token", time.time())
        for parent, child in step.forks:
            self.bm.fork(parent, child)
            self.running.append(child)
        for seq, token, score in step.appends:
            seq.token_ids.append(token)
            seq.cumulative_logprob = score
        for seq in step.ended:
            self.drop(seq, SequenceStatus.FINISHED_STOPPED)
        if step.deltas:
            request.events["finished"] = time.time()
        return step.deltas


def _remaining(seq: Sequence, cached: int = 0) -> int:
    """Tokens seq may compute now. A request about to fork stops one short of its prompt: each of its
    sequences computes the last prompt token itself (and so has its own logits to sample from)."""
    start = max(cached, seq.num_computed_tokens)
    g = seq.group
    hold = g is not None and not g.forked
    return seq.num_tokens - start - hold


def _insert(queue: list[Sequence], seq: Sequence) -> None:
    keys = [_order(s) for s in queue]
    queue.insert(bisect.bisect_right(keys, _order(seq)), seq)
