"""The served benchmark's first burst, offline: where its TTFT p99 comes from.

bench/vs_vllm.py's TTFT p99 is its first burst: 32 chat prompts (32..512 tokens) at once under a
2,048-token step budget, prefilled in five or six steps, so the last of them gets its first token
once the whole burst is prefilled. This bench replays that burst into an EngineCore with the
server's limits (no sockets, no gateway): each step's time and tokens, and when the last first
token came, for each configuration of --configs (dtype:quantization), the configurations taking
turns --rounds times so that a drifting host moves every side alike. Every burst draws fresh
prompts (a repeated one would be served from the prefix cache).

--ops: the ops of a 2,048-token step that the native decoder stack fuses or replaces, each beside
what it replaces, timed in this run: the gate_up projection on the AMX int4 tiles with SiLU x up in
its epilogue against the GEMM then silu_and_mul (AMX CPUs only), and the native RMSNorm and RoPE
against PyTorch's own ops.

    python bench/prefill_burst.py [--configs auto:auto,bfloat16:none] [--rounds 2] [--ops]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from bench.common import cpu_features, machine

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from engine.core import EngineCore

BURST, STEP_TOKENS = 32, 2048  # bench/vs_vllm.py's clients and --max-num-batched-tokens


def burst(core: EngineCore, tok: PreTrainedTokenizerBase, seed: int,
          tag: str) -> tuple[list[float], float]:
    """The vs_vllm workload's first BURST prompts (seed's draw) at once -> each step's seconds
    until every prompt has its first token, and the seconds to the last first token. The burst's
    decodes then run out, unmeasured."""
    from bench.english import chat_prompts
    from shared.sampling import SamplingParams

    prompts = chat_prompts(tok, 2 * BURST, (32, 512), (8, 256), seed)[:BURST]
    for i, (ids, n) in enumerate(prompts):
        core.add(f"{tag}{i}", ids, SamplingParams(temperature=0, max_tokens=n, min_tokens=n,
                                                  ignore_eos=True))
    steps: list[float] = []
    started, first = time.perf_counter(), set[str]()
    while len(first) < len(prompts):
        t = time.perf_counter()
        core.step()
        steps.append(time.perf_counter() - t)
        first |= {rid for rid, live in core.requests.items()
                  if rid.startswith(tag) and live.root.num_output_tokens > 0}
    last = time.perf_counter() - started
    while core.requests:
        core.step()
    return steps, last


def bursts(args: argparse.Namespace) -> None:
    from engine.core import EngineCore
    from shared.config import DEFAULT_MODEL, build_config
    from shared.model_source import resolve_model
    from shared.tokenizer import load_tokenizer

    tok = load_tokenizer(resolve_model(DEFAULT_MODEL))
    cores = {c: EngineCore(build_config(DEFAULT_MODEL, dtype=c.split(":")[0],
                                        quantization=c.split(":")[1], max_num_seqs=BURST,
                                        max_num_batched_tokens=STEP_TOKENS, max_model_len=1024,
                                        kv_cache_memory="2GiB"))
             for c in args.configs}
    for c, core in cores.items():  # a warm-up burst each: the first after a load is slower
        burst(core, tok, 1, f"w{c}")
    last: dict[str, list[float]] = {c: [] for c in cores}
    for r in range(args.rounds):
        for c, core in cores.items():
            steps, t = burst(core, tok, 2 * r, f"r{r}{c}")
            last[c].append(t)
            print(f"round {r + 1}, {c}: steps {', '.join(f'{s * 1e3:.0f}' for s in steps)} ms; "
                  f"last first token {t * 1e3:.0f} ms", flush=True)
    base = statistics.median(last[args.configs[0]])
    print("\n| dtype:quantization | last first token, median ms | rounds, ms | vs the first |")
    print("|---|---:|---|---:|")
    for c, ts in last.items():
        rounds = ", ".join(f"{t * 1e3:.0f}" for t in ts)
        print(f"| {c} | {statistics.median(ts) * 1e3:.0f} | {rounds} "
              f"| {statistics.median(ts) / base:.2f}x |")


def best_ms(fn: Callable[[], object], reps: int = 20, rounds: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - t) / reps)
    return best * 1e3


def ops(rows: int = STEP_TOKENS) -> None:
    """SmolLM2's shapes at a full step's rows, bfloat16: each native op beside what it replaces."""
    import kernels.cpu
    from engine.load import amx
    from engine.models.rope import apply_rope, rotation

    if not kernels.cpu.available():
        print("the native kernels are not built here: nothing to compare")
        return
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(rows, 576, generator=gen).to(torch.bfloat16)
    w = torch.randn(576, generator=gen).to(torch.bfloat16)
    cases: list[tuple[str, Callable[[], object], Callable[[], object]]] = [
        ("RMSNorm [T, 576]", lambda: torch.ops.conveyor_cpu.rms_norm(x, w, 1e-5),
         lambda: torch.nn.functional.rms_norm(x, (576,), w, 1e-5))]
    qk = torch.randn(rows, 12, 64, generator=gen).to(torch.bfloat16)
    positions = torch.arange(rows) % 1024
    inv_freq = 10000.0 ** (-torch.arange(0, 64, 2).float() / 64)
    angles = torch.outer(torch.arange(1024).float(), inv_freq)
    table = torch.stack((angles.cos(), angles.sin()), dim=-1)  # [P, D/2, 2]
    native_rot, torch_rot = rotation(table, positions, True), rotation(table, positions, False)
    cases.append(("RoPE [T, 12, 64]", lambda: apply_rope(qk, native_rot),
                  lambda: apply_rope(qk, torch_rot)))
    if amx.usable():
        q = torch.randint(0, 16, (3072, 576), generator=gen)
        codes, sz = amx.pack_int4(q, torch.rand(3072, 18, generator=gen) * 0.02 + 1e-3,
                                  torch.randn(3072, 18, generator=gen) * 0.02)
        cases.append(("gate_up [T, 576] x [576, 3072] int4, SiLU x up",
                      lambda: amx.int4_silu_tiles(x, codes, sz),
                      lambda: torch.ops.conveyor_cpu.silu_and_mul(amx.int4_mm_tiles(x, codes, sz))))
    else:
        print("no AMX tiles here: the fused gate_up is not measured")
    print(f"\n| op, {rows} rows | native ms | replaced ms | replaced / native |")
    print("|---|---:|---:|---:|")
    for name, native, replaced in cases:
        a, b = best_ms(native), best_ms(replaced)
        print(f"| {name} | {a:.3f} | {b:.3f} | {b / a:.2f}x |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", type=lambda v: v.split(","), default=["auto:auto"],
                    help="dtype:quantization pairs, the first the baseline")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--ops", action="store_true", help="the fused ops instead of the bursts")
    args = ap.parse_args()
    print(f"machine: {machine()}; {cpu_features()}")
    if args.ops:
        ops()
    else:
        bursts(args)


if __name__ == "__main__":
    main()
