"""The cost of structured output: 64 sequences decoding, of which 0, 16 or 64 are JSON-schema
constrained.

One process, one engine (SmolLM2-135M-Instruct by default), the three runs side by side: mean decode
step time and output tok/s while all 64 run, and the share of the step spent filling and applying
the masks. Then grammar compile times: the one-time tokenizer preparation, a cold compile of a
typical schema, a cached one; and the longest step taken while 16 fresh schemas compile in the
worker (no step waits).

    python bench/structured.py [--threads 2] [--dtype float32] [--steps 12] [--rounds 3]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import Future
from statistics import median
from typing import TYPE_CHECKING, Any
from unittest import mock

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import cpu_features, machine, pin_threads

if TYPE_CHECKING:
    import torch

    from engine.offline import LLM
    from engine.sequence import Sequence
    from engine.structured import Grammars

# A typical schema whose outputs run long enough to measure: a list of records.
SCHEMA = {"type": "object", "properties": {"people": {"type": "array", "maxItems": 40, "items": {
    "type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                     "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                     "city": {"type": "string", "maxLength": 24},
                                     "role": {"enum": ["admin", "user", "guest"]}},
    "required": ["name", "age", "city", "role"], "additionalProperties": False}}},
    "required": ["people"], "additionalProperties": False}


def fresh_schema(i: int) -> dict[str, Any]:
    """The typical schema under a new title: a cache miss with the same compile work."""
    return {**SCHEMA, "title": f"people-{i}-{time.time_ns()}"}


def decode_steps(llm: LLM, num_constrained: int, batch: int,
                 steps: int) -> tuple[list[float], list[float]]:
    """-> (seconds of each decode step with every sequence running, seconds of each in
    apply_masks)."""
    import engine.sampler as sampler_module
    from engine.structured import apply_masks

    mask_time = [0.0]

    def timed(logits: torch.Tensor, seqs: list[Sequence]) -> None:
        t0 = time.perf_counter()
        apply_masks(logits, seqs)
        mask_time[0] += time.perf_counter() - t0

    with mock.patch.object(sampler_module, "apply_masks", timed):  # the name the sampler calls
        return masked_steps(llm, num_constrained, batch, steps, mask_time)


def masked_steps(llm: LLM, num_constrained: int, batch: int, steps: int,
                 mask_time: list[float]) -> tuple[list[float], list[float]]:
    """decode_steps' runs, with apply_masks timed into mask_time[0]."""
    from shared.constraints import json_schema
    from shared.sampling import SamplingParams
    from shared.tokenizer import apply_chat_template

    core, tok = llm.core, llm.tokenizer
    constraint = json_schema(SCHEMA)
    for i in range(batch):
        prompt = apply_chat_template(tok, [{"role": "user",
                                            "content": f"List people number {i} as JSON."}])
        p = SamplingParams(temperature=0, max_tokens=steps + 64, ignore_eos=i >= num_constrained,
                           constraint=constraint if i < num_constrained else None)
        core.add(f"r{num_constrained}-{i}", prompt, p)
    while len(core.scheduler.running) < batch or any(s.num_output_tokens == 0
                                                     for s in core.scheduler.running):
        core.step()  # prefill (and the grammar compile) outside the measurement
    times, masks = [], []
    for _ in range(steps):
        mask_time[0] = 0.0
        t0 = time.perf_counter()
        core.step()
        times.append(time.perf_counter() - t0)
        masks.append(mask_time[0])
        assert len(core.scheduler.running) == batch, "a sequence ended during the measurement"
    core.abort(list(core.requests))
    return times, masks


def compiled(grammars: Grammars, future: Future[Any]) -> float:
    """Seconds until future's compile is done, moving it along as each step does (Grammars.ready
    hands a compile asked for before the compile server was up to the server)."""
    t0 = time.perf_counter()
    while not future.done():
        grammars.ready({})
        grammars.wait([future], 0.005)
    future.result()  # a failed compile raises here
    return time.perf_counter() - t0


