"""Prefix caching and block sharing, each against its baseline measured in the same run.

1. Time to first token (TTFT) of requests that share a 1,000-token system prompt, with and without
   prefix caching, and the ratio (target: >= 5x lower with the cache).
2. KV blocks held by one n=8 request (prompt prefilled once, blocks shared) against eight separate
   requests with the same prompt.
3. Throughput with caching on against off on a workload with no shared prefixes (the bookkeeping
   cost; target: < 1%).
4. TTFT of a prefix that was evicted to the CPU tier (swapped back in) against one recomputed.

    python bench/prefix_cache.py [--model M] [--threads 2] [--requests 8]
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any
from unittest import mock

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import machine, pin_threads, token_outputs, workload

if TYPE_CHECKING:
    from engine.core import EngineCore

SYSTEM_LEN = 1000


def make_core(model: str, **options: object) -> EngineCore:
    from engine.core import EngineCore
    from shared.config import build_config

    options.setdefault("max_num_batched_tokens", 2048)
    options.setdefault("block_size", 16)
    return EngineCore(build_config(model, **options))


def ttft(core: EngineCore, rid: str, prompt: list[int]) -> float:
    """Add one request alone and step until its first token. -> seconds."""
    from shared.sampling import SamplingParams

    t0 = time.perf_counter()
    core.add(rid, prompt, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    first = None
    while core.has_work():
        for o in token_outputs(core.step()):
            if first is None and o.new_token_ids:
                first = time.perf_counter() - t0
    if first is None:
        raise RuntimeError(f"request {rid} finished without a token")
    return first


def shared_system_prompt(model: str, vocab: int, num_requests: int) -> tuple[float, float]:
    rng = random.Random(0)
    system = [rng.randrange(100, vocab) for _ in range(SYSTEM_LEN)]
    users = [[rng.randrange(100, vocab) for _ in range(rng.randint(10, 40))]
             for _ in range(num_requests)]
    out = []
    for caching in (False, True):
        core = make_core(model, enable_prefix_caching=caching, kv_cache_memory="512MiB")
        ttft(core, "warm", system + [7])  # the first request computes the system prompt either way
        # the median: robust to a busy machine
        out.append(statistics.median(ttft(core, f"u{i}", system + u) for i, u in enumerate(users)))
    return out[0], out[1]


def n8_memory(model: str, vocab: int) -> tuple[int, int]:
    from shared.sampling import SamplingParams

    prompt = [random.Random(1).randrange(100, vocab) for _ in range(SYSTEM_LEN)]
    held = []
    for n, copies in ((8, 1), (1, 8)):
        # All eight prefill in one step and decode side by side (no long-prompt cap), as n=8's
        # samples do.
        core = make_core(model, enable_prefix_caching=False, kv_cache_memory="512MiB",
                         max_num_batched_tokens=8192, max_long_prefills=8)
        for i in range(copies):
            core.add(f"r{i}", prompt, SamplingParams(temperature=0.8, seed=i, n=n, max_tokens=4,
                                                     ignore_eos=True))
        peak = 0
        while core.has_work():
            core.step()
            peak = max(peak, core.block_manager.num_blocks - core.block_manager.num_free_blocks)
        held.append(peak)
    return held[0], held[1]


def throughput(model: str, vocab: int, rounds: int = 4) -> tuple[float, float, float, float]:
    """-> (tok/s off, tok/s on, bookkeeping ms/step off, on): best of rounds, run alternately; the
    scheduler's own time (schedule + update, where all prefix-cache work happens) is timed apart, as
    it is what caching adds and is not drowned by noise in the model's time on a shared machine."""
    from shared.sampling import SamplingParams

    reqs = workload(24, (64, 256), (16, 48), vocab, seed=3)
    best = {True: 0.0, False: 0.0}
    book = {True: float("inf"), False: float("inf")}
    cores = {c: make_core(model, enable_prefix_caching=c, kv_cache_memory="512MiB",
                          max_num_batched_tokens=512) for c in (False, True)}
    for r in range(rounds):
        for caching in (False, True) if r % 2 == 0 else (True, False):  # alternate to cancel drift
            core = cores[caching]
            core.reset_prefix_cache()
            s = core.scheduler
            timed = [0.0]
            with mock.patch.object(s, "schedule", timed_call(s.schedule, timed)), \
                    mock.patch.object(s, "update", timed_call(s.update, timed)):
                steps0 = core.num_steps
                t0 = time.perf_counter()
                for i, (prompt, n) in enumerate(reqs):
                    core.add(f"{r}-{i}", prompt, SamplingParams(temperature=0, max_tokens=n,
                                                                ignore_eos=True))
                tokens = 0
                while core.has_work():
                    tokens += sum(len(o.new_token_ids) for o in token_outputs(core.step()))
                best[caching] = max(best[caching], tokens / (time.perf_counter() - t0))
                book[caching] = min(book[caching], timed[0] / (core.num_steps - steps0) * 1e3)
    return best[False], best[True], book[False], book[True]


def timed_call(fn: Callable[..., Any], total: list[float]) -> Callable[..., Any]:
    """fn, adding the seconds of every call to total[0]."""
    def call(*a: Any, **k: Any) -> Any:
        t = time.perf_counter()
        out = fn(*a, **k)
        total[0] += time.perf_counter() - t
        return out
    return call


def cpu_tier(model: str, vocab: int) -> tuple[float, float]:
    rng = random.Random(2)
    prompt = [rng.randrange(100, vocab) for _ in range(SYSTEM_LEN)]
    flood = [rng.randrange(100, vocab) for _ in range(SYSTEM_LEN + 200)]
    out = []
    for cpu_blocks in (0, 256):
        # The device pool holds one long prompt: the flood evicts the first one's blocks.
        core = make_core(model, num_blocks=80, num_cpu_blocks=cpu_blocks)
        ttft(core, "a", prompt + [5])
        ttft(core, "flood", flood)
        out.append(ttft(core, "again", prompt + [6]))
        assert (core.block_manager.stats["prefix_cpu_hits"] > 0) == bool(cpu_blocks)
    return out[0], out[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="SmolLM2-135M-Instruct")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--requests", type=int, default=8)
    args = ap.parse_args()
    pin_threads(args.threads)
    import torch

    torch.set_num_threads(args.threads)
    vocab = make_core(args.model, num_blocks=8).model_config.vocab_size
    print(f"# {machine()}\n# model {args.model}")
    off, on = shared_system_prompt(args.model, vocab, args.requests)
    print(f"TTFT, {SYSTEM_LEN}-token shared system prompt: no cache {off * 1e3:.1f} ms, cache "
          f"{on * 1e3:.1f} ms, {off / on:.1f}x lower")
    n8, sep = n8_memory(args.model, vocab)
    print(f"KV blocks, {SYSTEM_LEN}-token prompt: n=8 holds {n8}, 8 separate requests {sep} "
          f"({1 - n8 / sep:.0%} saved)")
    t_off, t_on, b_off, b_on = throughput(args.model, vocab)
    print(f"throughput, no shared prefixes: cache off {t_off:.1f} tok/s, on {t_on:.1f} tok/s "
          f"({(t_on / t_off - 1) * 100:+.1f}%); scheduler bookkeeping {b_off:.3f} vs {b_on:.3f} "
          "ms/step")
    recompute, swapped = cpu_tier(args.model, vocab)
    print(f"TTFT of an evicted {SYSTEM_LEN}-token prefix: recomputed {recompute * 1e3:.1f} ms, "
          f"from the CPU tier {swapped * 1e3:.1f} ms ({recompute / swapped:.1f}x lower)")


if __name__ == "__main__":
    main()
