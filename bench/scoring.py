"""Scoring throughput: prompt tokens scored per second (what `echo` + `logprobs` asks of the engine:
prompt_logprobs = k, max_tokens 1) and embeddings (prefill-only, pooled: /v1/embeddings), beside
plain prefill of the very same prompts (max_tokens 1, no prompt logprobs) in the same run, on the
offline engine (no HTTP: the engine's cost alone).

Scoring computes the LM head on every prompt row (not only the last) and one log-softmax per chunk;
the prefix cache is off for both modes (a scoring request skips it anyway), so the ratio is that
cost. Each mode runs `--repeats` times, alternating, after one warm-up pass; the median is reported.

Each mode is one entry in MODES: a name, what its figure counts, and a function that builds one
request's (SamplingParams, PoolingParams or None).

    python bench/scoring.py [--model M] [--dtype auto|float32|bfloat16] [--threads 2]
                            [--requests 32] [--prompt-len 256] [--top-k 1] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import cpu_features, machine, pin_threads


def plain(top_k: int) -> tuple[Any, Any]:
    from shared.sampling import SamplingParams

    return SamplingParams(temperature=0, max_tokens=1, ignore_eos=True), None


def scored(top_k: int) -> tuple[Any, Any]:
    from shared.sampling import SamplingParams

    return SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, prompt_logprobs=top_k), None


def embedded(top_k: int) -> tuple[Any, Any]:
    from shared.embedding import PoolingParams

    return plain(top_k)[0], PoolingParams()


# name -> (what its figure counts, params of one request). The first is the baseline of the ratios.
MODES: dict[str, tuple[str, Callable[[int], tuple[Any, Any]]]] = {
    "plain prefill": ("prompt tokens/s", plain),
    "echo + logprobs (prompt scored)": ("prompt tokens scored/s", scored),
    "embeddings (pooled)": ("prompt tokens embedded/s", embedded),
}


def run_once(core: Any, prompts: list[list[int]], request: tuple[Any, Any], tag: str) -> float:
    """All prompts at once, stepped to the end. -> prompt tokens per second."""
    params, pool = request
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        core.add(f"{tag}-{i}", p, params, pool=pool)
    while core.has_work():
        core.step()
    return sum(map(len, prompts)) / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="SmolLM2-135M-Instruct")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument(
        "--top-k", type=int, default=1, help="alternatives per prompt token (lm-eval asks for 1)"
    )
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    pin_threads(args.threads)
    import random

    from engine.core import EngineCore
    from shared.config import build_config

    core = EngineCore(
        build_config(
            args.model,
            dtype=args.dtype,
            num_threads=args.threads,
            kv_cache_memory="1GiB",
            enable_prefix_caching=False,
            max_num_batched_tokens=args.max_num_batched_tokens,
        )
    )
    vocab = core.model_config.vocab_size
    rng = random.Random(0)
    prompts = [
        [rng.randrange(100, vocab) for _ in range(args.prompt_len)] for _ in range(args.requests)
    ]
    print(
        f"machine: {machine()}\ncpu flags: {cpu_features()}\nmodel: {args.model}, dtype "
        f"{core.model_config.dtype}, {args.requests} prompts x {args.prompt_len} tokens, "
        f"top-k {args.top_k}, max_num_batched_tokens {args.max_num_batched_tokens}"
    )
    results: dict[str, list[float]] = {name: [] for name in MODES}
    for name, (_, build) in MODES.items():  # warm-up: shapes, allocator
        run_once(core, prompts[:4], build(args.top_k), f"warm-{name}")
    for r in range(args.repeats):
        for name, (_, build) in MODES.items():
            results[name].append(run_once(core, prompts, build(args.top_k), f"{r}-{name}"))
    base = statistics.median(results[next(iter(MODES))])
    for name, (unit, _) in MODES.items():
        med = statistics.median(results[name])
        runs = ", ".join(f"{x:.0f}" for x in results[name])
        print(f"{name:34s} {med:9.0f} {unit:24s} ({med / base:.2f}x plain prefill; runs: {runs})")


if __name__ == "__main__":
    main()
