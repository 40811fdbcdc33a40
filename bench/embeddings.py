"""Embeddings per second against plain prefill throughput of the same inputs, in one engine, in one
run.

One seeded set of inputs (default 64, 32..256 tokens) on SmolLM2-135M-Instruct. Each round runs the
inputs twice through the same in-process EngineCore: as embedding requests (prefill-only, pooled,
blocks freed at the end) and as generation requests with max_tokens=1 (the same prefill, then one
sampled token: the plain prefill baseline). Rounds alternate the order; the best round of each
counts. Prefix caching is off so that neither side reuses the other's blocks.

    python bench/embeddings.py [--num-inputs 64] [--threads 2] [--dtype float32] [--pooling last]"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import cpu_features, machine, pin_threads, workload  # noqa: E402


def run(core, inputs: list[list[int]], embed: bool, tag: str) -> float:  # noqa: ANN001
    """Seconds to finish every input as embeddings (embed) or as one-token generations."""
    from shared.embedding import PoolingParams
    from shared.sampling import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    for i, ids in enumerate(inputs):
        core.add(f"{tag}-{i}", ids, params, pool=PoolingParams() if embed else None)
    done = 0
    while core.has_work():
        done += sum(1 for o in core.step() if getattr(o, "finished", False))
    elapsed = time.perf_counter() - t0
    assert done == len(inputs), (done, len(inputs))
    return elapsed


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default="SmolLM2-135M-Instruct")
    p.add_argument("--num-inputs", type=int, default=64)
    p.add_argument("--min-tokens", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--pooling", default="auto")
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    pin_threads(args.threads)
    from engine.core import EngineCore
    from shared.config import build_config

    core = EngineCore(
        build_config(
            args.model,
            dtype=args.dtype,
            num_threads=args.threads,
            pooling=args.pooling,
            kv_cache_memory="2GiB",
            enable_prefix_caching=False,
            max_num_batched_tokens=args.max_num_batched_tokens,
        )
    )
    lengths = (args.min_tokens, args.max_tokens)
    vocab = core.model_config.vocab_size
    inputs = [ids for ids, _ in workload(args.num_inputs, lengths, (1, 1), vocab, seed=1)]
    tokens = sum(map(len, inputs))
    run(core, inputs[:4], True, "warm-e")
    run(core, inputs[:4], False, "warm-g")
    best = {True: float("inf"), False: float("inf")}
    for r in range(args.rounds):
        for embed in (True, False) if r % 2 == 0 else (False, True):
            best[embed] = min(best[embed], run(core, inputs, embed, f"r{r}-{embed}"))
    free = core.block_manager.num_free_blocks == core.block_manager.num_blocks
    print(f"# {machine()}; load average {os.getloadavg()[0]:.1f}")
    print(
        f"# cpu flags: {cpu_features()}; dtype {core.model_config.dtype}; "
        f"pooling {core.pooling.mode}; "
        f"{args.num_inputs} inputs, {tokens} tokens ({args.min_tokens}..{args.max_tokens} each); "
        f"budget {args.max_num_batched_tokens} tokens/step; best of {args.rounds} rounds"
    )
    print(f"{'':28} {'inputs/s':>10} {'tokens/s':>10}")
    for name, embed in (("embeddings", True), ("prefill + 1 token (base)", False)):
        t = best[embed]
        print(f"{name:28} {args.num_inputs / t:10.1f} {tokens / t:10.0f}")
    print(f"embeddings / plain prefill: {best[False] / best[True]:.2f}x; every block free: {free}")


if __name__ == "__main__":
    main()