def compile_times(llm: LLM) -> dict[str, float]:
    """The compile server starts on the first compile (engine/structured.py Grammars): the first
    one carries the tokenizer's preparation and the server's start."""
    from shared.constraints import json_schema

    g = llm.core.grammars
    prepare = compiled(g, g.compile(json_schema(fresh_schema(-1))))
    cold = []
    for i in range(5):
        c = json_schema(fresh_schema(i))
        cold.append(compiled(g, g.compile(c)))
    t0 = time.perf_counter()
    for _ in range(100):
        g.compile(c).result()
    cached = (time.perf_counter() - t0) / 100
    return {"tokenizer preparation + server start + a compile (once)": prepare,
            "cold compile (median of 5)": sorted(cold)[2], "cached compile": cached}


def steps_during_compiles(llm: LLM, batch: int) -> tuple[float, float, int]:
    """-> (median step seconds of 64 free sequences before, longest step while 16 fresh schemas
    compile in the worker, steps taken meanwhile)."""
    from shared.constraints import json_schema
    from shared.sampling import SamplingParams

    core = llm.core
    for i in range(batch):
        core.add(f"free-{i}", [1, 2, 3 + i],
                 SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    while any(s.num_output_tokens == 0 for s in core.scheduler.running) or core.scheduler.waiting:
        core.step()
    before = []
    for _ in range(5):
        t0 = time.perf_counter()
        core.step()
        before.append(time.perf_counter() - t0)
    for i in range(16):
        core.add(f"c-{i}", [1, 2, 3], SamplingParams(temperature=0, max_tokens=4,
                                                     constraint=json_schema(
            fresh_schema(100 + i))))
    times = []
    while core.requests.num_compiling:
        t0 = time.perf_counter()
        core.step()
        times.append(time.perf_counter() - t0)
    core.abort(list(core.requests))
    return sorted(before)[2], max(times), len(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="SmolLM2-135M-Instruct")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=12, help="decode steps measured per run")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    pin_threads(args.threads)
    from engine.offline import LLM

    llm = LLM(args.model, num_threads=args.threads, dtype=args.dtype, kv_cache_memory="768MiB",
              swap_space="64MiB", max_num_seqs=args.batch, enable_prefix_caching=False)
    print(f"# {machine()}\n# {cpu_features()}\n# {args.model}, {args.dtype}, {args.batch} "
          "sequences decoding")
    print(json.dumps({k: f"{v * 1e3:.2f} ms" for k, v in compile_times(llm).items()}))
    decode_steps(llm, 0, args.batch, 4)  # warm-up: shapes, allocator
    # Rounds interleave the three runs, so that a change in the machine's load hits all of them
    # alike; medians over every step of every round.
    sizes = (0, args.batch // 4, args.batch)
    steps: dict[int, list[float]] = {k: [] for k in sizes}
    masks: dict[int, list[float]] = {k: [] for k in sizes}
    for _ in range(args.rounds):
        for k in sizes:
            t, m = decode_steps(llm, k, args.batch, args.steps)
            steps[k] += t
            masks[k] += m
    base = median(steps[0])
    print(f"{'constrained':>11} {'step ms':>8} {'tok/s':>7} {'vs 0':>7} {'mask ms':>8}   "
          f"(medians of {len(steps[0])} steps)")
    for k in sizes:
        step, mask = median(steps[k]), median(masks[k])
        print(f"{k:>11} {step * 1e3:8.1f} {args.batch / step:7.0f} "
              f"{100 * (step / base - 1):+6.1f}% {mask * 1e3:8.2f}")
    typical, worst, n = steps_during_compiles(llm, args.batch)
    print(f"64 free sequences: median step {typical * 1e3:.1f} ms before; while 16 fresh schemas "
          f"compiled ({n} steps) the longest step took {worst * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
