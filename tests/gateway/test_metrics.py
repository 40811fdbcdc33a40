"""Metrics bookkeeping without servers: local histograms equal prometheus' own, engine STATS
mapping, engine timestamps preferred over the gateway's clock; and the SDK's fast decoder equals
decode()."""
from __future__ import annotations

import random

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from gateway.metrics import ITL_BUCKETS, Metrics, _LocalHistogram, parse
from shared.detokenizer import FastDecoder
from shared.protocol import RequestOutput
from tests.fakes import smollm2_tokenizer


def test_local_histogram_flushes_exactly_what_observe_would() -> None:
    direct, batched = CollectorRegistry(), CollectorRegistry()
    a = Histogram("h", "h", buckets=ITL_BUCKETS, registry=direct)
    b = Histogram("h", "h", buckets=ITL_BUCKETS, registry=batched)
    local = _LocalHistogram(b, ITL_BUCKETS)
    rng = random.Random(0)
    values = [rng.choice(ITL_BUCKETS)
              for _ in range(200)] + [rng.uniform(0, 3) for _ in range(300)] + [0.0, 99.0]
    for i, v in enumerate(values):
        a.observe(v)
        local.observe(v)
        if i % 97 == 0:
            local.flush()
    local.flush()
    got, want = parse(generate_latest(batched).decode()), parse(generate_latest(direct).decode())
    assert {k: v for k, v in got.items() if "created" not in k} == pytest.approx(
        {k: v for k, v in want.items() if "created" not in k})


def test_engine_stats_and_engine_timestamps() -> None:
    m = Metrics()
    m.begin("r")
    m.on_output(RequestOutput("r", [5], False, None, 10, 0))
    m.on_output(RequestOutput("r", [6, 7], False, None, 10, 0))
    events = {"queued": 100.0, "scheduled": 100.5, "first_token": 101.0, "finished": 104.0}
    m.on_output(RequestOutput("r", [8], True, "length", 10, 4, events))
    m.finish("r", "length", 10, 4)
    # late rows of a finished request: ignored
    m.on_output(RequestOutput("r", [9], True, "length", 10, 0))
    stats = {"num_running": 2, "num_waiting": 3, "num_swapped": 1, "kv_usage": 0.25,
             "num_preemptions_swap": 2, "num_preemptions_recompute": 3,
             "total_prefix_queries_tokens": 40, "total_prefix_hits_tokens": 10, "num_steps": 7}
    got = parse(m.render(stats).decode())
    assert got["conveyor_requests_total{finish_reason=length}"] == 1
    assert got["conveyor_generation_tokens_total"] == 4
    assert got["conveyor_prompt_tokens_total"] == 10
    assert got["conveyor_prefix_cache_hits_total"] == 4
    assert got["conveyor_prefix_cache_queries_total"] == 10
    # first_token - queued, the engine's clock
    assert got["conveyor_time_to_first_token_seconds_sum"] == 1.0
    assert got["conveyor_request_queue_time_seconds_sum"] == 0.5
    assert got["conveyor_e2e_request_latency_seconds_sum"] == 4.0
    assert got["conveyor_inter_token_latency_seconds_count"] == 3
    assert got["conveyor_latency_source_engine"] == 1
    assert (got["conveyor_num_requests_running"], got["conveyor_num_requests_waiting"],
            got["conveyor_num_requests_swapped"],
            got["conveyor_kv_cache_usage_ratio"]) == (2, 3, 1, 0.25)
    assert got["conveyor_num_preemptions_total"] == 5
    assert got["conveyor_prefix_cache_hit_rate"] == 0.25
    assert got["conveyor_engine_num_steps"] == 7 and got["conveyor_engine_up"] == 1
    assert parse(m.render(None).decode())["conveyor_engine_up"] == 0


def test_inter_token_latency_is_per_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    """n=2: both choices step together, so a gap is only inter-token between tokens of one choice; a
    choice's first token is not a gap at all."""
    clock = iter([0.0, 1.0, 1.0, 1.5, 1.5, 2.5])
    monkeypatch.setattr("gateway.metrics.time.monotonic", lambda: next(clock))
    m = Metrics()
    m.begin("r")
    for index, toks in ((0, [5]), (1, [6]), (0, [7]), (1, [8]), (1, [9, 10])):
        m.on_output(RequestOutput("r", toks, index=index))
    m.flush()
    got = parse(m.render(None).decode())
    # choice 0: one gap of 0.5 s; choice 1: 0.5 s, then two tokens 1.0 s later (0.5 s each)
    assert got["conveyor_inter_token_latency_seconds_count"] == 4
    assert got["conveyor_inter_token_latency_seconds_sum"] == pytest.approx(2.0)


def test_fast_decoder_matches_tokenizer_decode() -> None:
    tok = smollm2_tokenizer()
    fast = FastDecoder.wrap(tok)
    assert isinstance(fast, FastDecoder)
    rng = random.Random(0)
    for _ in range(200):
        ids = [rng.randrange(len(tok)) for _ in range(rng.randint(0, 12))]
        for skip in (True, False):
            assert fast.decode(ids, skip_special_tokens=skip) == tok.decode(
                ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)
