"""What a dashboard viewer (and a trace) costs the engine per step, next to the step itself.

The offline EngineCore (no sockets) holds a decode batch of --num-seqs sequences on the embedded
SmolLM2 and runs --steps decode steps; after each, it does what engine/loop.py does while a viewer
is connected: Observer.on_step, Observer.due (a snapshot every 0.2 s, a message every 0.1 s, on the
wall clock as in the server) and the orjson encoding of each message. Those calls are timed one by
one and set beside the mean step time measured in the same run. Without a viewer the loop only tests
`observer.watchers`: its cost is timed too. The trace recorder (engine/observe/trace.py) is timed
the same way, in a second pass.

    python bench/dashboard_cost.py [--num-seqs 64] [--steps 40] [--dtype auto]
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import timeit
from collections.abc import Container
from typing import TYPE_CHECKING

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import cpu_features, machine, pin_threads
from engine.observe.trace import Tracer  # no torch below it: pin_threads still comes first

if TYPE_CHECKING:
    from engine.step import StepPlan
    from shared.protocol import Error, RequestOutput


class TimedTracer(Tracer):
    """A Tracer whose per-step hooks (before_execute, end_step) add up the time they take."""

    def __init__(self) -> None:
        super().__init__()
        self.seconds = 0.0

    def before_execute(self, plan: StepPlan) -> None:
        t0 = time.perf_counter()
        super().before_execute(plan)
        self.seconds += time.perf_counter() - t0

    def end_step(self, step: int, plan: StepPlan, outputs: list[RequestOutput | Error],
                 live: Container[str]) -> None:
        t0 = time.perf_counter()
        super().end_step(step, plan, outputs, live)
        self.seconds += time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--num-seqs", type=int, default=64)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = p.parse_args()
    pin_threads(args.threads)
    import torch

    from engine.core import EngineCore
    from engine.observe.dashboard import SNAPSHOT_INTERVAL, Observer
    from shared.config import build_config
    from shared.protocol import Observed, encode
    from shared.sampling import SamplingParams

    core = EngineCore(build_config("SmolLM2-135M-Instruct", dtype=args.dtype,
                                   num_threads=args.threads, kv_cache_memory="1GiB",
                                   max_num_seqs=max(args.num_seqs, 1)))
    params = SamplingParams(temperature=0.0, max_tokens=4 * args.steps + 64, ignore_eos=True)
    for i in range(args.num_seqs):
        core.add(f"r{i}", [(7 * i + j) % 30000 + 100 for j in range(args.prompt_len)], params)
    # prompts done: every sequence decodes
    while core.last_step.get("step_decode_tokens", 0) < args.num_seqs:
        core.step()

    observer = Observer(core)
    observer.subscribe(b"viewer", 3600)
    step_s = observe_s = 0.0
    snapshots = messages = 0
    for _ in range(args.steps):
        t0 = time.perf_counter()
        outs = core.step()
        t1 = time.perf_counter()
        observer.on_step(outs)
        for _client, msg in observer.due():
            encode(msg)
            messages += 1
            snapshots += msg.snapshot is not None
        step_s += t1 - t0
        observe_s += time.perf_counter() - t1
    snapshot_s = min(timeit.repeat(lambda: encode(Observed([], observer.snapshot())), number=5,
                                   repeat=5)) / 5
    check = min(timeit.repeat("o.watchers and 1", globals={"o": Observer(core)}, number=100_000,
                              repeat=5)) / 1e5

    tracer = TimedTracer()
    core.set_tracer(tracer)
    traced_step_s = 0.0
    for _ in range(args.steps):
        t0 = time.perf_counter()
        core.step()
        traced_step_s += time.perf_counter() - t0
    core.set_tracer(None)

    n = args.steps
    step_ms, observe_us, trace_us = 1e3 * step_s / n, 1e6 * observe_s / n, 1e6 * tracer.seconds / n
    print(f"machine: {machine()}; {cpu_features()}; dtype {core.model_config.dtype}; torch threads "
          f"{torch.get_num_threads()}")
    print(f"SmolLM2-135M, {args.num_seqs} sequences decoding, {n} steps each pass, "
          f"{core.block_manager.num_blocks} KV blocks")
    print(f"{'':44}{'per step':>14}{'of a step':>12}")
    print(f"{'step (baseline, same run)':44}{step_ms:>11.2f} ms{100.0:>11.1f}%")
    print(f"{'viewer connected: on_step + due + encode':44}{observe_us:>11.1f} "
          f"us{observe_us / step_ms / 10:>11.3f}%   ({snapshots} snapshots, {messages} messages)")
    print(f"{'  of which one snapshot, encoded':44}{snapshot_s * 1e6:>11.1f} us   (at most "
          f"{1 / SNAPSHOT_INTERVAL:g}/s: {100 * snapshot_s / SNAPSHOT_INTERVAL:.3f}% of wall time "
          "at most)")
    print(f"{'no viewer: the loop tests observer.watchers':44}{check * 1e9:>11.0f} ns"
          f"{check * 1e3 / step_ms * 100:>11.5f}%")
    print(f"{'trace on: before_execute + end_step + marks':44}{trace_us:>11.1f} "
          f"us{trace_us / step_ms / 10:>11.3f}%   (steps of that pass: "
          f"{1e3 * traced_step_s / n:.2f} ms)")


if __name__ == "__main__":
    main()
