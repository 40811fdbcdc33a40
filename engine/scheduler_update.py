"""The scheduler's state and its second verb (engine/scheduler.py has the first): its queues, how a
request starts and ends in them, and `update`, which applies what a step computed: every scheduled
sequence advances, sampled tokens are appended (one per sequence the plan says samples, in plan
order), finished sequences stop and free their blocks, and each request's client gets its Delta.

`Scheduler` (engine/scheduler.py) is this class plus `schedule()`: the two files are one object, the
one writer of every sequence's tokens, counters and status, split where the step splits (decide what
runs / apply what ran). The modules it asks (engine/groups.py, engine/speculative/,
engine/pooling.py, engine/thinking.py, engine/structured.py) decide and return; this applies.
"""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from engine import groups, policy, pooling, prompt_logprobs, structured, thinking
from engine.block_manager import BlockManager
from engine.sequence import LogprobEntry, Sequence, SequenceStatus, stop_reason
from engine.speculative import SpecStats, computed_after
from engine.step import Delta, Drafts, StepOutput, StepPlan
from shared.config import SchedulerConfig

if TYPE_CHECKING:
    import torch

log = logging.getLogger("conveyor.scheduler")


class SchedulerUpdate:
    """The queues and update(); Scheduler (engine/scheduler.py) adds schedule()."""

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager,
                 max_model_len: int) -> None:
        self.config = config
        # the engine's limit, narrowed by model, backend, pool, draft
        self.max_model_len = max_model_len
        self.bm = block_manager
        self.spec_stats = SpecStats()
        self.waiting: list[Sequence] = []  # sorted by (priority, arrival_time)
        self.swapped: list[Sequence] = []  # sorted by (priority, arrival_time)
        self.running: list[Sequence] = []  # admission order
        self._moved = False  # this step admitted, resumed, forked or preempted a sequence

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
        """One streaming choice of a request ends early (a stop string in its text); the others go
        on."""
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

    def _fork(self, forks: list[tuple[Sequence, Sequence]]) -> None:
        """Each (parent, child): the child shares its parent's blocks and runs from now on."""
        self._moved = True
        for parent, child in forks:
            self.bm.fork(parent, child)
            self.running.append(child)

    # ---------------------------------------------------------------- update
    def update(self, plan: StepPlan, output: StepOutput) -> list[Delta]:
        """Apply what the step computed: advance every scheduled sequence, append the sampled tokens
        (one per sequence the plan says samples, in plan order), stop and free finished sequences.
        -> what each request's client gets. Anything that goes wrong for one request (its sampling,
        its beam scoring) ends that request with an error, not the step."""
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
        return [self._fail(seq, why) for seq in plan.seqs + plan.preempted
                if not seq.status.finished]

    def _fail(self, seq: Sequence, why: str) -> Delta:
        """seq's request ends with an error: every sequence of it stops and frees its blocks."""
        self.abort(seq)
        seq.request.events["finished"] = time.time()
        return Delta(seq.request, [], seq.index, "error", True, error=why)

    def _advance(self, seq: Sequence, n: int, drafts: Drafts | None, output: StepOutput,
                 sampled: int | None) -> list[Delta]:
        """seq computed its n scheduled tokens; sampled: its entry in output, if it sampled. A
        beam's candidates wait for its siblings': the last of them steps the search
        (engine/groups.py)."""
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
        """An embedding computed n more tokens: add its part (a preempted recompute starts afresh);
        its last chunk ends it at once, its blocks freed, with its pooled total."""
        seq.pooled = pooling.accumulate(seq.pooled if seq.num_computed_tokens else None, part)
        seq.num_computed_tokens += n
        if self.bm.window is not None:
            self.bm.release_out_of_window(seq)
        if seq.num_computed_tokens < seq.num_tokens:
            return []
        seq.status = SequenceStatus.FINISHED_STOPPED
        self._finish(seq)
        return [Delta(seq.request, [], seq.index, "stop", True, pooled=seq.pooled)]

    def _update_spec(self, seq: Sequence, num_drafts: int, accepted: tuple[int, ...],
                     token: int) -> None:
        """A verified step: the accepted drafts and the token after them join the sequence (up to a
        stop); the K/V of rejected drafts is dropped with the blocks that only they used."""
        before, drafted = seq.num_computed_tokens, seq.num_tokens + num_drafts - 1
        self.spec_stats.verified(num_drafts, len(accepted))
        if seq.draft_window is not None:
            seq.draft_window.verified(num_drafts, len(accepted))
        seq.just_resumed = False
        for t in (*accepted, token):
            self._append(seq, t, None)
            if seq.status.finished:
                break
        seq.num_computed_tokens, seq.draft_computed = computed_after(before, drafted, len(accepted),
                                                                     seq.num_tokens)
        if seq.status.finished:
            self._finish(seq)
            return
        # first, as before the window release (the free list's order)
        self.bm.trim(seq, seq.num_tokens)
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
        # the grammar is complete
        ended = seq.matcher is not None and structured.advance(seq, token)
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
        """After a sequence of a group appended a token (or was stopped): what the client gets
        now."""
        done, best = groups.settle(seq)
        # the request's timestamps are the root's, whichever ended last
        if done and seq.status.finished:
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

