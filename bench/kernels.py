"""Triton kernels against the PyTorch backend on a GPU, in achieved memory bandwidth.

Each case times one call of what the engine calls per layer (TritonBackend vs TorchBackend: the
K/V store plus attention; block copies; swaps) and divides the bytes the operation must move at
the least (every cached K/V row read once, new K/V written once, Q read and O written once) by
the time. The yardstick is this device's own copy bandwidth, measured first with a torch copy of
a 1 GiB tensor (and a pinned host<->device copy for the swap cases). Prefill cases also report
TFLOP/s, since long prompts are bound by arithmetic rather than memory.

    python bench/kernels.py             # on a CUDA machine
    python bench/kernels.py --smoke     # tiny shapes on CPU under TRITON_INTERPRET=1 (checks the
                                        # script runs; its timings mean nothing)

On a machine without a GPU it says so and exits with status 0.
"""
from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from kernels.backend import BatchLayout

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# Median milliseconds of one call of fn (timer's answer).
TimeMs = Callable[[Callable[[], object]], float]


@dataclass
class Shape:
    num_heads: int = 32  # Llama-3-8B attention: 32 query heads, 8 KV heads, head_dim 128
    num_kv_heads: int = 8
    head_dim: int = 128
    block_size: int = 16


@dataclass
class Case:
    name: str
    query_lens: list[int]
    context_lens: list[int]


def attention_cases(smoke: bool) -> list[Case]:
    if smoke:
        return [Case("decode b=4 L=40", [1] * 4, [39] * 4),
                Case("prefill 2x24 ctx 8", [24, 24], [8, 8])]
    return [
        Case("decode b=1 L=32k", [1], [32767]),
        Case("decode b=8 L=8k", [1] * 8, [8191] * 8),
        Case("decode b=64 L=2k", [1] * 64, [2047] * 64),
        Case("decode b=256 L=1k", [1] * 256, [1023] * 256),
        Case("decode b=64 mixed L 100..4k", [1] * 64, [100 + 62 * i for i in range(64)]),
        Case("prefill 4x2k", [2048] * 4, [0] * 4),
        Case("chunked prefill 4x512 ctx 4k", [512] * 4, [4096] * 4),
        Case("mixed: 128 decodes L=1k + 512 chunk ctx 2k", [1] * 128 + [512],
             [1023] * 128 + [2048]),
    ]


def timer(device: torch.device, smoke: bool) -> TimeMs:
    """Median milliseconds of fn. On the GPU: triton's do_bench (CUDA events, L2 flushed between
    runs, so cached K/V cannot come from L2); on the CPU smoke run: a few wall-clock runs."""
    if not smoke:
        import triton.testing

        return lambda fn: triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")

    def cpu_time(fn: Callable[[], object]) -> float:
        fn()
        times = []
        for _ in range(2):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)

    return cpu_time


