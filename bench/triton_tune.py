"""Sweep the Triton prefill kernel's launch choices on this GPU, to fill kernels/triton/prefill.py's
PREFILL_TUNED.

Per shape it times the current (fallback) configuration, SDPA's flash kernel on a contiguous causal
copy of the same Q/K/V (the yardstick), and a small grid of PrefillKnobs (tile rows BLOCK_M =
BLOCK_Q * padded GQA group, keys per iteration BLOCK_N, num_warps, num_stages). Each config's output
is checked against the current config's (max abs diff); a wrong one, or one that fails to compile or
launch, is reported and rejected. Times are CUDA-event medians after warm-up (compile excluded, L2
flushed before each rep). Rows print as they finish, and --max-seconds shares the time between the
shapes and stops early, so a lent GPU with a hard budget still gets every shape's best-so-far.
Triton's default num_stages is 3 on CUDA, so the grid's row equal to the current config but for s=3
is the same kernel: the gap between it and "current" is the run-to-run noise (up to ~15% on the
small SmolLM2 shape on an H100).

    python bench/triton_tune.py --quick --max-seconds 120  # bench/gpu_check.sh --bench runs this
    python bench/triton_tune.py                   # the full grid (about 150 s on an H100)
    python bench/triton_tune.py --smoke           # tiny, 2 configs, CPU under TRITON_INTERPRET=1

On a machine without a GPU (and without --smoke) it says so and exits with status 0.
"""
from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from kernels.triton.prefill import PrefillKnobs

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# Median milliseconds of one call of fn (timer's answer).
TimeMs = Callable[[Callable[[], object]], float]


@dataclass
class Shape:
    name: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int


@dataclass
class Case:
    name: str
    q_len: int  # new tokens of each sequence
    ctx: int  # cached tokens before them
    batch: int


def shapes(mode: str) -> list[Shape]:
    """SmolLM2-135M, Llama-3.2-1B (D 64) and Llama-3-8B (D 128, bench/kernels.py's shape)."""
    if mode == "smoke":
        return [Shape("tiny 4/2/64", 4, 2, 64, 16)]
    out = [Shape("smollm2 9/3/64", 9, 3, 64, 16), Shape("1b 32/8/64", 32, 8, 64, 16),
           Shape("8b 32/8/128", 32, 8, 128, 16)]
    if mode == "full":
        out.append(Shape("8b 32/8/128 block 32", 32, 8, 128, 32))
    return out


def cases(mode: str) -> list[Case]:
    """bench/kernels.py's two prefill rows: fresh 4x2k and 4 chunks of 512 over a 4k prefix."""
    if mode == "smoke":
        return [Case("2x24 ctx 8", 24, 8, 2)]
    out = [Case("4x2k", 2048, 0, 4), Case("4x512 ctx 4k", 512, 4096, 4)]
    if mode == "full":
        out.append(Case("1x4k", 4096, 0, 1))
    return out


def grid(mode: str, head_dim: int) -> list[PrefillKnobs]:
    """PrefillKnobs to try after the current config; num_stages outermost so a cut-short run has
    tried every tile shape at 2-3 stages first. BLOCK_N is capped so K and V tiles stay <= 32
    KiB."""
    from kernels.triton.prefill import PrefillKnobs

    if mode == "smoke":
        return [PrefillKnobs(block_m=16, block_n=16, num_warps=4, num_stages=2)]
    block_ms = (64, 128)
    block_ns = (32, 64, 128) if mode == "full" else (64, 128) if head_dim <= 64 else (32, 64)
    warps = (4, 8)
    stages = (2, 3, 1, 4) if mode == "full" else (2, 3)
    return [PrefillKnobs(block_m=m, block_n=n, num_warps=w, num_stages=s)
            for s, m, n, w in itertools.product(stages, block_ms, block_ns, warps)
            if n * head_dim <= 128 * 128]


