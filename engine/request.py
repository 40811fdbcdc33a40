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
        return (f"Request({self.request_id!r}, {self.status.name}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, blocks={self.block_table})")
