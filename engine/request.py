"""A request as the user sent it: identity, sampling parameters, the prompt, and what the engine
reports about it (event times, cached prompt tokens). It knows nothing of how it is computed: the
sequences that compute it are engine/sequence.py.

Only the scheduler writes `events`, `num_cached_tokens` and `prompt_scores` after the request is
made.
"""
from __future__ import annotations

from shared.embedding import PoolingParams
from shared.sampling import SamplingParams

# Prompt token j's entry (j >= 1): (its logprob, its rank (1 = the most likely), the top k as
# [(id, logprob)]).
PromptEntry = tuple[float, int, list[tuple[int, float]]]


class PromptScores:
    """One request's prompt logprobs so far: entries[j - 1] scores prompt token j
    (token 0 has none). Written by the scheduler alone (engine/scheduler.py, through
    `record` and `attach` below)."""

    __slots__ = ("k", "entries", "sent")

    def __init__(self, k: int) -> None:
        self.k = k  # top alternatives per position
        self.entries: list[PromptEntry] = []
        self.sent: set[int] = set()  # the choices (indexes) whose first output row carried them


class Request:
    __slots__ = ("request_id", "params", "priority", "arrival_time", "prompt_token_ids", "stop_ids",
                 "plain", "speculate", "events", "num_cached_tokens", "prompt_scores", "pooling")

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 priority: int = 0, arrival_time: float = 0.0, eos_token_ids: tuple[int, ...] = (),
                 speculate: bool = False, pooling: PoolingParams | None = None) -> None:
        self.request_id = request_id
        self.params = params
        self.priority = priority
        self.arrival_time = arrival_time
        self.prompt_token_ids = tuple(prompt_token_ids)
        ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            ids.update(eos_token_ids)
        self.stop_ids = frozenset(ids)
        # True when the sampler needs nothing but argmax: the per-step fast path checks one
        # attribute.
        self.plain = params.greedy and not params.has_penalties and params.logprobs is None \
            and params.min_tokens == 0 and params.one_sequence and params.constraint is None \
            and params.thinking_token_budget is None
        self.speculate = speculate  # the engine runs a proposer and this request may use it
        # Engine-stamped wall-clock times (time.time()): queued, scheduled, first_token, finished,
        # plus preempted (a count); sent with the final output so clients compute latencies.
        self.events: dict[str, float] = {}
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache at first admission
        # Prompt logprobs asked for (engine/prompt_logprobs.py): the scheduler appends them as
        # chunks compute.
        self.prompt_scores = (None if params.prompt_logprobs is None
                              else PromptScores(params.prompt_logprobs))
        self.pooling = pooling  # an embedding: prefilled, pooled, never sampled (engine/pooling.py)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def __repr__(self) -> str:
        return f"Request({self.request_id!r}, prompt={self.num_prompt_tokens})"
