"""The CPU attention path (TorchBackend) at SmolLM2-135M's shape, as it was and as it is.

One layer's store + attention for batches of decodes and speculative-verification queries, timed
three ways in the same run on the same batch:

  padded, fresh    every sequence padded to the longest context in one call, gathers into new
                   tensors (the backend before context-length buckets and the gather workspace)
  padded, reused   one call, gathers into the reused workspace
  bucketed         the backend as it is: calls split by context length, reused workspace

and the least bytes the layer must read (every cached K/V row once) over the time, against this
machine's copy bandwidth measured first. Uniform contexts are the control: there, bucketing must
cost nothing. Last, the backend as it is over a bfloat16 cache under float32 queries
(--kv-cache-dtype bfloat16), against the float32 cache.

With --native: the native kernel (kernels/cpu) against gather + SDPA, batches of decodes by context
size, in bfloat16 and float32, side by side in one run (what TorchBackend.NATIVE_MAX_CONTEXT once
guessed at).

With --prompts: bfloat16 prompt attention (fresh prompts of 128..2048 tokens, one 512-token chunk
over a cached 1024) on the native kernel's best path against SDPA, plus single decodes over contexts
256..4096 (to see that decode did not get slower), at SmolLM2-135M's shape and a head-dim-128 GQA
shape.

With --decode: decode rows and prompt chunks (bfloat16; float32 with --dtype float32) straight
through the kernel's op, this tree's kernel against the one at git revision --against, calls
alternated in one process, over K/V the host's caches keep and over K/V from memory as in a served
step (bench/attention_decode.py says how).

    python bench/cpu_attention.py [--native | --prompts | --decode [--against REV] [--dtype D]
                                                                    [--new-arithmetic]]
                                  [--threads N]
"""
from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
from collections.abc import Callable
from unittest import mock

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import call_ms, machine, min_ms, pin_threads
from bench.kernels import Case, Shape, attention_traffic, build_batch

# SmolLM2-135M: 9 query heads, 3 KV heads, head_dim 64; the engine's default block size.
SMOLLM2 = Shape(num_heads=9, num_kv_heads=3, head_dim=64, block_size=16)
# Qwen2.5-1.5B's attention
GQA128 = Shape(num_heads=12, num_kv_heads=2, head_dim=128, block_size=16)