def copy_bandwidth(device: torch.device, time_ms: TimeMs,
                   smoke: bool) -> tuple[float, float | None]:
    """(device copy GB/s, pinned host<->device GB/s or None on the CPU): the yardsticks."""
    import torch

    n = (1 << 30 if not smoke else 1 << 24) // 4
    src = torch.empty(n, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    device_bw = 2 * src.numel() * 4 / time_ms(lambda: dst.copy_(src)) / 1e6  # read + write
    if device.type != "cuda":
        return device_bw, None
    host = torch.empty(n // 4, dtype=torch.float32, pin_memory=True)
    dev = torch.empty_like(host, device=device)
    d2h = host.numel() * 4 / time_ms(lambda: host.copy_(dev)) / 1e6
    h2d = host.numel() * 4 / time_ms(lambda: dev.copy_(host)) / 1e6
    return device_bw, min(d2h, h2d)


def build_batch(case: Case, shape: Shape, dtype: torch.dtype, device: torch.device,
                gen: torch.Generator) -> tuple[BatchLayout, torch.Tensor, torch.Tensor,
                                               torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random q/k/v and a KV cache whose blocks are handed out in a scrambled order.
    -> (layout, q, k, v, k_cache, v_cache)."""
    import torch

    from kernels.backend import BatchLayout

    bs = shape.block_size
    need = [-(-(c + q) // bs) for q, c in zip(case.query_lens, case.context_lens)]
    num_blocks = sum(need) + 1
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables: list[list[int]] = []
    slots: list[int] = []
    at = 0
    for n, q_len, c in zip(need, case.query_lens, case.context_lens):
        table = perm[at: at + n]
        at += n
        tables.append(table)
        slots.extend(table[p // bs] * bs + p % bs for p in range(c, c + q_len))
    t = sum(case.query_lens)
    layout = BatchLayout(case.query_lens, case.context_lens, tables, bs,
                         torch.tensor(slots, dtype=torch.int64))
    shp = (num_blocks, bs, shape.num_kv_heads, shape.head_dim)

    def rand(*size: int) -> torch.Tensor:  # drawn from gen (on the CPU), so a run can be repeated
        return torch.randn(size, generator=gen).to(dtype=dtype, device=device)

    kc, vc = rand(*shp), rand(*shp)
    q = rand(t, shape.num_heads, shape.head_dim)
    k = rand(t, shape.num_kv_heads, shape.head_dim)
    v = rand(t, shape.num_kv_heads, shape.head_dim)
    return layout, q, k, v, kc, vc


def attention_traffic(case: Case, shape: Shape, itemsize: int) -> tuple[int, float]:
    """(least bytes moved, FLOPs) of one layer's store + attention."""
    t = sum(case.query_lens)
    kv_row = 2 * shape.num_kv_heads * shape.head_dim * itemsize  # K and V of one position
    cached_reads = sum(c + q for q, c in zip(case.query_lens, case.context_lens)) * kv_row
    new_kv = t * kv_row * 2  # read k/v, write them into the cache
    q_and_o = 2 * t * shape.num_heads * shape.head_dim * itemsize
    visible = sum(c * q + q * (q + 1) // 2 for q, c in zip(case.query_lens, case.context_lens))
    flops = 4.0 * visible * shape.num_heads * shape.head_dim  # QK^T and PV
    return cached_reads + new_kv + q_and_o, flops


def bench_attention(cases: list[Case], shape: Shape, dtype: torch.dtype, device: torch.device,
                    time_ms: TimeMs, copy_bw: float) -> None:
    import torch

    gen = torch.Generator().manual_seed(0)
    print(f"\nattention per layer (store K/V + attention), H={shape.num_heads} "
          f"Hkv={shape.num_kv_heads} D={shape.head_dim} block={shape.block_size} {dtype}")
    print(f"{'case':44s} {'plan ms':>8s} {'triton ms':>10s} {'torch ms':>9s} {'speedup':>8s} "
          f"{'GB/s':>8s} {'% copy':>7s} {'TFLOP/s':>8s} {'rel err':>8s}")
    for case in cases:
        bench_attention_case(case, shape, dtype, device, time_ms, copy_bw, gen)
        if device.type == "cuda":
            torch.cuda.empty_cache()


def bench_attention_case(case: Case, shape: Shape, dtype: torch.dtype, device: torch.device,
                         time_ms: TimeMs, copy_bw: float, gen: torch.Generator) -> None:
    """One row of the attention table: plan once, then time forward on both backends."""
    import torch

    from kernels.torch_backend import TorchBackend
    from kernels.triton_backend import TritonBackend

    layout, q, k, v, kc, vc = build_batch(case, shape, dtype, device, gen)
    scale = shape.head_dim ** -0.5
    tri, ref = TritonBackend(device), TorchBackend(device)
    t0 = time.perf_counter()
    tri_meta = tri.plan(layout)
    plan_ms = (time.perf_counter() - t0) * 1e3
    ref_meta = ref.plan(layout)
    out_tri = tri.forward(q, k, v, kc, vc, tri_meta, scale)
    try:
        out_ref = ref.forward(q, k, v, kc, vc, ref_meta, scale)
        err = ((out_tri.float() - out_ref.float()).abs().max() / out_ref.float().abs().max()).item()
        ms_ref = time_ms(lambda: ref.forward(q, k, v, kc, vc, ref_meta, scale))
    except torch.OutOfMemoryError:  # the reference's padded gathers can be large
        err, ms_ref = float("nan"), float("nan")
    ms_tri = time_ms(lambda: tri.forward(q, k, v, kc, vc, tri_meta, scale))
    nbytes, flops = attention_traffic(case, shape, q.element_size())
    gbs = nbytes / ms_tri / 1e6
    print(f"{case.name:44s} {plan_ms:8.2f} {ms_tri:10.3f} {ms_ref:9.3f} {ms_ref / ms_tri:7.2f}x "
          f"{gbs:8.0f} {100 * gbs / copy_bw:6.0f}% {flops / ms_tri / 1e9:8.1f} {err:8.1e}")


def bench_store(shape: Shape, dtype: torch.dtype, device: torch.device, time_ms: TimeMs,
                copy_bw: float, smoke: bool) -> None:
    import torch

    from kernels.triton import store_kv

    t = 64 if smoke else 16384
    num_blocks = 2 * t // shape.block_size
    kc = torch.zeros(num_blocks, shape.block_size, shape.num_kv_heads, shape.head_dim, dtype=dtype,
                     device=device)
    vc = torch.zeros_like(kc)
    k = torch.randn(t, shape.num_kv_heads, shape.head_dim, dtype=dtype, device=device)
    v = torch.randn_like(k)
    slots = torch.randperm(num_blocks * shape.block_size, device=device)[:t]
    ms_tri = time_ms(lambda: store_kv(k, v, kc, vc, slots))

    def torch_store() -> None:
        kc.view(-1, shape.num_kv_heads, shape.head_dim).index_copy_(0, slots, k)
        vc.view(-1, shape.num_kv_heads, shape.head_dim).index_copy_(0, slots, v)

    ms_ref = time_ms(torch_store)
    gbs = 4 * k.numel() * k.element_size() / ms_tri / 1e6
    print(f"\nstore K/V, {t} tokens to scattered slots: triton {ms_tri:.3f} ms, torch index_copy "
          f"{ms_ref:.3f} ms ({ms_ref / ms_tri:.2f}x), {gbs:.0f} GB/s = {100 * gbs / copy_bw:.0f}% "
          "of copy")


def kv_pool(shape: Shape, layers: int, num_blocks: int, dtype: torch.dtype,
            device: torch.device | str, pin: bool = False) -> torch.Tensor:
    import torch

    return torch.empty(layers, 2, num_blocks, shape.block_size, shape.num_kv_heads, shape.head_dim,
                       dtype=dtype, device=device, pin_memory=pin).normal_()


def bench_blocks(shape: Shape, dtype: torch.dtype, device: torch.device, time_ms: TimeMs,
                 copy_bw: float, link_bw: float | None, smoke: bool) -> None:
    import torch

    from kernels.torch_backend import TorchBackend
    from kernels.triton_backend import TritonBackend

    layers, n, pool_blocks = (2, 4, 16) if smoke else (32, 256, 1024)
    tri, ref = TritonBackend(device), TorchBackend(device)
    kv = kv_pool(shape, layers, pool_blocks, dtype, device)
    perm = torch.randperm(pool_blocks)
    src, dst = perm[:n].to(device), perm[n: 2 * n].to(device)
    block_bytes = (layers * 2 * shape.block_size * shape.num_kv_heads * shape.head_dim
                   * kv.element_size())
    ms_tri = time_ms(lambda: tri.copy_blocks(kv, src, dst))
    ms_ref = time_ms(lambda: ref.copy_blocks(kv, src, dst))
    gbs = 2 * n * block_bytes / ms_tri / 1e6
    print(f"\ncopy_blocks, {n} blocks x {layers} layers: triton {ms_tri:.3f} ms, torch "
          f"{ms_ref:.3f} ms ({ms_ref / ms_tri:.2f}x), {gbs:.0f} GB/s = {100 * gbs / copy_bw:.0f}% "
          "of copy")
    if link_bw is None:  # on the CPU: no host<->device link to swap over
        return
    host = kv_pool(shape, layers, pool_blocks, dtype, "cpu", pin=True)
    h_dst = perm[2 * n: 3 * n]
    for name, args in [("swap out", (kv, host, src, h_dst)), ("swap in", (host, kv, h_dst, dst))]:
        ms_tri = time_ms(functools.partial(tri.swap_blocks, *args))
        ms_ref = time_ms(functools.partial(ref.swap_blocks, *args))
        gbs = n * block_bytes / ms_tri / 1e6
        print(f"{name}, {n} blocks x {layers} layers: triton {ms_tri:.3f} ms, torch {ms_ref:.3f} "
              f"ms ({ms_ref / ms_tri:.2f}x), {gbs:.1f} GB/s = {100 * gbs / link_bw:.0f}% of a "
              "pinned bulk copy")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--smoke", action="store_true",
                        help="tiny shapes on CPU under TRITON_INTERPRET=1")
    args = parser.parse_args()
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before any kernel module is imported
    import torch

    if not args.smoke and not torch.cuda.is_available():
        print("bench/kernels.py: no CUDA GPU on this machine, so there is nothing to time: the "
              "Triton kernels run on a GPU (on CPU only under the interpreter, which the tests "
              "use). Run it on a GPU machine.")
        return 0
    device = torch.device("cpu" if args.smoke else "cuda")
    dtype = getattr(torch, args.dtype) if not args.smoke else torch.float32
    name = (torch.cuda.get_device_name(device) if device.type == "cuda"
            else "CPU (interpreter smoke run)")
    time_ms = timer(device, args.smoke)
    copy_bw, link_bw = copy_bandwidth(device, time_ms, args.smoke)
    print(f"device: {name}, torch {torch.__version__}")
    print(f"measured copy bandwidth: {copy_bw:.0f} GB/s (read + write of a "
          f"{'1 GiB' if not args.smoke else '16 MiB'} tensor)" + ("; pinned host<->device: "
                                                                  f"{link_bw:.1f} GB/s" if link_bw
                                                                  else ""))
    shape = Shape(num_heads=4, num_kv_heads=2, head_dim=64) if args.smoke else Shape()
    bench_attention(attention_cases(args.smoke), shape, dtype, device, time_ms, copy_bw)
    bench_store(shape, dtype, device, time_ms, copy_bw, args.smoke)
    bench_blocks(shape, dtype, device, time_ms, copy_bw, link_bw, args.smoke)
    return 0


if __name__ == "__main__":
    sys.exit(main())
