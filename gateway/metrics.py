"""Prometheus metrics: the gateway's own per-request accounting plus the engine's STATS gauges.

TTFT, queue time and end-to-end latency come from the engine's per-request timestamps, which its
final output carries (`events`: queued, scheduled, first_token, finished; all on one engine clock,
so a gateway on another machine measures the same thing). Inter-token latency comes from when each
output reaches this process (before any merging for a slow reader): the engine stamps requests, not
steps. A request without engine timestamps (one the client abandoned) falls back to this process's
clock; `conveyor_latency_source_engine` says which was used last.

Several gateway workers (`--gateway-workers N`) share one port and so one /metrics: with
PROMETHEUS_MULTIPROC_DIR set, counters and histograms of every worker are summed at scrape time
(prometheus-client's multiprocess mode), and the engine's gauges are asked fresh of the engine
(gateway/engine_metrics.py exports them).
"""
from __future__ import annotations

import bisect
import math
import os
import time
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from gateway.engine_metrics import EngineCollector, ReplicaRow
from shared.protocol import RequestOutput

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15,
               0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
               240.0, 480.0)


def multiprocess_dir() -> str | None:
    # prometheus_client reads both spellings
    lower = os.environ.get("prometheus_multiproc_dir")  # noqa: SIM112
    return os.environ.get("PROMETHEUS_MULTIPROC_DIR") or lower


@dataclass(slots=True)
class _Live:
    """One request in flight, on this process's monotonic clock."""

    start: float  # when the request was admitted
    first: float | None = None  # when its first token arrived
    # When each choice's latest token arrived: with n > 1 the choices step side by side, and a gap
    # is only inter-token between tokens of the same choice.
    last: dict[int, float] = field(default_factory=dict)
    # the engine's per-request timestamps, with its final output
    events: dict[str, float] | None = None


