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

Sliding windows: when every layer of the model has one, each sequence gives back the blocks its
window has passed after every step it computes (BlockManager.release_out_of_window), so what a
running sequence needs stays its window plus its next tokens. The accounting does not change: a
table keeps one entry per block of the context, released ones included, so num_new_blocks still
counts exactly the blocks to allocate.
"""
from __future__ import annotations

import bisect
import logging
import time
from typing import TYPE_CHECKING

from engine import groups, pooling, prompt_logprobs, structured
from engine.block_manager import BlockManager, PrefixHit
from engine.sequence import LogprobEntry, Sequence, SequenceStatus
from engine.speculative import Proposer
from engine.step import Delta, Drafts, StepOutput, StepPlan
from shared.config import SchedulerConfig

if TYPE_CHECKING:
    import torch

log = logging.getLogger("conveyor.scheduler")

# waiting_served_ratio's escape hatch (TGI's max_waiting_tokens): admit anyway after this many steps.
MAX_WAITING_STEPS = 20


def _order(seq: Sequence) -> tuple[int, float]:
    return (seq.request.priority, seq.request.arrival_time)


def _victim_order(seq: Sequence) -> tuple[int, int, float]:
    """The max is preempted: lowest priority, then least computed work, then latest arrival."""
    return (seq.request.priority, -seq.num_computed_tokens, seq.request.arrival_time)


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, max_model_len: int,
                 proposer: Proposer | None = None) -> None:
        self.config = config
        self.max_model_len = max_model_len  # the engine's limit, narrowed by model, backend, pool, draft
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
        self.num_stalled_steps = 0
        self._moved = False

    def add(self, seq: Sequence) -> None:
        if seq.group is not None:
            groups.start(seq)
        _insert(self.waiting, seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def abort(self, seq: Sequence) -> None:
        """Every live sequence of seq's request ends, its blocks freed."""
        g = seq.group
        for s in (list(g.seqs) if g is not None else [seq]):
            self.drop(s, SequenceStatus.FINISHED_ABORTED)
        seq.status = SequenceStatus.FINISHED_ABORTED
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
        plan.swap_out, plan.swap_in, plan.copies = self.bm.swap_out, self.bm.swap_in, self.bm.copies
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
        planned: set[int] = set()  # beams served ahead of their place, with the first of their group
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if planned and id(seq) in planned:
                i += 1
                continue
            unit = self._unit(seq)
            ns, left = [], budget
            for s in unit:
                n = self._chunk(_remaining(s), left, others_waiting)
                ns.append(n)
                left -= n
            if not any(ns):  # beams that computed this step's token and wait for the group to step
                i += 1
                continue
            drafts = None
            if len(unit) == 1 and seq.request.speculate and ns[0] == 1 and self.proposer is not None:
                drafts = self._plan_drafts(seq, budget - 1)
                ns[0] += drafts.num if drafts is not None else 0
            if not self._reserve(unit, ns, plan, i, planned):
                continue  # the unit itself was preempted; running[i] is now the next sequence
            for s, n in zip(unit, ns):
                if n:
                    plan.add(s, n, drafts if s is seq else None)
            if len(unit) > 1:
                planned.update(map(id, unit))
            budget -= sum(ns)
            i += 1
        return budget

    def _unit(self, seq: Sequence) -> list[Sequence]:
        """seq and the sequences that move with it: every live beam of its request. Beams step together,
        so one preempted alone would hold its siblings (and their blocks) until it came back."""
        g = seq.group
        return list(g.seqs) if g is not None and g.beam is not None else [seq]

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
                self.max_model_len - seq.num_tokens - 1)
        if k <= 0:
            return None
        drafts = self.proposer.plan(seq, k)
        if not drafts.num or not self.bm.can_allocate(self.bm.num_new_blocks(seq, seq.num_tokens + drafts.num)):
            return None
        return drafts

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
            victim = max([s for s in candidates if not s.just_resumed] or candidates, key=_victim_order)
            victims = self._unit(victim)
            self._preempt(victims, plan)
            if unit[0] in victims:
                return False
        return True  # its slots are there and its own already: most decode steps

    def _preempt(self, seqs: list[Sequence], plan: StepPlan) -> None:
        """seqs (one sequence, or a request's beams) leave the batch together, swapped or to recompute."""
        for seq in seqs:
            self.running.remove(seq)
            seq.draft_computed = 0  # draft K/V is neither swapped nor kept
        mode = self.config.preemption_mode
        if mode == "auto":
            mode = "swap" if self.bm.can_swap_out(seqs) else "recompute"
        if mode == "swap" and self.bm.can_swap_out(seqs):
            self.bm.do_swap_out(seqs)
        else:
            mode = "recompute"
            for seq in seqs:
                self.bm.free(seq)
                seq.num_computed_tokens = 0
        for seq in seqs:
            _insert(self.swapped if mode == "swap" else self.waiting, seq)
            seq.status = SequenceStatus.PREEMPTED
            plan.preempted.append(seq)
        events = seqs[0].request.events
        events["preempted"] = events.get("preempted", 0) + 1
        self.num_preemptions[mode] += len(seqs)
        self._moved = True

    def _schedule_swapped(self, plan: StepPlan, budget: int) -> int:
        while self.swapped and budget > 0:
            unit = self._unit(self.swapped[0])
            if len(self.running) + len(unit) > self.config.max_num_seqs:
                break
            ns, left = [], budget
            for s in unit:
                ns.append(min(_remaining(s), left))
                left -= ns[-1]
            if not self.bm.can_swap_in(unit, [s.num_computed_tokens + n for s, n in zip(unit, ns)]):
                break
            self.bm.do_swap_in(unit)
            for s, n in zip(unit, ns):
                self.swapped.remove(s)
                if n:
                    self.bm.allocate(s, s.num_computed_tokens + n)
                self._start(s, plan, n)
            budget -= sum(ns)
        return budget

    def _schedule_waiting(self, plan: StepPlan, budget: int) -> int:
        cfg = self.config
        long_prefills = sum(s.num_tokens - s.num_computed_tokens > cfg.long_prefill_threshold for s in self.running)
        i = 0
        while i < len(self.waiting) and self._room(budget):
            seq = self.waiting[i]
            unit = self._unit(seq)
            if len(unit) > 1:  # a request's beams, back from a recompute: all of them or none
                used = self._admit_beams(unit, plan, budget)
                if used is None:
                    break
                budget -= used
                continue
            # An embedding pools every row, so it never starts on a cached prefix (engine/pooling.py).
            hit = self.bm.lookup(seq) if seq.request.pooling is None else PrefixHit()
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

    def _admit_beams(self, beams: list[Sequence], plan: StepPlan, budget: int) -> int | None:
        """Start the recompute of a request's beams together. -> tokens planned, or None when they do
        not fit now. No prefix lookup: the beams' own blocks were freed, and a hit would only save time."""
        ns, left = [], budget
        for s in beams:
            ns.append(self._chunk(_remaining(s), left, others_waiting=True))
            left -= ns[-1]
        fits = self.bm.can_allocate(sum(self.bm.blocks_for(n) for n in ns))
        if not fits or len(self.running) + len(beams) > self.config.max_num_seqs:
            return None
        for s, n in zip(beams, ns):
            self.waiting.remove(s)
            self.bm.allocate(s, n)
            self._start(s, plan, n)
        self.steps_since_admission = 0
        return sum(ns)

    def _start(self, seq: Sequence, plan: StepPlan, n: int) -> None:
        seq.just_resumed = seq.status == SequenceStatus.PREEMPTED
        seq.status = SequenceStatus.RUNNING
        seq.request.events.setdefault("scheduled", time.time())
        self.running.append(seq)
        self._moved = True
        if n:  # 0: a request about to fork whose prompt is cached but for the last token
            plan.add(seq, n)

    def _fork(self, root: Sequence) -> None:
        self._moved = True
        for child in groups.fork(root):
            self.bm.fork(root, child)
            self.running.append(child)

    # ---------------------------------------------------------------- update
    def update(self, plan: StepPlan, output: StepOutput) -> list[Delta]:
        """Apply what the step computed: advance every scheduled sequence, append the sampled tokens
        (one per sequence that reached the end of its known tokens, in plan order), stop and free
        finished sequences. -> what each request's client gets. Anything that goes wrong for one
        request (its sampling, its beam scoring) ends that request with an error, not the step."""
        deltas: list[Delta] = []
        beams: dict[int, list[tuple[Sequence, LogprobEntry]]] = {}
        prompt_logprobs.record(plan, output)
        j = 0
        for i, (seq, n) in enumerate(zip(plan.seqs, plan.num_new_tokens)):
            if seq.request.pooling is not None:  # an embedding's chunk: pooled, never sampled
                deltas += self._pooled(seq, n, output.pooled.get(i))
                continue
            drafts = plan.drafts.get(i) if plan.drafts else None
            sampled = j if drafts is not None or seq.num_computed_tokens + n >= len(seq.token_ids) else None
            j += sampled is not None
            if seq.status.finished:
                continue  # its request failed earlier in this step
            if output.errors and sampled in output.errors:
                deltas.append(self._fail(seq, output.errors[sampled]))
                continue
            try:
                deltas += self._advance(seq, n, drafts, output, sampled, beams)
            except Exception as e:
                log.exception("request %s: applying its step failed", seq.request.request_id)
                deltas.append(self._fail(seq, f"{type(e).__name__}: {e}"))
        assert j == len(output.tokens)
        for cands in beams.values():
            if cands[0][0].status.finished:
                continue
            try:
                step = groups.beam_step(cands, self.max_model_len)
                deltas += self._apply_beam_step(step) if step is not None else []
            except Exception as e:
                log.exception("request %s: beam search failed", cands[0][0].request.request_id)
                deltas.append(self._fail(cands[0][0], f"{type(e).__name__}: {e}"))
        prompt_logprobs.attach(deltas)
        return deltas

    def fail(self, plan: StepPlan, why: str) -> list[Delta]:
        """The step itself failed (its forward): every request it computed or preempted ends with an
        error, its blocks freed; the other requests go on. -> one error delta per request."""
        deltas = []
        for seq in plan.seqs + plan.preempted:
            if not seq.status.finished:
                deltas.append(self._fail(seq, why))
        return deltas

    def _fail(self, seq: Sequence, why: str) -> Delta:
        """seq's request ends with an error: every sequence of it stops and frees its blocks."""
        self.abort(seq)
        seq.request.events["finished"] = time.time()
        return Delta(seq.request, [], seq.index, "error", True, error=why)

    def _advance(self, seq: Sequence, n: int, drafts: Drafts | None, output: StepOutput, sampled: int | None,
                 beams: dict[int, list[tuple[Sequence, LogprobEntry]]]) -> list[Delta]:
        """seq computed its n scheduled tokens; sampled: its entry in output, if it sampled."""
        if drafts is not None:
            assert output.accepted is not None and sampled is not None
            self._update_spec(seq, drafts.num, output.accepted[sampled], output.tokens[sampled])
            return [self._delta(seq)]
        before = seq.num_computed_tokens
        seq.num_computed_tokens = computed = before + n
        if self.bm.enable_prefix_caching and computed // self.bm.block_size > before // self.bm.block_size:
            self.bm.cache_blocks(seq, before)  # before the release below: a released block keeps its name
        if self.bm.window is not None:
            self.bm.release_out_of_window(seq)
        if sampled is None:  # a prompt chunk that does not reach the end samples nothing
            if groups.ready_to_fork(seq):  # a chunk that ends one short of the prompt
                self._fork(seq)
            return []
        token, entry = output.tokens[sampled], output.logprobs[sampled] if output.logprobs else None
        seq.just_resumed = False
        g = seq.group
        if g is not None and g.beam is not None:
            assert entry is not None, "the sampler gives every beam its candidates"
            beams.setdefault(id(g), []).append((seq, entry))
            return []
        self._append(seq, token, entry)
        if seq.status.finished:
            self._finish(seq)
        return self._group_deltas(seq) if g is not None else [self._delta(seq)]

    def _pooled(self, seq: Sequence, n: int, part: torch.Tensor | None) -> list[Delta]:
        """An embedding computed n more tokens: add its part (a preempted recompute starts afresh); its
        last chunk ends it at once, its blocks freed, with its pooled total."""
        if seq.status.finished:
            return []
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
        if self.bm.window is not None:
            self.bm.release_out_of_window(seq)

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
        ended = seq.matcher is not None and structured.advance(seq, token)  # the grammar is complete
        if ended or (token in seq.stop_ids and num_output > p.min_tokens):
            seq.status = SequenceStatus.FINISHED_STOPPED
        elif num_output >= p.max_tokens or num_tokens >= self.max_model_len:
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
