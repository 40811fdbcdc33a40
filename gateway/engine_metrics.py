"""The engine's STATS as Prometheus metrics: its gauges and counters (queues, KV usage, preemptions,
prefix cache, speculative decoding) and, under data parallelism, one labelled row per replica. The
/metrics handler asks the engines for fresh STATS before each scrape; gateway/metrics.py registers
this collector beside the gateway's own per-request metrics.
"""
from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

# Engine STATS gauge -> (metric name, help). Anything else the engine reports is exported as
# conveyor_engine_<name>, so a new engine gauge shows up without a gateway change.
ENGINE_GAUGES = {
    "num_running": ("conveyor_num_requests_running", "Requests in the engine's running batch"),
    "num_waiting": ("conveyor_num_requests_waiting", "Requests waiting in the engine's queue"),
    "num_swapped": ("conveyor_num_requests_swapped", "Requests swapped out to the CPU block pool"),
    "kv_usage": ("conveyor_kv_cache_usage_ratio", "Fraction of KV cache blocks in use (0..1)"),
}
# Speculative decoding, exported only when the engine runs it (STATS key -> (metric, help)).
SPEC_GAUGES = {
    "spec_acceptance_rate": ("conveyor_spec_decode_acceptance_rate",
                             "Speculative decoding: share of proposed tokens the model accepted "
                             "(0..1)"),
    "spec_mean_accepted_length": ("conveyor_spec_decode_mean_accepted_length",
                                  "Speculative decoding: tokens per verification step (accepted "
                                  "drafts + 1)"),
}
SPEC_COUNTERS = {
    "total_spec_verifications": ("conveyor_spec_decode_num_drafts",
                                 "Speculative decoding: verification steps (a sequence with "
                                 "proposals)"),
    "total_spec_draft_tokens": ("conveyor_spec_decode_num_draft_tokens",
                                "Speculative decoding: proposed tokens"),
    "total_spec_accepted_tokens": ("conveyor_spec_decode_num_accepted_tokens",
                                   "Speculative decoding: proposed tokens the model accepted"),
}


def num_preemptions(stats: dict[str, float]) -> float:
    """The engine counts preemptions per mode (num_preemptions_swap, _recompute): their sum."""
    return sum(v for k, v in stats.items() if k.startswith("num_preemptions_"))


def prefix_hit_rate(stats: dict[str, float], fallback: float | None) -> float:
    """Prompt tokens served from the engine's prefix cache over those looked up, since it started;
    the gateway's own rate (fallback) until the engine has looked any up."""
    queries = stats.get("total_prefix_queries_tokens", 0)
    if queries:
        return stats.get("total_prefix_hits_tokens", 0) / queries
    return fallback or 0.0


# Per-replica gauges under data parallelism (gateway/router.py): STATS key -> help; labelled
# replica="<address>".
REPLICA_GAUGES = {
    "num_running": "Requests in the replica's running batch",
    "num_waiting": "Requests waiting in the replica's queue",
    "num_queued_tokens": "Prompt tokens the replica's waiting requests still have to prefill",
    "kv_usage": "Fraction of the replica's device KV blocks in use",
    "total_prefix_hits_tokens": "Prompt tokens the replica served from its prefix cache",
}


@dataclass
class ReplicaRow:
    """One replica at scrape time: its address, fresh STATS (None: it did not answer),
    requests routed to it."""

    address: str
    stats: dict[str, float] | None
    num_routed: int


class EngineCollector(Collector):
    """Exports the engine's latest STATS; refreshed by the /metrics handler just before each
    scrape."""

    def __init__(self) -> None:
        self.stats: dict[str, float] = {}
        self.replicas: list[ReplicaRow] = []  # empty with one engine
        self.up = False
        self.hit_rate_fallback: float | None = None

    def collect(self) -> Iterable[Metric]:
        yield GaugeMetricFamily("conveyor_engine_up",
                                "1 when the engine answered the last STATS request",
                                value=float(self.up))
        stats = self.stats
        for key, (name, doc) in ENGINE_GAUGES.items():
            yield GaugeMetricFamily(name, doc, value=float(stats.get(key, 0.0)))
        yield CounterMetricFamily("conveyor_num_preemptions",
                                  "Requests preempted by the engine (swap or recompute)",
                                  value=float(num_preemptions(stats)))
        # A watchdog: steps with work queued and nothing schedulable. Nonzero means a scheduler bug.
        yield CounterMetricFamily("conveyor_engine_stalled_steps",
                                  "Engine steps with work waiting and nothing scheduled",
                                  value=float(stats.get("total_stalled_steps", 0.0)))
        yield GaugeMetricFamily("conveyor_prefix_cache_hit_rate",
                                "Fraction of prompt tokens served from the prefix cache (engine's, "
                                "else the gateway's)",
                                value=float(prefix_hit_rate(stats, self.hit_rate_fallback)))
        for family, table in ((GaugeMetricFamily, SPEC_GAUGES),
                              (CounterMetricFamily, SPEC_COUNTERS)):
            for key, (name, doc) in table.items():
                if key in stats:
                    yield family(name, doc, value=float(stats[key]))
        known = set(ENGINE_GAUGES) | set(SPEC_GAUGES) | set(SPEC_COUNTERS) | {"total_stalled_steps"}
        for key in sorted(set(stats) - known):
            value = stats[key]
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            if number and math.isfinite(value):
                name = "conveyor_engine_" + "".join(c if c.isalnum() else "_" for c in key)
                yield GaugeMetricFamily(name, f"engine STATS gauge {key!r}", value=float(value))
        if self.replicas:
            yield from self._replicas()

    def _replicas(self) -> Iterable[Metric]:
        up = GaugeMetricFamily("conveyor_replica_up",
                               "1 when the replica answered the last STATS request",
                               labels=["replica"])
        routed = CounterMetricFamily("conveyor_replica_requests_routed",
                                     "Requests this gateway routed to the replica",
                                     labels=["replica"])
        gauges = {k: GaugeMetricFamily(f"conveyor_replica_{k.removeprefix('total_')}", doc,
                                       labels=["replica"]) for k, doc in REPLICA_GAUGES.items()}
        for row in self.replicas:
            up.add_metric([row.address], float(row.stats is not None))
            routed.add_metric([row.address], float(row.num_routed))
            for k, family in gauges.items():
                if row.stats is not None:
                    family.add_metric([row.address], float(row.stats.get(k, 0.0)))
        yield up
        yield routed
        yield from gauges.values()