def cases() -> list[Case]:
    spread = [32 + (736 * i) // 63 for i in range(64)]  # 32..768, like a mixed serving batch
    return [
        Case("64 decodes, L=256 (uniform)", [1] * 64, [255] * 64),
        Case("64 decodes, L 32..768", [1] * 64, spread),
        Case("256 decodes, L 32..768", [1] * 256, spread * 4),
        Case("32 verifies q=4, L 32..768", [4] * 32, spread[::2]),
    ]


def median_ms(fn: Callable[[], object], runs: int) -> float:
    return statistics.median(call_ms(fn, runs))


def native_cases() -> list[Case]:
    """Decode batches by size and context: the step's total context is what the old limit looked
    at."""
    decodes = [Case(f"{b} decodes x L={n}", [1] * b, [n - 1] * b)
               for b, n in [(1, 128), (1, 4096), (8, 256), (8, 1024), (32, 64), (32, 408),
                            (32, 1024), (64, 2048)]]
    return decodes + [Case("prompt 128", [128], [0]), Case("prompt 512", [512], [0]),
                      Case("chunk 512 over 1024", [512], [1024]),
                      Case("31 dec L=408 + prompt 256", [1] * 31 + [256], [407] * 31 + [0])]


def native_vs_sdpa(runs: int) -> None:
    """One layer's store + attention: gather + SDPA against the native kernel on each code path this
    CPU runs (portable, avx2, avx512: float32 math; avx512_bf16: bfloat16 dot products), per dtype
    and batch; for steps with a prompt, also the native kernel for the decodes with SDPA for the
    prompt."""
    import torch

    import kernels.torch_backend as tb
    import kernels.torch_plan as tp

    sdpa, native = tb.TorchBackend("cpu"), tb.TorchBackend("cpu", native=True)
    native.native_prompts = True  # every row through the kernel, on each path
    # prompts on SDPA: what the backend did before the kernel took them
    old = tb.TorchBackend("cpu", native=True)
    old.native_prompts = False
    if not native.native:
        print("native kernel unavailable here: nothing to compare")
        return
    isas = [i for i in torch.ops.conveyor_cpu.attention_isas() if i != "portable"]
    print(f"one layer's store + attention, H={SMOLLM2.num_heads} Hkv={SMOLLM2.num_kv_heads} "
          f"D={SMOLLM2.head_dim} block={SMOLLM2.block_size}, ms, min of {runs}; x: SDPA / best "
          "native")
    print(f"{'case':26s} {'dtype':9s} {'ctx':>7s} {'gather+SDPA':>12s} {'SDPA prompts':>12s}"
          + "".join(f"{i:>12s}" for i in isas)
          + f" {'x':>6s} {'GB/s':>6s}")
    gen = torch.Generator().manual_seed(0)
    for case in native_cases():
        for dtype in (torch.bfloat16, torch.float32):
            layout, q, k, v, kc, vc = build_batch(case, SMOLLM2, dtype, torch.device("cpu"), gen)
            scale = SMOLLM2.head_dim ** -0.5
            base, meta = sdpa.plan(layout), native.plan(layout)
            want = sdpa.forward(q, k, v, kc, vc, base, scale).float()
            ms = [min_ms(functools.partial(sdpa.forward, q, k, v, kc, vc, base, scale), runs)]
            if any(n > tp.SHORT_QUERY for n in case.query_lens):
                ms.append(min_ms(functools.partial(old.forward, q, k, v, kc, vc, old.plan(layout),
                                                   scale), runs))
            else:
                ms.append(float("nan"))  # no prompt: the same as the native columns
            for isa in isas:
                if isa == "avx512_bf16" and dtype != torch.bfloat16:
                    ms.append(float("nan"))
                    continue
                native.native_isa = isa
                torch.testing.assert_close(native.forward(q, k, v, kc, vc, meta, scale).float(),
                                           want, atol=2e-2, rtol=2e-2)
                ms.append(min_ms(functools.partial(native.forward, q, k, v, kc, vc, meta, scale),
                                 runs))
            best = min(m for m in ms[2:] if m == m)
            nbytes, _ = attention_traffic(case, SMOLLM2, dtype.itemsize)
            ctx = sum(case.context_lens) + sum(case.query_lens)
            print(f"{case.name:26s} {str(dtype)[6:]:9s} {ctx:7d} {ms[0]:12.3f} {ms[1]:12.3f}"
                  + "".join(f"{m:12.3f}" for m in ms[2:])
                  + f" {ms[0] / best:5.1f}x {nbytes / best / 1e6:6.1f}")


def prompts_vs_sdpa(runs: int) -> None:
    """One layer's store + attention in bfloat16: SDPA (the torch backend's prompt path) against the
    native kernel on the path isa "auto" picks, for prompts; decodes on the native kernel alone."""
    import torch

    import kernels.torch_backend as tb

    sdpa, native = tb.TorchBackend("cpu"), tb.TorchBackend("cpu", native=True)
    native.native_prompts = True
    if not native.native:
        print("native kernel unavailable here: nothing to compare")
        return
    print(f"bfloat16, one layer's store + attention, ms, min of {runs}; x: SDPA / native")
    gen = torch.Generator().manual_seed(0)
    for shape in (SMOLLM2, GQA128):
        print(f"H={shape.num_heads} Hkv={shape.num_kv_heads} D={shape.head_dim} "
              f"block={shape.block_size}")
        print(f"{'case':26s} {'SDPA':>9s} {'native':>9s} {'x':>6s} {'GFLOP/s':>8s}")
        prompts = [Case(f"prompt {n}", [n], [0]) for n in (128, 512, 1024, 2048)]
        decodes = [Case(f"1 decode x L={n}", [1], [n - 1]) for n in (256, 1024, 4096)]
        for case in prompts + [Case("chunk 512 over 1024", [512], [1024])] + decodes:
            layout, q, k, v, kc, vc = build_batch(case, shape, torch.bfloat16, torch.device("cpu"),
                                                  gen)
            scale = shape.head_dim ** -0.5
            meta = native.plan(layout)
            run_native = functools.partial(native.forward, q, k, v, kc, vc, meta, scale)
            ms_native = min_ms(run_native, runs)
            _, flops = attention_traffic(case, shape, 2)
            if case.query_lens[0] == 1:
                print(f"{case.name:26s} {'':>9s} {ms_native:9.3f} {'':>6s} "
                      f"{flops / ms_native / 1e6:8.1f}")
                continue
            base = sdpa.plan(layout)
            torch.testing.assert_close(run_native().float(),
                                       sdpa.forward(q, k, v, kc, vc, base, scale).float(),
                                       atol=2e-2, rtol=2e-2)
            ms_sdpa = min_ms(functools.partial(sdpa.forward, q, k, v, kc, vc, base, scale), runs)
            print(f"{case.name:26s} {ms_sdpa:9.3f} {ms_native:9.3f} {ms_sdpa / ms_native:5.2f}x "
                  f"{flops / ms_native / 1e6:8.1f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--runs", type=int, default=15)
    ap.add_argument("--native", action="store_true",
                    help="native kernel vs gather + SDPA, bf16 and fp32")
    ap.add_argument("--prompts", action="store_true",
                    help="bfloat16 prompts: native kernel vs SDPA")
    ap.add_argument("--decode", action="store_true",
                    help="decode rows: this kernel vs --against's")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                    help="--decode's q and cache dtype")
    ap.add_argument("--against", default="main", help="the git revision --decode compares with")
    ap.add_argument("--new-arithmetic", action="store_true",
                    help="--decode: the two revisions compute differently on purpose, so their "
                         "outputs agree within bfloat16's rounding, not bit for bit")
    args = ap.parse_args()
    pin_threads(args.threads)
    import torch

    import kernels.torch_backend as tb
    import kernels.torch_plan as tp

    torch.set_num_threads(args.threads)
    print(f"machine: {machine()}")
    if args.native:
        native_vs_sdpa(args.runs)
        return
    if args.prompts:
        prompts_vs_sdpa(args.runs)
        return
    if args.decode:
        from bench.attention_decode import decode_rows
        decode_rows(args.against, args.runs, args.dtype, not args.new_arithmetic)
        return
    src = torch.empty(1 << 26)  # 256 MiB
    dst = torch.empty_like(src)
    copy_bw = 2 * src.numel() * 4 / median_ms(lambda: dst.copy_(src), 5) / 1e6
    print(f"copy bandwidth: {copy_bw:.1f} GB/s (read + write)")
    print(f"one layer's store + attention, H={SMOLLM2.num_heads} Hkv={SMOLLM2.num_kv_heads} "
          f"D={SMOLLM2.head_dim} block={SMOLLM2.block_size} float32, median of {args.runs}")
    print(f"{'case':30s} {'padded, fresh':>14s} {'padded, reused':>15s} {'bucketed':>9s} "
          f"{'speedup':>8s} {'calls':>6s} {'GB/s':>6s} {'% copy':>7s} {'bf16 cache':>11s} "
          f"{'vs fp32':>8s}")
    gen = torch.Generator().manual_seed(0)

    def fresh_gather(k_cache: torch.Tensor, v_cache: torch.Tensor,
                     blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return k_cache.index_select(0, blocks), v_cache.index_select(0, blocks)

    for case in cases():
        layout, q, k, v, kc, vc = build_batch(case, SMOLLM2, torch.float32, torch.device("cpu"),
                                              gen)
        scale = SMOLLM2.head_dim ** -0.5
        backend = tb.TorchBackend("cpu")
        meta = backend.plan(layout)
        with mock.patch.object(tp, "MAX_BUCKETS", 1):  # every context padded to the longest
            padded_meta = backend.plan(layout)

        fwd = functools.partial(backend.forward, q, k, v, kc, vc)  # -> fwd(meta, scale)
        torch.testing.assert_close(fwd(meta, scale), fwd(padded_meta, scale), atol=1e-4, rtol=1e-4)
        reused = median_ms(functools.partial(fwd, padded_meta, scale), args.runs)
        bucketed = median_ms(functools.partial(fwd, meta, scale), args.runs)
        kc16, vc16 = kc.to(torch.bfloat16), vc.to(torch.bfloat16)
        half = median_ms(functools.partial(backend.forward, q, k, v, kc16, vc16, meta, scale),
                         args.runs)
        with mock.patch.object(backend, "_gather", fresh_gather):  # as it was: new tensors a call
            fresh = median_ms(functools.partial(fwd, padded_meta, scale), args.runs)
        nbytes, _ = attention_traffic(case, SMOLLM2, 4)
        gbs = nbytes / bucketed / 1e6
        print(f"{case.name:30s} {fresh:11.2f} ms {reused:12.2f} ms {bucketed:6.2f} ms "
              f"{fresh / bucketed:7.2f}x {len(meta.batched):6d} {gbs:6.1f} "
              f"{100 * gbs / copy_bw:6.0f}% {half:8.2f} ms {bucketed / half:7.2f}x")


if __name__ == "__main__":
    main()
