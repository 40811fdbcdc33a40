"""Iteration-level scheduling: every step decides afresh which requests compute how many tokens.

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

Speculative decoding: a decoding request that may speculate asks the proposer for up to k drafts
(fewer near max_tokens, max_model_len or the end of the budget) and computes its last token plus
the drafts: the budget counts every verified token. Drafts never cause a preemption: when the
blocks for them are not free, the request decodes plainly. After verification the rejected
drafts' blocks go back to the pool.
"""
from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field

from engine import groups
from engine.block_manager import BlockManager
from engine.request import Request, RequestStatus
from engine.sampler import LogprobEntry
from engine.spec import Proposer
from shared.config import SchedulerConfig

# waiting_served_ratio's escape hatch (TGI's max_waiting_tokens): admit anyway after this many steps.
MAX_WAITING_STEPS = 20


@dataclass
class StepPlan:
    """What one step computes: requests[i] computes its next num_new_tokens[i] tokens, after the
    runner has copied the swap_out, then the swap_in, then the copy-on-write block pairs."""

    requests: list[Request] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device block, cpu block)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (cpu block, device block)
    copies: list[tuple[int, int]] = field(default_factory=list)  # (device block, device block)
    num_decode_tokens: int = 0
    num_spec_requests: int = 0  # requests verifying drafts this step

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def add(self, req: Request, n: int) -> None:
        if req.num_spec:
            self.num_decode_tokens += n
            self.num_spec_requests += 1
        elif n == 1 and req.num_prompt_tokens < len(req.token_ids) == req.num_computed_tokens + 1:
            self.num_decode_tokens += 1  # the next token of a request that has output already
        self.requests.append(req)
        self.num_new_tokens.append(n)

    def __bool__(self) -> bool:
        return bool(self.requests)


@dataclass(slots=True)
class Delta:
    """New tokens of one sequence. finish_reason: this sequence's; finished: the whole request's."""

    request: Request
    new_token_ids: list[int]
    index: int = 0
    finish_reason: str | None = None
    finished: bool = False
    logprobs: list[LogprobEntry] | None = None


def _order(req: Request) -> tuple[int, float]:
    return (req.priority, req.arrival_time)


