"""The int4 GEMM for AVX-512 BF16 CPUs without AMX against what such a CPU runs today, by rows.

`python bench/int4_avx512.py [--threads 2] [--rows 1,8,32,...]`. Sets
ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 (before torch loads) so oneDNN's packed bfloat16 kernel runs
on AVX-512 BF16, not on AMX, as on the AMD EPYC kind; kernels/cpu/quant_gemm_avx512.cpp never uses
AMX. On an AMX Xeon this is a proxy: its AVX-512 units and caches, not an EPYC's. Over SmolLM2's 30
layers' int4 projections as the model has them (K=576: N=960 fused q/k/v, 576, 3072 fused
gate/up; K=1536: N=576), each called in turn as a forward calls them: torch's int4 kernel, oneDNN's
packed bfloat16 copy, the new kernel, main's switching default on AVX512_BF16 CPUs (torch's int4
kernel below the table's hand-over rows, the copy from there: "main"), and the default as wired now
as a load there decides it: the new kernel at every row count where kernel_calibration.prompt_ratio
times it within AVX512_INVARIANT_RATIO of the copies (invariant), else below the rows
kernel_calibration.calibrate picks here, the copy from there ("wired").

With --head: the model's tied int8 LM head as that kind runs it now (the int8 AMX kernel's rows
path, AVX-512 only, below a calibrated threshold; at every row count under --deterministic) against
its packed bfloat16 copy (padded at one row, as --deterministic had it) and torch's int8 kernel.
"""
from __future__ import annotations

import argparse
import functools
import os
import sys
import time
from collections.abc import Callable
from typing import Any

os.environ["ONEDNN_MAX_CPU_ISA"] = "AVX512_CORE_BF16"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import cpu_features, machine, pin_threads

Call = Callable[[], object]


def best(calls: list[Call], reps: int) -> float:
    """The least seconds of reps passes over calls, after one that warms them."""
    out = float("inf")
    for i in range(reps + 1):
        t0 = time.perf_counter()
        for f in calls:
            f()
        if i:
            out = min(out, time.perf_counter() - t0)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--model", default="SmolLM2-135M-Instruct")
    p.add_argument("--rows", type=lambda v: [int(n) for n in v.split(",")],
                   default=[1, 8, 32, 128, 512, 2048])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--calibrations", type=int, default=3, help="calibrations run (the first wires)")
    p.add_argument("--head", action="store_true",
                   help="the int8 LM head instead of the int4 matrices")
    args = p.parse_args()
    pin_threads(args.threads)
    import torch

    from engine import kernel_calibration, kernel_choice
    from engine.load import int4_avx512
    from engine.load.prepack import PackedLinear, quantized_packed_from
    from engine.load.quant import Int4Linear, Int8Linear
    from engine.load.weights import load_model
    from shared.model_source import resolve_model

    torch.set_num_threads(args.threads)
    print(machine())
    print(f"CPU flags: {cpu_features()}; ONEDNN_MAX_CPU_ISA={os.environ['ONEDNN_MAX_CPU_ISA']}, "
          f"ATen capability {torch.backends.cpu.get_cpu_capability()}")
    model, _ = load_model(resolve_model(args.model), "bfloat16", "cpu", "int4", prepack=False)
    if args.head:
        head(args, [m for m in kernel_choice.switched_modules(model) if isinstance(m, Int8Linear)])
        return
    mods = [m for m in kernel_choice.switched_modules(model)
            if isinstance(m, Int4Linear) and m.tile_codes is not None]
    ratio = kernel_calibration.prompt_ratio(mods)  # as kernel_choice.invariant_by_default decides
    invariant = ratio <= kernel_calibration.AVX512_INVARIANT_RATIO
    copies = [PackedLinear(m.dequantized(), None) for m in mods]
    for m, c in zip(mods, copies):  # as kernel_choice.attach_tiles wires that kind's default
        m.packed, m.tiles_avx512, m.amx_from = c, True, 1
    handover = (quantized_packed_from("AVX512_BF16", args.threads) or {}).get("int4", 1 << 62)
    rows = kernel_calibration.AVX512_CALIBRATION_ROWS  # as kernel_choice.handover_rows calibrates
    chosen = [] if invariant else [min(kernel_calibration.calibrate(mods, rows), rows[-1])
                                   for _ in range(args.calibrations)]
    wired = chosen[0] if chosen else kernel_calibration.NEVER
    how = (f"at every row count, no copy (prompt ratio {ratio:.2f}x)" if invariant else
           f"below {wired} rows (prompt ratio {ratio:.2f}x; calibrations chose {chosen}), packed "
           "copy from there")
    shapes = sorted({m.shape() for m in mods})
    print(f"{args.model}: {len(mods)} int4 matrices (N, K) {shapes}, bfloat16 x, {args.threads} "
          f"threads; ms per forward's projections (best of {args.reps}); main's default on "
          f"AVX512_BF16 = torch int4 below {handover} rows, packed copy from there; wired = the "
          f"new kernel {how}")
    print(f"{'rows':>5} {'torch int4':>10} {'oneDNN bf16':>11} {'new':>8} {'main':>8} "
          f"{'wired':>8} {'new/main':>8} {'wired/main':>10}")
    tiles = [(m.tile_codes, m.tile_scale_zero) for m in mods
             if m.tile_codes is not None and m.tile_scale_zero is not None]
    with torch.inference_mode():
        for r in args.rows:
            xs = [torch.randn(r, m.shape()[1], dtype=torch.bfloat16) for m in mods]
            reps = args.reps if r <= 128 else 2
            q = best([functools.partial(m.quantized_mm, x) for m, x in zip(mods, xs)], reps)
            cp = best([functools.partial(c.forward, x) for c, x in zip(copies, xs)], reps)
            new = best([functools.partial(int4_avx512.int4_mm, x, codes, sz)
                        for (codes, sz), x in zip(tiles, xs)], reps)
            main_ = q if r < handover else cp
            now = new if r < wired else cp
            print(f"{r:>5} {q * 1e3:>10.2f} {cp * 1e3:>11.2f} {new * 1e3:>8.2f} "
                  f"{main_ * 1e3:>8.2f} {now * 1e3:>8.2f} {new / main_:>8.2f} "
                  f"{now / main_:>10.2f}", flush=True)


