"""A sequence: one stream of token ids the scheduler computes, and the counters it closes.

There is no prefill or decode state: `num_computed_tokens` trails `num_tokens`, and the scheduler
hands out budget to close the gap (a new prompt, a chunk of one, a recompute after preemption and
a decode step are all "compute the next n tokens").

One writer per field: the scheduler writes the tokens, counters, status and logprob state; the
block manager writes `block_table`, `released_blocks`, `swapped` and `block_hashes` (the blocks are
its to own).
A request that runs several sequences (n / best_of, beam search) has one SequenceGroup, which
every one of its sequences points to.
"""
from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Any

from engine.request import Request
from shared import thinking
from shared.sampling import SamplingParams

if TYPE_CHECKING:
    from engine.speculative.window import DraftWindow

# One logprob entry per sampled token: (logprob of the sampled token, [(token id, logprob), ...] top
# k).
LogprobEntry = tuple[float, list[tuple[int, float]]]


class SequenceStatus(enum.IntEnum):
    """Ordered: everything after PREEMPTED is a finished state."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5

    @property
    def finished(self) -> bool:
        return self > SequenceStatus.PREEMPTED

    @property
    def finish_reason(self) -> str | None:
        return _REASONS.get(self)


_REASONS = {
    SequenceStatus.FINISHED_STOPPED: "stop",
    SequenceStatus.FINISHED_LENGTH: "length",
    SequenceStatus.FINISHED_ABORTED: "abort",
}


class Sequence:
    __slots__ = ("request", "index", "token_ids", "num_prompt_tokens", "num_computed_tokens",
                 "num_sent_tokens", "status", "just_resumed", "cumulative_logprob", "logprobs",
                 "draft_computed", "group", "block_table", "released_blocks", "swapped",
                 "block_hashes", "matcher", "pooled", "thinking", "draft_window")

    def __init__(self, request: Request, index: int = 0) -> None:
        self.request = request
        self.index = index  # which of the request's choices this is
        self.token_ids: list[int] = list(request.prompt_token_ids)  # prompt + output
        self.num_prompt_tokens = len(self.token_ids)
        self.num_computed_tokens = 0  # tokens whose K/V are in the cache
        self.num_sent_tokens = 0  # output tokens already reported to the client
        self.status = SequenceStatus.WAITING
        # resumed after preemption and not yet advanced: not a victim again
        self.just_resumed = False
        self.cumulative_logprob = 0.0
        wants_logprobs = request.params.logprobs is not None
        self.logprobs: list[LogprobEntry] | None = [] if wants_logprobs else None
        self.draft_computed = 0  # positions whose draft-model K/V this sequence has written
        # how many drafts it proposes next (engine/speculative/window.py); set at its first chance
        self.draft_window: DraftWindow | None = None
        # forks share it
        self.group = None if request.params.one_sequence else SequenceGroup(request.params)
        self.block_table: list[int] = []
        # Leading entries of block_table released because every layer's sliding window has passed
        # them: they name the block manager's placeholder, not a block this sequence holds.
        self.released_blocks = 0
        self.swapped = False  # block_table holds CPU swap-pool blocks
        # chained hashes of the full blocks of token_ids, in order
        self.block_hashes: list[int] = []
        # Structured output: an xgrammar GrammarMatcher that has consumed exactly the output tokens
        # (engine/structured.py), set when the grammar is compiled; advanced by the scheduler alone.
        self.matcher: Any = None
        # An embedding's pooled rows so far (engine/pooling.py accumulate); the scheduler writes it.
        self.pooled: Any = None
        # A thinking budget's state (engine/thinking.py): where the reasoning began, None once it
        # ended or without a budget; advanced by the scheduler with each token it appends.
        p = request.params
        self.thinking = None if p.thinking_token_budget is None else thinking.initial(
            p.reasoning_start_ids, p.reasoning_end_ids, self.num_prompt_tokens)

    def fork(self, index: int) -> Sequence:
        """A new sequence of the same request with the same tokens and counters; the block manager
        shares the blocks (BlockManager.fork: the table is copied, the blocks are not)."""
        child = Sequence.__new__(Sequence)
        for name in Sequence.__slots__:
            setattr(child, name, getattr(self, name))
        child.index = index
        child.token_ids = list(self.token_ids)
        child.logprobs = None if self.logprobs is None else list(self.logprobs)
        child.block_table = list(self.block_table)
        child.block_hashes = list(self.block_hashes)
        # its own grammar state
        child.matcher = None if self.matcher is None else self.matcher.fork()
        return child

    # What the sequence's request says, read on the per-step path.
    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def stop_ids(self) -> frozenset[int]:
        return self.request.stop_ids

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    def __repr__(self) -> str:
        return (f"Sequence({self.request.request_id!r}#{self.index}, {self.status.name}, "
                f"tokens={self.num_tokens}, computed={self.num_computed_tokens}, "
                f"blocks={self.block_table})")


def stop_reason(seq: Sequence, token: int, max_model_len: int) -> str | None:
    """Why seq ends once it appends token: "stop" (a stop token past min_tokens), "length"
    (max_tokens or max_model_len reached), or None. Stop strings are the gateway's; a
    grammar's end, structured's."""
    p, num_tokens = seq.params, seq.num_tokens + 1
    num_output = num_tokens - seq.num_prompt_tokens
    if token in seq.stop_ids and num_output > p.min_tokens:
        return "stop"
    return "length" if num_output >= p.max_tokens or num_tokens >= max_model_len else None


class SequenceGroup:
    """The sequences of one request that asked for several (n / best_of, beam search).

    The root sequence prefills the prompt up to its last token, then forks (`forked`); every
    sequence computes the last prompt token itself, copying the shared partial block on write.
    `streams`: each sequence's tokens go out as they come (n == best_of); otherwise outputs wait for
    the end. `seqs` and `finished` are written by engine/groups.py alone, on the scheduler's behalf.
    """

    __slots__ = ("seqs", "finished", "forked", "streams", "beam")

    def __init__(self, params: SamplingParams) -> None:
        self.seqs: list[Sequence] = []  # live sequences, the root first
        self.finished: list[Sequence] = []
        # beams fork after every step instead, see engine/groups.py
        self.forked = params.use_beam_search
        self.streams = not params.use_beam_search and params.num_seqs == params.n
        self.beam = BeamState() if params.use_beam_search else None

    @property
    def done(self) -> bool:
        return self.forked and not self.seqs


class BeamState:
    """Beam search bookkeeping of one request, as transformers keeps it per batch row."""

    __slots__ = ("pending", "finished", "improvable", "next_index")

    def __init__(self) -> None:
        # This step's candidates per live beam (keyed by id()); the group steps when all are in.
        self.pending: dict[int, tuple[Sequence, list[tuple[int, float]]]] = {}
        # (score, output ids, finish reason), best first
        self.finished: list[tuple[float, list[int], str]] = []
        self.improvable = True  # transformers' is_early_stop_heuristic_unsatisfied
        self.next_index = 1