def _victim_order(req: Request) -> tuple[int, int, float]:
    """The max is preempted: lowest priority, then least computed work, then latest arrival."""
    return (req.priority, -req.num_computed_tokens, req.arrival_time)


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, proposer: Proposer | None = None) -> None:
        self.config = config
        self.bm = block_manager
        self.proposer = proposer
        # Speculative decoding counters: verification steps (a request with drafts), drafts, accepted.
        self.spec_stats = {"spec_verifications": 0, "spec_draft_tokens": 0, "spec_accepted_tokens": 0}
        self.waiting: list[Request] = []  # sorted by (priority, arrival_time)
        self.swapped: list[Request] = []  # sorted by (priority, arrival_time)
        self.running: list[Request] = []  # admission order
        self.num_steps = 0
        self.steps_since_admission = 0
        self.num_preemptions = {"swap": 0, "recompute": 0}

    def add(self, req: Request) -> None:
        _insert(self.waiting, req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def abort(self, req: Request) -> None:
        for seq in (req.group.seqs if req.group else [req]):
            self.drop(seq, RequestStatus.FINISHED_ABORTED)
        req.status = RequestStatus.FINISHED_ABORTED
        if req.group:
            req.group.seqs = []

    def stop_sequence(self, seq: Request) -> list[Delta]:
        """One streaming choice of a request ends early (a stop string in its text); the others go on."""
        self.drop(seq, RequestStatus.FINISHED_STOPPED)
        return groups.deltas_of(seq)

    def drop(self, seq: Request, status: RequestStatus) -> None:
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
        if prompts_first and not plan.requests:  # nothing could be admitted after all
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
            req = self.running[i]
            n = self._chunk(_remaining(req), budget, others_waiting)
            if n == 0:  # a beam waiting for its siblings (preempted) before the group can step
                i += 1
                continue
            if req.speculate and n == 1 and self.proposer is not None:
                n += self._plan_drafts(req, budget - 1)
            if not self._reserve(req, n, plan, first_candidate=i):
                continue  # req itself was preempted; running[i] is now the next request
            plan.add(req, n)
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

    def _plan_drafts(self, req: Request, budget: int) -> int:
        """Drafts req verifies this step, if it is decoding: at most k, never past max_tokens or
        max_model_len, and none unless their blocks are free already."""
        p = req.params
        if req.num_computed_tokens != req.num_tokens - 1 or req.num_output_tokens < p.min_tokens:
            return 0
        k = min(self.proposer.k, budget, p.max_tokens - req.num_output_tokens - 1,
                self.config.max_model_len - req.num_tokens - 1)
        if k <= 0:
            return 0
        k = self.proposer.plan(req, k)
        if k and not self.bm.can_allocate(self.bm.num_new_blocks(req, req.num_tokens + k)):
            _drop_drafts(req)
            return 0
        return k

    def _reserve(self, req: Request, n: int, plan: StepPlan, first_candidate: int) -> bool:
        """Get blocks for req's next n tokens, preempting requests not yet served this step."""
        num_tokens = req.num_computed_tokens + n
        while need := self.bm.num_new_blocks(req, num_tokens):
            if self.bm.can_allocate(need):
                self.bm.allocate(req, num_tokens)
                return True
            candidates = self.running[first_candidate:]
            victim = max([r for r in candidates if not r.just_resumed] or candidates, key=_victim_order)
            self._preempt(victim, plan)
            if victim is req:
                return False
        return True  # its slots are there and its own already: most decode steps

    def _preempt(self, req: Request, plan: StepPlan) -> None:
        self.running.remove(req)
        _drop_drafts(req)
        req.draft_computed = 0  # draft K/V is neither swapped nor kept
        mode = self.config.preemption_mode
        if mode == "auto":
            mode = "swap" if self.bm.can_swap_out(req) else "recompute"
        if mode == "swap" and self.bm.can_swap_out(req):
            self.bm.do_swap_out(req)
            _insert(self.swapped, req)
        else:
            mode = "recompute"
            self.bm.free(req)
            req.num_computed_tokens = 0
            _insert(self.waiting, req)
        req.status = RequestStatus.PREEMPTED
        req.events["preempted"] = req.events.get("preempted", 0) + 1
        plan.preempted.append(req)
        self.num_preemptions[mode] += 1

    def _schedule_swapped(self, plan: StepPlan, budget: int) -> int:
        while self.swapped and self._room(budget):
            req = self.swapped[0]
            n = min(_remaining(req), budget)
            if not self.bm.can_swap_in(req, req.num_computed_tokens + n):
                break
            self.swapped.pop(0)
            self.bm.do_swap_in(req)
            self.bm.allocate(req, req.num_computed_tokens + n)
            self._start(req, plan, n)
            budget -= n
        return budget

    def _schedule_waiting(self, plan: StepPlan, budget: int) -> int:
        cfg = self.config
        long_prefills = sum(r.num_tokens - r.num_computed_tokens > cfg.long_prefill_threshold for r in self.running)
        i = 0
        while i < len(self.waiting) and self._room(budget):
            req = self.waiting[i]
            hit = self.bm.lookup(req)
            cached = hit.num_tokens(self.bm.block_size)
            remaining = _remaining(req, cached)
            is_long = remaining > cfg.long_prefill_threshold
            if is_long and long_prefills >= cfg.max_long_prefills:
                i += 1  # let shorter prompts behind it get their first token
                continue
            if cfg.prefill_policy == "mixed" and remaining > budget and plan.requests:
                break  # a prompt joins only whole, unless it alone exceeds the budget
            n = self._chunk(remaining, budget, others_waiting=len(self.waiting) > 1)
            if req.block_table:  # holds shared blocks already (a forked sequence): no prefix lookup
                if not self.bm.can_allocate(self.bm.num_new_blocks(req, req.num_computed_tokens + n)):
                    break
                self.bm.allocate(req, req.num_computed_tokens + n)
            else:
                if not self.bm.can_allocate_hit(hit, cached + n):
                    break  # FCFS within what fits: a later request does not overtake for memory
                self.bm.allocate_hit(req, hit, cached + n)
            self.waiting.pop(i)
            long_prefills += is_long
            self._start(req, plan, n)
            budget -= n
            self.steps_since_admission = 0
            if groups.ready_to_fork(req):  # its prompt is cached but for the last token
                self.running += groups.fork(req, self.bm)
        return budget

    def _start(self, req: Request, plan: StepPlan, n: int) -> None:
        req.just_resumed = req.status == RequestStatus.PREEMPTED
        req.status = RequestStatus.RUNNING
        req.events.setdefault("scheduled", time.time())
        self.running.append(req)
        if n:  # 0: a request about to fork whose prompt is cached but for the last token
            plan.add(req, n)

    # ---------------------------------------------------------------- update
    def update(self, plan: StepPlan, sampled: list[int], max_model_len: int,
               logprobs: list[LogprobEntry | None] | None = None) -> list[Delta]:
        """Advance every scheduled request; sampled holds one token per request that reached the
        end of its known tokens this step, in plan order (logprobs, when given, one entry per token).
        Returns the deltas; frees finished sequences."""
        deltas: list[Delta] = []
        beams: dict[int, list[tuple[Request, LogprobEntry]]] = {}
        bs, caching = self.bm.block_size, self.bm.enable_prefix_caching
        j = 0
        for req, n in zip(plan.requests, plan.num_new_tokens):
            if req.num_spec:
                self._update_spec(req, sampled[j], max_model_len)
                j += 1
                deltas.append(_delta(req))
                continue
            before = req.num_computed_tokens
            req.num_computed_tokens = computed = before + n
            if caching and computed // bs > before // bs:
                self.bm.cache_blocks(req, before)
            if computed < len(req.token_ids):
                if groups.ready_to_fork(req):  # a chunk that ends one short of the prompt
                    self.running += groups.fork(req, self.bm)
                continue  # a prompt chunk that does not reach the end samples nothing
            token, entry = sampled[j], logprobs[j] if logprobs else None
            j += 1
            req.just_resumed = False
            if req.group is not None and req.group.beam is not None:
                beams.setdefault(id(req.group), []).append((req, entry))
                continue
            self._append(req, token, entry, max_model_len)
            if req.status.finished:
                req.events["finished"] = time.time()
                self.running.remove(req)
                self.bm.free(req)
            if req.group is None:
                deltas.append(_delta(req))
            else:
                deltas += groups.deltas_of(req)
        assert j == len(sampled)
        for cands in beams.values():
            deltas += groups.beam_step(cands, self, max_model_len)
        return deltas

    def _update_spec(self, req: Request, token: int, max_model_len: int) -> None:
        """A verified step: the accepted drafts and the token after them join the sequence (up to a
        stop); the K/V of rejected drafts is dropped with the blocks that only they used."""
        before, a = req.num_computed_tokens, req.num_accepted
        st = self.spec_stats
        st["spec_verifications"] += 1
        st["spec_draft_tokens"] += req.num_spec
        st["spec_accepted_tokens"] += a
        tokens = req.spec_token_ids[:a] + [token]
        _drop_drafts(req)
        req.just_resumed = False
        for t in tokens:
            self._append(req, t, None, max_model_len)
            if req.status.finished:
                break
        req.num_computed_tokens = min(before + 1 + a, req.num_tokens - 1)
        req.draft_computed = min(req.draft_computed, req.num_computed_tokens)
        if req.status.finished:
            req.events["finished"] = time.time()
            self.running.remove(req)
            self.bm.free(req)
            return
        if self.bm.enable_prefix_caching:
            self.bm.cache_blocks(req, before)
        self.bm.trim(req, req.num_tokens)

    def _append(self, req: Request, token: int, entry: LogprobEntry | None, max_model_len: int) -> None:
        req.token_ids.append(token)
        if entry is not None:
            req.cumulative_logprob += entry[0]
            if req.logprobs is not None:
                req.logprobs.append(entry)
        if req.num_sent_tokens == 0:
            req.events.setdefault("first_token", time.time())
        self._check_stop(req, token, max_model_len)

    @staticmethod
    def _check_stop(req: Request, token: int, max_model_len: int) -> None:
        p, num_tokens = req.params, len(req.token_ids)
        num_output = num_tokens - req.num_prompt_tokens
        if token in req.stop_ids and num_output > p.min_tokens:
            req.status = RequestStatus.FINISHED_STOPPED
        elif num_output >= p.max_tokens or num_tokens >= max_model_len:
            req.status = RequestStatus.FINISHED_LENGTH


def _delta(req: Request) -> Delta:
    """The tokens (and logprobs) of a single-sequence request not yet sent."""
    new = req.token_ids[req.num_prompt_tokens + req.num_sent_tokens:]
    lps = req.logprobs[req.num_sent_tokens:] if req.logprobs is not None else None
    req.num_sent_tokens += len(new)
    status = req.status
    return Delta(req, new, 0, status.finish_reason, status.finished, lps)


def _drop_drafts(req: Request) -> None:
    req.num_spec = 0
    req.spec_token_ids = []
    req.spec_probs = None


def _remaining(req: Request, cached: int = 0) -> int:
    """Tokens req may compute now. A request about to fork stops one short of its prompt: each of its
    sequences computes the last prompt token itself (and so has its own logits to sample from)."""
    start = max(cached, req.num_computed_tokens)
    hold = req.group is not None and not req.group.forked
    return req.num_tokens - start - hold


def _insert(queue: list[Request], req: Request) -> None:
    keys = [_order(r) for r in queue]
    queue.insert(bisect.bisect_right(keys, _order(req)), req)