class _LocalHistogram:
    """Observations counted here (a bisect and two adds, no lock), added to a prometheus
    Histogram by flush(): per-token observations are the gateway's hottest path at thousands
    of tokens per second."""

    def __init__(self, hist: Histogram, buckets: tuple[float, ...]) -> None:
        self.hist = hist
        self.bounds = [*buckets, math.inf]
        self.counts = [0] * len(self.bounds)
        self.sum = 0.0

    def observe(self, value: float, times: int = 1) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += times
        self.sum += value * times

    def flush(self) -> None:
        counts, self.counts = self.counts, [0] * len(self.bounds)
        total, self.sum = self.sum, 0.0
        # the histogram's private per-bucket counters, added to as observe() adds to them
        for bucket, n in zip(self.hist._buckets, counts):
            if n:
                bucket.inc(n)
        if total:
            self.hist._sum.inc(total)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.finished = Counter("conveyor_requests",
                                "Requests finished, by finish reason (stop, length, abort, error)",
                                ["finish_reason"], registry=r)
        self.rejected = Counter("conveyor_requests_rejected",
                                "Requests refused before they were queued (429)", ["reason"],
                                registry=r)
        self.ttft = Histogram("conveyor_time_to_first_token_seconds", "Time to first token",
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("conveyor_inter_token_latency_seconds",
                             "Time between consecutive output tokens", buckets=ITL_BUCKETS,
                             registry=r)
        self.e2e = Histogram("conveyor_e2e_request_latency_seconds", "Arrival to last token",
                             buckets=E2E_BUCKETS, registry=r)
        self.queue = Histogram("conveyor_request_queue_time_seconds",
                               "Arrival in the engine to first scheduled", buckets=E2E_BUCKETS,
                               registry=r)
        self.prompt_tokens = Counter("conveyor_prompt_tokens", "Prompt tokens of finished requests",
                                     registry=r)
        self.embedding_inputs = Counter("conveyor_embedding_inputs",
                                        "Inputs embedded (/v1/embeddings)", registry=r)
        self.embedding_tokens = Counter("conveyor_embedding_tokens",
                                        "Tokens of the inputs embedded", registry=r)
        self.generation_tokens = Counter("conveyor_generation_tokens", "Generated tokens",
                                         registry=r)
        self.scored_tokens = Counter("conveyor_prompt_tokens_scored",
                                     "Prompt tokens whose logprobs were returned (echo with "
                                     "logprobs, prompt_logprobs)", registry=r)
        self.cache_queries = Counter("conveyor_prefix_cache_queries",
                                     "Prompt tokens looked up in the prefix cache", registry=r)
        self.cache_hits = Counter("conveyor_prefix_cache_hits",
                                  "Prompt tokens served from the prefix cache", registry=r)
        self.in_flight = Gauge("conveyor_requests_in_flight",
                               "Requests this gateway is serving now", registry=r,
                               multiprocess_mode="livesum")
        self.latency_source = Gauge("conveyor_latency_source_engine",
                                    "1 when latencies come from the engine's per-request "
                                    "timestamps, 0 when from the gateway's clock", registry=r,
                                    multiprocess_mode="max")
        self.engine = EngineCollector()
        r.register(self.engine)
        self._itl = _LocalHistogram(self.itl, ITL_BUCKETS)
        self._generation_tokens = 0
        self._live: dict[str, _Live] = {}
        self._hits = self._queries = 0

    # -- per request -------------------------------------------------------------------------------
    def begin(self, request_id: str) -> None:
        self._live[request_id] = _Live(time.monotonic())
        self.in_flight.inc()

    def on_output(self, out: RequestOutput) -> None:
        """Every engine output row of a live request, as it arrives (before any merging). The hot
        path: per-token figures are counted locally here and reach prometheus in flush()."""
        rec = self._live.get(out.request_id)
        if rec is None:
            return
        if out.finished:
            rec.events = out.events or None
        n = len(out.new_token_ids)
        if not n:
            return
        self._generation_tokens += n
        now = time.monotonic()
        if rec.first is None:
            rec.first = now
        last = rec.last.get(out.index)
        rec.last[out.index] = now
        # a choice's first token is its time to first token, not an inter-token gap;
        if last is None:
            if n > 1:  # more tokens of the same step follow it at once
                self._itl.observe(0.0, n - 1)
            return
        self._itl.observe((now - last) / n, n)

    def flush(self) -> None:
        """Move the locally counted figures into the prometheus metrics (before a scrape, and every
        second with several workers, whose metrics any one of them may be asked for)."""
        self._itl.flush()
        if self._generation_tokens:
            self.generation_tokens.inc(self._generation_tokens)
            self._generation_tokens = 0

    def finish(self, request_id: str, finish_reason: str, num_prompt: int, num_cached: int) -> None:
        """TTFT, queue time and end-to-end latency: differences of the engine's own
        timestamps when its final output carried them (one clock, wherever the gateway runs),
        else this process's clock."""
        rec = self._live.pop(request_id, None)
        if rec is None:
            return
        # a finished request is fully counted, whichever worker answers the next scrape
        self.flush()
        self.in_flight.dec()
        self.finished.labels(finish_reason).inc()
        self.prompt_tokens.inc(num_prompt)
        self.cache_queries.inc(num_prompt)
        self.cache_hits.inc(num_cached)
        self._queries += num_prompt
        self._hits += num_cached
        ev = rec.events or {}
        queued = ev.get("queued")
        if queued is not None and "finished" in ev:
            self.latency_source.set(1)
            if "scheduled" in ev:
                self.queue.observe(max(0.0, ev["scheduled"] - queued))
            if "first_token" in ev:
                self.ttft.observe(max(0.0, ev["first_token"] - queued))
            self.e2e.observe(max(0.0, ev["finished"] - queued))
        elif rec.first is not None:
            self.latency_source.set(0)
            self.ttft.observe(rec.first - rec.start)
            self.e2e.observe(time.monotonic() - rec.start)

    def embedded(self, num_inputs: int, num_tokens: int) -> None:
        """An embeddings request's inputs all came back (the request itself is counted by
        finish)."""
        self.embedding_inputs.inc(num_inputs)
        self.embedding_tokens.inc(num_tokens)

    def reject(self, reason: str) -> None:
        self.rejected.labels(reason).inc()

    # -- exposition --------------------------------------------------------------------------------
    def render(self, engine_stats: dict[str, float] | None,
               replicas: list[ReplicaRow] | None = None) -> bytes:
        """The text exposition. engine_stats: the engine's fresh STATS, or None when it did not
        answer; replicas: each data-parallel replica's, when there are several."""
        self.engine.replicas = replicas or []
        self.engine.up = engine_stats is not None
        if engine_stats is not None:
            self.engine.stats = engine_stats
        self.engine.hit_rate_fallback = self._hits / self._queries if self._queries else None
        self.flush()
        mp = multiprocess_dir()
        if mp is None:
            return generate_latest(self.registry)
        from prometheus_client import multiprocess

        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry, path=mp)
        registry.register(self.engine)
        return generate_latest(registry)


def parse(text: str) -> dict[str, Any]:
    """name{labels} -> value, with prometheus-client's own parser (for tests and the benchmark)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, Any] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            out[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return out
