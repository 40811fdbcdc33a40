"""Admission control: a request is refused with 429 and Retry-After before anything is queued, so no
queue in front of the engine ever grows without bound.

Three caps, checked in order:
- concurrent requests this gateway serves (streams open, responses pending);
- waiting requests: admitted but without a first token yet (queued or prefilling in the engine).
  This gateway knows its own exactly; the engine's STATS (polled while requests run) adds the ones
  other gateways sent, so the larger of the two counts;
- queued prompt tokens of those waiting requests: a few huge prompts block the queue as much as many
  small ones. A prompt alone above the cap is still admitted into an empty queue, or it never would
  be.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

from shared.errors import Overloaded


@dataclass(frozen=True)
class Limits:
    max_concurrent_requests: int = 1024
    max_waiting_requests: int = 256
    max_queued_prompt_tokens: int = 262144

    def __post_init__(self) -> None:
        for name in ("max_concurrent_requests", "max_waiting_requests", "max_queued_prompt_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")


class Admission:
    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self.in_flight: set[str] = set()
        self.waiting: dict[str, int] = {}  # request_id -> prompt tokens, until its first output
        self.queued_tokens = 0
        self.engine_waiting = 0.0  # from the engine's latest STATS
        self.engine_stats_time = 0.0
        # seconds from admission to first output, smoothed: the Retry-After hint
        self._wait_ewma = 1.0
        self._admitted_at: dict[str, float] = {}

    def admit(self, request_id: str, num_prompt_tokens: int) -> None:
        """Raises Overloaded (429) with `retry_after` seconds, or counts the request in."""
        lim = self.limits
        if len(self.in_flight) >= lim.max_concurrent_requests:
            raise self._overloaded("concurrent",
                                   f"{len(self.in_flight)} requests are in flight, the limit of "
                                   "this gateway (--max-concurrent-requests)")
        waiting = max(len(self.waiting), self._engine_waiting())
        if waiting >= lim.max_waiting_requests:
            raise self._overloaded("waiting",
                                   f"{int(waiting)} requests are waiting for the engine, the limit "
                                   "(--max-waiting-requests)")
        queued = self.queued_tokens + num_prompt_tokens
        if self.queued_tokens and queued > lim.max_queued_prompt_tokens:
            raise self._overloaded("prompt_tokens",
                                   f"{self.queued_tokens} prompt tokens are queued; "
                                   f"{num_prompt_tokens} more would pass the limit of "
                                   f"{lim.max_queued_prompt_tokens} (--max-queued-prompt-tokens)")
        self.in_flight.add(request_id)
        self.waiting[request_id] = num_prompt_tokens
        self.queued_tokens += num_prompt_tokens
        self._admitted_at[request_id] = time.monotonic()

    def started(self, request_id: str) -> None:
        """The request's first output arrived: it no longer waits."""
        n = self.waiting.pop(request_id, None)
        if n is not None:
            self.queued_tokens -= n
            t0 = self._admitted_at.pop(request_id, None)
            if t0 is not None:
                self._wait_ewma = 0.9 * self._wait_ewma + 0.1 * (time.monotonic() - t0)

    def release(self, request_id: str) -> None:
        """Idempotent: the request is over, however it ended."""
        self.started(request_id)
        self._admitted_at.pop(request_id, None)
        self.in_flight.discard(request_id)

    def update_engine(self, stats: dict[str, float]) -> None:
        self.engine_waiting = float(stats.get("num_waiting", 0.0))
        self.engine_stats_time = time.monotonic()

    def _engine_waiting(self) -> float:
        # A stale engine figure (nothing polled for a while: this gateway was idle) must not block
        # anyone.
        return self.engine_waiting if time.monotonic() - self.engine_stats_time < 2.0 else 0.0

    def retry_after(self) -> int:
        return max(1, min(60, math.ceil(self._wait_ewma)))

    def _overloaded(self, reason: str, message: str) -> Overloaded:
        return Overloaded(f"server overloaded: {message}; retry later",
                          retry_after=self.retry_after(), reason=reason)