def build(shape: Shape, case: Case, dtype: torch.dtype, device: torch.device,
          gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Contiguous Q/K/V, the same K/V scattered into a paged cache (blocks in a scrambled order),
    and the prefill launcher's int32 metadata."""
    import torch

    bs, b, hkv, d = shape.block_size, case.batch, shape.num_kv_heads, shape.head_dim
    length = case.ctx + case.q_len
    per_seq = -(-length // bs)
    num_blocks = b * per_seq
    perm = torch.randperm(num_blocks, generator=gen)
    tables = perm.view(b, per_seq).to(torch.int32)
    q = torch.randn(b, case.q_len, shape.num_heads, d, dtype=dtype, generator=gen).to(device)
    k = torch.randn(b, length, hkv, d, dtype=dtype, generator=gen).to(device)
    v = torch.randn(b, length, hkv, d, dtype=dtype, generator=gen).to(device)
    kc = torch.zeros(num_blocks, bs, hkv, d, dtype=dtype, device=device)
    vc = torch.zeros_like(kc)
    pad = per_seq * bs - length
    for cache, src in ((kc, k), (vc, v)):
        padded = torch.nn.functional.pad(src, (0, 0, 0, 0, 0, pad)).view(b * per_seq, bs, hkv, d)
        cache[tables.view(-1).long().to(device)] = padded
    i32 = torch.int32
    return dict(q=q, k=k, v=v, kc=kc, vc=vc, tables=tables.to(device),
                q_start=torch.arange(b, dtype=i32, device=device) * case.q_len,
                q_lens=torch.full((b,), case.q_len, dtype=i32, device=device),
                ctx_lens=torch.full((b,), case.ctx, dtype=i32, device=device))


def run_prefill(shape: Shape, case: Case, data: dict[str, torch.Tensor],
                knobs: PrefillKnobs) -> Callable[[], torch.Tensor]:
    """A closure that launches the prefill kernel with knobs (the tile list built for its
    BLOCK_Q)."""
    import torch

    from kernels.triton import prefill_attention, prefill_block_q, prefill_tiles

    q = data["q"].view(-1, shape.num_heads, shape.head_dim)
    block_q = prefill_block_q(shape.num_heads, shape.num_kv_heads, q.dtype, knobs.block_m)
    seqs, starts = prefill_tiles([case.q_len] * case.batch, block_q)
    tile_seq = torch.tensor(seqs, dtype=torch.int32, device=q.device)
    tile_start = torch.tensor(starts, dtype=torch.int32, device=q.device)
    out = torch.empty_like(q)

    def fn() -> torch.Tensor:
        prefill_attention(out, q, data["kc"], data["vc"], tile_seq, tile_start, data["q_start"],
                          data["q_lens"], data["ctx_lens"], data["tables"], shape.head_dim ** -0.5,
                          knobs)
        return out

    return fn


def run_sdpa(shape: Shape, case: Case, data: dict[str, torch.Tensor],
             flash: bool) -> Callable[[], torch.Tensor]:
    """SDPA on [B, H, L, D] copies, K/V repeated to every query head, causal aligned to the end (the
    chunk's tokens see the whole prefix); restricted to the flash kernel on a GPU."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    group = shape.num_heads // shape.num_kv_heads
    q = data["q"].transpose(1, 2).contiguous()
    k, v = (data[x].repeat_interleave(group, dim=2).transpose(1, 2).contiguous()
            for x in ("k", "v"))
    mask = causal_lower_right(case.q_len, case.ctx + case.q_len) if case.ctx else None

    def fn() -> torch.Tensor:
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]) if flash else contextlib.nullcontext():
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                                 scale=shape.head_dim ** -0.5)
        return out.transpose(1, 2).reshape(-1, shape.num_heads, shape.head_dim)

    return fn


def timer(device: torch.device, reps: int) -> TimeMs:
    """Median ms of fn over reps, after 2 warm-up calls. GPU: CUDA events, L2 flushed before each
    rep (as triton's do_bench does), so K/V comes from memory as it would in a model's layer
    loop."""
    import torch

    if device.type != "cuda":
        def cpu_time(fn: Callable[[], object]) -> float:
            fn()
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e3
        return cpu_time
    flush = torch.empty(256 << 20, dtype=torch.int8, device=device)

    def gpu_time(fn: Callable[[], object]) -> float:
        for _ in range(2):
            fn()
        times: list[float] = []
        for _ in range(reps):
            flush.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times)

    return gpu_time


def flops(shape: Shape, case: Case) -> float:
    visible = case.batch * (case.ctx * case.q_len + case.q_len * (case.q_len + 1) // 2)
    return 4.0 * visible * shape.num_heads * shape.head_dim  # QK^T and PV


def knobs_label(knobs: PrefillKnobs, shape: Shape, dtype: torch.dtype) -> str:
    from kernels.triton.prefill import prefill_config

    cfg = prefill_config(shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.block_size,
                         dtype, False, knobs)
    return (f"M={cfg['BLOCK_Q'] * cfg['GROUP_PAD']:<3d} (Q={cfg['BLOCK_Q']:<2d}) "
            f"N={cfg['BLOCK_N']:<3d} w={cfg['num_warps']} s={cfg.get('num_stages', '-')}")


def tune_shape(shape: Shape, mode: str, dtype: torch.dtype, device: torch.device, time_ms: TimeMs,
               deadline: float) -> None:
    """One table: every case's SDPA and current time, then each config's time on every case."""
    import torch

    from kernels.triton.prefill import device_arch, prefill_knobs

    gen = torch.Generator().manual_seed(0)
    tol = {torch.float32: 1e-3, torch.float16: 1e-2}.get(dtype, 3e-2)  # a few output ulps
    current = prefill_knobs(device_arch(device), shape.head_dim, dtype,
                            shape.num_heads // shape.num_kv_heads)
    print(f"\n== {shape.name} (H={shape.num_heads} Hkv={shape.num_kv_heads} D={shape.head_dim} "
          f"block {shape.block_size}) {str(dtype)[6:]}; current: "
          f"{knobs_label(current, shape, dtype)}", flush=True)
    rows = []
    for case in cases(mode):
        data = build(shape, case, dtype, device, gen)
        cur_fn = run_prefill(shape, case, data, current)
        ref = cur_fn().clone()
        sdpa_fn = run_sdpa(shape, case, data, flash=device.type == "cuda")
        sdpa_name = "SDPA flash" if device.type == "cuda" else "SDPA (CPU)"
        try:
            sdpa_out = sdpa_fn()
            sdpa_ms = time_ms(sdpa_fn)
            sdpa_err = (sdpa_out.float() - ref.float()).abs().max().item()
        except RuntimeError as e:  # no flash kernel for this dtype/device
            print(f"  {case.name}: SDPA flash unavailable ({str(e).splitlines()[0][:80]})")
            sdpa_ms, sdpa_err = float("nan"), float("nan")
        cur_ms = time_ms(cur_fn)
        fl = flops(shape, case)
        print(f"  {case.name:14s} current {cur_ms:7.3f} ms {fl / cur_ms / 1e9:6.1f} TFLOP/s | "
              f"{sdpa_name} {sdpa_ms:7.3f} ms {fl / sdpa_ms / 1e9:6.1f} TFLOP/s | current/SDPA "
              f"speed {sdpa_ms / cur_ms:.2f}x, max |diff| {sdpa_err:.1e}", flush=True)
        rows.append((case, data, ref, cur_ms, sdpa_ms))
    print(f"  {'config':30s} " + " ".join(f"{c.name + ' ms':>17s} {'TFLOP/s':>7s} {'vs cur':>6s} "
                                          f"{'vs SDPA':>7s}"
                                          for c, *_ in rows) + "  max|diff|  compile s")
    results = []
    for knobs in grid(mode, shape.head_dim):
        if knobs == current:
            continue
        if time.monotonic() > deadline:
            print("  -- time share used up: the rest of this grid is skipped", flush=True)
            break
        line = f"  {knobs_label(knobs, shape, dtype):30s}"
        times, worst, t0, compile_s = [], 0.0, time.monotonic(), 0.0
        try:
            for i, (case, data, ref, cur_ms, sdpa_ms) in enumerate(rows):
                fn = run_prefill(shape, case, data, knobs)
                diff = (fn().float() - ref.float()).abs().max().item()
                if i == 0:
                    compile_s = time.monotonic() - t0  # .item() above waited for the kernel
                worst = max(worst, diff)
                if not diff <= tol:  # NaN fails too
                    raise ValueError(f"wrong: max |diff| {diff:.2e} > {tol:.0e} on {case.name}")
                ms = time_ms(fn)
                times.append(ms)
                line += (f" {ms:17.3f} {flops(shape, case) / ms / 1e9:7.1f} {cur_ms / ms:5.2f}x "
                         f"{sdpa_ms / ms:6.2f}x")
        # a config that fails to compile, launch or match is rejected, not fatal
        except Exception as e:
            msg = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
            print(f"{line}  REJECTED ({type(e).__name__}: {msg[:100]})", flush=True)
            continue
        print(f"{line}  {worst:9.1e}  {compile_s:6.1f}", flush=True)
        results.append((statistics.geometric_mean([t / r[3] for t, r in zip(times, rows)]), knobs))
    # runs differ by ~10%: not just 1
    for rank, (rel, knobs) in enumerate(sorted(results, key=lambda r: r[0])[:3]):
        print(f"  {'best' if rank == 0 else 'next'}: {knobs_label(knobs, shape, dtype)}  "
              f"{1 / rel:.2f}x the current config (geometric mean over the cases); for "
              f"PREFILL_TUNED: {knobs}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="3 shapes x 2 cases x 16 configs (gpu_check.sh)")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny shape, 2 configs, CPU under TRITON_INTERPRET=1")
    parser.add_argument("--max-seconds", type=float, default=150.0,
                        help="stop early and print what there is")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--reps", type=int, default=10, help="timed runs per measurement (median)")
    args = parser.parse_args()
    started = time.monotonic()
    smoke = args.smoke or os.environ.get("TRITON_INTERPRET") == "1"
    if smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before any kernel module is imported
    import torch

    if not smoke and not torch.cuda.is_available():
        print("bench/triton_tune.py: no CUDA GPU on this machine, so there is nothing to tune. Run "
              "it on a GPU machine (or with --smoke: tiny shapes under the Triton interpreter, "
              "timings meaningless).")
        return 0
    import triton

    from kernels.triton.prefill import device_arch

    device = torch.device("cpu" if smoke else "cuda")
    dtype = torch.float32 if smoke else getattr(torch, args.dtype)
    mode = "smoke" if smoke else "quick" if args.quick else "full"
    name = (f"{torch.cuda.get_device_name(device)} ({device_arch(device)})" if device.type == "cuda"
            else "CPU (interpreter smoke run, timings mean nothing)")
    print(f"device: {name}, torch {torch.__version__}, triton {triton.__version__}, mode {mode}, "
          f"budget {args.max_seconds:.0f} s", flush=True)
    time_ms = timer(device, args.reps)
    todo = shapes(mode)
    for i, shape in enumerate(todo):
        left = args.max_seconds - (time.monotonic() - started)
        if left <= 0:
            print(f"\n-- --max-seconds reached: {', '.join(s.name for s in todo[i:])} not tuned",
                  flush=True)
            break
        tune_shape(shape, mode, dtype, device, time_ms, time.monotonic() + left / (len(todo) - i))
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print(f"\ndone in {time.monotonic() - started:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
