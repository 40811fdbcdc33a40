"""A request as the engine tracks it: one stream of token ids and the counters the scheduler closes.

There is no prefill or decode state: `num_computed_tokens` trails `num_tokens`, and the scheduler
hands out budget to close the gap (a new prompt, a chunk of one, a recompute after preemption and
a decode step are all "compute the next n tokens").
"""
from __future__ import annotations

import enum
from typing import Any

from shared.sampling import SamplingParams


class RequestStatus(enum.IntEnum):
    """Ordered: everything after PREEMPTED is a finished state."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5

    @property
    def finished(self) -> bool:
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> str | None:
        return _REASONS.get(self)


_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


class Request:
    __slots__ = (
        "request_id", "params", "priority", "arrival_time", "token_ids", "num_prompt_tokens",
        "num_computed_tokens", "num_cached_tokens", "block_table", "status", "num_sent_tokens",
        "generator", "stop_ids", "swapped", "just_resumed", "events",
        # Sharing and sampling extras (prefix caching, n / best_of / beam search, logprobs).
        "block_hashes", "index", "group", "cumulative_logprob", "logprobs", "plain",
        # Speculative decoding (engine/spec): drafts this step verifies, and how many were accepted.
        "speculate", "num_spec", "spec_token_ids", "spec_probs", "num_accepted", "draft_computed",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        arrival_time: float = 0.0,
        eos_token_ids: tuple[int, ...] = (),
    ) -> None:
        self.request_id = request_id
        self.params = params
        self.priority = priority
        self.arrival_time = arrival_time
        self.token_ids: list[int] = list(prompt_token_ids)  # prompt + output
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0  # tokens whose K/V are in the cache
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache
        self.block_table: list[int] = []
        self.status = RequestStatus.WAITING
        self.num_sent_tokens = 0  # output tokens already reported to the client
        self.generator: Any = None  # the sampler's per-request RNG when params.seed is set
        self.swapped = False  # block_table holds CPU swap-pool blocks
        self.just_resumed = False  # resumed after preemption and not yet advanced: not a victim again
        # Engine-stamped wall-clock times (time.time()): queued, scheduled, first_token, finished,
        # plus preempted (a count); sent with the final output so clients compute latencies.
        self.events: dict[str, float] = {}
        ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            ids.update(eos_token_ids)
        self.stop_ids = frozenset(ids)
        self.block_hashes: list[int] = []  # chained hashes of the full blocks of token_ids, in order
        self.index = 0  # which of the request's sequences this is
        self.group: SequenceGroup | None = None  # set when the request runs several sequences
        self.cumulative_logprob = 0.0
        self.logprobs: list[list] | None = [] if params.logprobs is not None else None
        # True when the sampler needs nothing but argmax: the per-step fast path checks one attribute.
        self.plain = params.greedy and not params.has_penalties and params.logprobs is None \
            and params.min_tokens == 0 and params.num_seqs == 1 and not params.use_beam_search
        if not (params.num_seqs == 1 and not params.use_beam_search):
            self.group = SequenceGroup(self)
        self.speculate = False  # set by the engine when it runs a proposer and this request may use it
        self.num_spec = 0  # drafts scheduled this step (0: a plain step)
        self.spec_token_ids: list[int] = []
        self.spec_probs: Any = None  # [num_spec, V] proposal probabilities; None = one-hot (or greedy)
        self.num_accepted = 0
        self.draft_computed = 0  # positions whose draft-model K/V this request has written

    def fork(self, index: int) -> Request:
        """A new sequence of the same request with the same tokens and counters; the caller shares the
        blocks through BlockManager.fork (the table is copied, the blocks are not)."""
        child = Request.__new__(Request)
        for name in Request.__slots__:
            setattr(child, name, getattr(self, name))
        child.token_ids = list(self.token_ids)
        child.block_table = list(self.block_table)
        child.block_hashes = list(self.block_hashes)
        child.events = dict(self.events)
        child.logprobs = None if self.logprobs is None else list(self.logprobs)
        child.generator = None
        child.index = index
        return child

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def seq_id(self) -> str:
        return self.request_id if self.index == 0 else f"{self.request_id}#{self.index}"

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.name}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, blocks={self.block_table})")


class SequenceGroup:
    """The sequences of one request that asked for several (n / best_of, beam search).

    The root sequence prefills the prompt up to its last token, then forks (`forked`); every sequence
    computes the last prompt token itself, copying the shared partial block on write. `streams`:
    each sequence's tokens go out as they come (n == best_of); otherwise outputs wait for the end.
    """

    __slots__ = ("root", "seqs", "finished", "forked", "streams", "beam")

    def __init__(self, root: Request) -> None:
        p = root.params
        self.root = root
        self.seqs: list[Request] = [root]  # live sequences
        self.finished: list[Request] = []
        self.forked = p.use_beam_search  # beams fork after every step instead, see engine/groups.py
        self.streams = not p.use_beam_search and p.num_seqs == p.n
        self.beam = BeamState() if p.use_beam_search else None

    @property
    def done(self) -> bool:
        return self.forked and not self.seqs


class BeamState:
    """Beam search bookkeeping of one request, as transformers keeps it per batch row."""

    __slots__ = ("pending", "finished", "improvable", "next_index")

    def __init__(self) -> None:
        # This step's (sampled logprob, top candidates) per live beam; the group steps when all are in.
        self.pending: dict[int, tuple[Request, tuple]] = {}
        self.finished: list[tuple[float, list[int], str]] = []  # (score, output ids, finish reason), best first
        self.improvable = True  # transformers' is_early_stop_heuristic_unsatisfied
        self.next_index = 1
