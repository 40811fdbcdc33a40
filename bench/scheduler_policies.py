"""Scheduler policies on one serving workload, and the engine's per-step overhead.

Part 1 replays one seeded workload with Poisson arrivals through EngineCore (in-process, no
sockets) under each prefill policy, and prints output tokens/s, time to first token (TTFT) and
inter-token latency (ITL), p50 and p99, side by side.
Part 2 holds 64 and then 256 sequences in decode and splits the step into model forward, sampling
and everything else (scheduling, input preparation, output processing): the share outside the
model is what the engine's Python costs.

    python bench/scheduler_policies.py [--model M] [--num-requests 48] [--rate 4] [--threads 2]
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING
from unittest import mock

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import Workload, machine, pin_threads, token_outputs, workload

if TYPE_CHECKING:
    from engine.core import EngineCore


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p / 100 * len(xs)))] if xs else float("nan")


def replay(core: EngineCore, reqs: Workload, rate: float, seed: int = 0) -> dict[str, float]:
    from shared.sampling import SamplingParams

    rng = random.Random(seed)
    arrivals, t = [], 0.0
    for _ in reqs:
        t += rng.expovariate(rate)
        arrivals.append(t)
    token_times: dict[str, list[float]] = {}
    start = time.perf_counter()
    nxt = 0
    while nxt < len(reqs) or core.has_work():
        now = time.perf_counter() - start
        while nxt < len(reqs) and arrivals[nxt] <= now:
            prompt, n = reqs[nxt]
            core.add(f"r{nxt}", prompt, SamplingParams(temperature=0, max_tokens=n,
                                                       ignore_eos=True))
            token_times[f"r{nxt}"] = []
            nxt += 1
        if not core.has_work():
            time.sleep(min(0.01, arrivals[nxt] - now))
            continue
        outs = token_outputs(core.step())
        now = time.perf_counter() - start
        for o in outs:
            token_times[o.request_id] += [now] * len(o.new_token_ids)
    elapsed = time.perf_counter() - start
    ttft = [ts[0] - arrivals[int(rid[1:])] for rid, ts in token_times.items()]
    itl = [b - a for ts in token_times.values() for a, b in zip(ts, ts[1:])]
    return {"tok/s": sum(len(ts) for ts in token_times.values()) / elapsed, "ttft50": pct(ttft, 50),
            "ttft99": pct(ttft, 99), "itl50": pct(itl, 50), "itl99": pct(itl, 99)}


class Timed:
    """Wraps a callable and adds its wall time to a total."""

    def __init__(self, fn: Callable[..., object]) -> None:
        self.fn, self.total = fn, 0.0

    def __getattr__(self, name: str) -> object:  # the wrapped one's (e.g. sampler.logprobs)
        return getattr(self.fn, name)

    def __call__(self, *args: object, **kwargs: object) -> object:
        t0 = time.perf_counter()
        out = self.fn(*args, **kwargs)
        self.total += time.perf_counter() - t0
        return out


def overhead(core: EngineCore, num_seqs: int, steps: int = 8) -> tuple[float, float, float, float]:
    """-> (step ms, forward ms, sampling ms, share outside forward and sampling)."""
    from shared.sampling import SamplingParams

    rng = random.Random(1)
    for i in range(num_seqs):
        core.add(f"o{num_seqs}-{i}", [rng.randrange(100, 40000) for _ in range(64)],
                 SamplingParams(temperature=0, max_tokens=steps + 4, ignore_eos=True))
    while any(live.root.num_output_tokens == 0 for live in core.requests.values()):
        core.step()
    runner = core.runner
    model, sampler = Timed(runner.model), Timed(runner.sampler)
    with mock.patch.object(runner, "model", model), mock.patch.object(runner, "sampler", sampler):
        t0 = time.perf_counter()
        for _ in range(steps):
            core.step()
        total = time.perf_counter() - t0
    core.abort(list(core.requests))
    outside = 1 - (model.total + sampler.total) / total
    return total / steps * 1e3, model.total / steps * 1e3, sampler.total / steps * 1e3, outside


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="SmolLM2-135M-Instruct")
    ap.add_argument("--num-requests", type=int, default=48)
    ap.add_argument("--rate", type=float, default=4.0, help="Poisson arrivals per second")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--overhead-only", action="store_true", help="skip part 1")
    args = ap.parse_args()
    pin_threads(args.threads)
    from engine.core import EngineCore
    from shared.config import PREFILL_POLICIES, build_config

    print(f"machine: {machine()}")
    reqs = workload(args.num_requests, (32, 384), (16, 128), vocab=49152, seed=3)
    print(f"workload: {len(reqs)} requests, Poisson {args.rate}/s, prompts 32..384, outputs "
          "16..128 tokens, greedy")
    print(f"\n{'policy':15s}{'out tok/s':>10s}{'TTFT p50':>10s}{'TTFT p99':>10s}"
          f"{'ITL p50':>9s}{'ITL p99':>9s}"
          "   (seconds)")
    core = None
    for policy in [] if args.overhead_only else PREFILL_POLICIES:
        core = EngineCore(build_config(args.model, prefill_policy=policy, num_threads=args.threads,
                                       max_num_batched_tokens=args.max_num_batched_tokens,
                                       max_num_seqs=256, kv_cache_memory="3GiB",
                                       speculative="none"))
        r = replay(core, reqs, args.rate)
        print(f"{policy:15s}{r['tok/s']:10.1f}{r['ttft50']:10.2f}{r['ttft99']:10.2f}{r['itl50']:9.3f}{r['itl99']:9.3f}",
              flush=True)
    if core is None:
        core = EngineCore(build_config(args.model, num_threads=args.threads, max_num_seqs=256,
                                       kv_cache_memory="3GiB", speculative="none",
                                       max_num_batched_tokens=args.max_num_batched_tokens))
    print(f"\n{'running seqs':>12s}{'step ms':>10s}{'forward ms':>12s}{'sample ms':>11s}"
          f"{'outside model':>15s}")
    for n in (64, 256):
        step, fwd, smp, share = overhead(core, n)
        print(f"{n:12d}{step:10.1f}{fwd:12.1f}{smp:11.2f}{share:14.1%}", flush=True)


if __name__ == "__main__":
    main()