def head(args: argparse.Namespace, heads: list[Any]) -> None:
    """The --head table: ms a call of each kernel for the head, by rows, and the rows from which
    kernel_choice.handover_rows's calibration hands the head to its copy (NEVER: no copy)."""
    import torch

    from engine import kernel_calibration
    from engine.load import amx
    from engine.load.prepack import PackedLinear

    assert len(heads) == 1 and heads[0].make_tiles(avx512=True), "a tied int8 head on AVX-512 BF16"
    m = heads[0]
    codes, scale = m.tile_codes, m.tile_scale
    copy = PackedLinear(m.dequantized(), None)
    padded = PackedLinear(m.dequantized(), None, pad_one_row=True)
    m.packed, m.amx_from = copy, 1
    rows = kernel_calibration.INT8_CALIBRATION_ROWS
    chosen = [c if c < kernel_calibration.NEVER else "NEVER"
              for c in (kernel_calibration.calibrate([m], rows) for _ in range(args.calibrations))]
    print(f"{args.model}: the int8 head {m.shape()}, bfloat16 x, {args.threads} threads; ms a call "
          f"(best of {args.reps}); calibrations over {rows} chose {chosen} (NEVER: no copy)")
    print(f"{'rows':>5} {'torch int8':>10} {'oneDNN bf16':>11} {'padded':>8} {'rows path':>9} "
          f"{'rows/copy':>9} {'rows/torch':>10}")
    with torch.inference_mode():
        for r in args.rows:
            x = torch.randn(r, m.shape()[1], dtype=torch.bfloat16)
            q = best([functools.partial(m.quantized_mm, x)], args.reps)
            cp = best([functools.partial(copy.forward, x)], args.reps)
            pad = best([functools.partial(padded.forward, x)], args.reps)
            rp = best([functools.partial(amx.int8_mm_rows, x, codes, scale)], args.reps)
            print(f"{r:>5} {q * 1e3:>10.2f} {cp * 1e3:>11.2f} {pad * 1e3:>8.2f} {rp * 1e3:>9.2f} "
                  f"{rp / cp:>9.2f} {rp / q:>10.2f}", flush=True)


if __name__ == "__main__":
    main()
