"""Shared bits of the benchmarks: thread placement, the machine, seeded workloads, timing."""
from __future__ import annotations

import os
import platform
import random
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shared.protocol import Error, RequestOutput

# Seeded requests: (prompt token ids, output length) each.
Workload = list[tuple[list[int], int]]


def pin_threads(num_threads: int) -> None:
    """OpenMP reads these once, at the first parallel region: call before torch does any work."""
    os.environ.setdefault("OMP_NUM_THREADS", str(num_threads))
    os.environ.setdefault("OMP_PROC_BIND", "close")
    os.environ.setdefault("OMP_PLACES", "cores")


def machine() -> str:
    import torch

    cpu = platform.processor() or "cpu"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    from engine.load.dtype import cpu_has_native_bf16

    # What --dtype auto makes of a 16-bit or quantized model here (float32 checkpoints stay so).
    bf16 = ("native bfloat16 (auto: bfloat16)" if cpu_has_native_bf16()
            else "no native bfloat16 (auto: float32)")
    return (f"{cpu}, {os.cpu_count()} logical cores, {bf16}, torch {torch.__version__}, "
            f"{torch.get_num_threads()} threads, python {platform.python_version()}")


def cpu_features() -> str:
    """The flags that decide bfloat16 speed here: AVX-512 BF16 (native bfloat16 dot products) and
    AMX (Intel's matrix tiles). Without either, oneDNN emulates bfloat16 about 100x slower."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = set(next(line.split(":", 1)[1].split() for line in f
                             if line.startswith("flags")))
    except (OSError, StopIteration):
        return "cpu flags unknown"
    yes = {True: "yes", False: "no"}
    return (f"avx512f {yes['avx512f' in flags]}, avx512_bf16 {yes['avx512_bf16' in flags]}, "
            f"amx_bf16 {yes['amx_bf16' in flags]}")


def gemm_gflops(n_tokens: int = 256, k: int = 576, n: int = 1536, seconds: float = 1.0,
                dtype: str = "float32") -> float:
    """Measured GEMM speed at a shape of this model, in the model's dtype: the yardstick for the
    arithmetic ceiling."""
    import time

    import torch

    a, b = torch.randn(n_tokens, k,
                       dtype=getattr(torch, dtype)), torch.randn(k, n, dtype=getattr(torch, dtype))
    for _ in range(3):
        a @ b
    reps, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        a @ b
        reps += 1
    return 2 * n_tokens * k * n * reps / (time.perf_counter() - t0) / 1e9


def workload(num_requests: int, prompt_range: tuple[int, int], output_range: tuple[int, int],
             vocab: int, seed: int = 0) -> Workload:
    """Seeded (prompt token ids, output length) pairs; ids avoid the low special-token range."""
    rng = random.Random(seed)
    return [([rng.randrange(100, vocab) for _ in range(rng.randint(*prompt_range))],
             rng.randint(*output_range)) for _ in range(num_requests)]


def token_outputs(outs: Iterable[RequestOutput | Error]) -> list[RequestOutput]:
    """A step's outputs, raising on a request the engine failed: a bench that counted it as a
    request with no tokens would time less work than it reports."""
    from shared.protocol import Error

    tokens = []
    for o in outs:
        if isinstance(o, Error):
            raise RuntimeError(f"request {o.request_id} failed: {o.message}")
        tokens.append(o)
    return tokens


def call_ms(fn: Callable[[], object], runs: int) -> list[float]:
    """ms of each of runs calls of fn, after one warm-up call."""
    fn()
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def min_ms(fn: Callable[[], object], runs: int) -> float:
    """The fastest of runs: on a machine other processes share, the run least disturbed."""
    return min(call_ms(fn, runs))
