"""Timing at load: from how many rows a quantized projection's packed copy beats the kernel below
it, measured on the model's own matrices as a forward meets them (every layer in turn, so cold in
cache), where no table holds for this CPU kind (engine/kernel_choice.py decides with it).
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from engine.load import amx, int8_avx2
from engine.load.prepack import PackedLinear
from engine.load.quant import Int4Linear, Int8Linear, QuantizedLinear

# Row counts a calibration tries; the first from which the packed copy is faster is the threshold.
CALIBRATION_ROWS = (1, 2, 4, 6, 8, 12, 16, 24, 32)
# For the AVX-512 BF16 int4 kernel, which stayed ahead of the copies to 32 rows on the proxy
# (docs/kernels.md), up to 128, where the default hands over at all (prompt_ratio decides); where it
# wins even at 128 the copy still takes 128 rows and more.
AVX512_CALIBRATION_ROWS = (*CALIBRATION_ROWS, 48, 64, 96, 128)
# For the int8 kernels below a copy (the AVX2 kernel with float32 activations; on AVX-512 BF16 CPUs
# without AMX the int8 AMX kernel's rows path): the copy takes over from the first of these where it
# wins to the last; none: the kernel at every row count. Not 128: there the AVX2 kernel's copy is
# MKL's plain matrix, which lost (docs/kernels.md), and a head call that large (a row per sequence
# whose logits a step needs) is rare, so it would decide the common sizes.
INT8_CALIBRATION_ROWS = (1, 2, 4, 8, 16, 32, 64)
NEVER = 1 << 62  # packed_from of a copy that no row count takes
# Where the AVX-512 BF16 int4 kernel takes every row count by default, so that the quantized default
# is batch-invariant (engine/kernel_choice.py, issue #30): its time on prompt-sized calls at most
# this many times the packed copies'. Prompt GEMMs were under 30% of served time (issue #25's
# profile), so 1.15x costs at most ~4.5% of throughput; on the proxy the kernel took 1.09x at 512
# rows and served throughput moved 0.95-1.03x (docs/determinism.md).
AVX512_INVARIANT_RATIO = 1.15
PROMPT_ROWS = 512  # a served prompt step's rows, for that ratio
# The matrices a float32 calibration and that ratio time: six layers' four projections (~85 MB of
# float32 copies, so cold as in a forward). All 120 took 20.3 s against 3.0 s for the float32 one,
# same choice (docs/kernels.md); the ratio took 1.25-1.30 s on the proxy.
CALIBRATION_MATRICES = 24


def calibrate(modules: Sequence[QuantizedLinear], rows: Sequence[int] = CALIBRATION_ROWS,
              reps: int = 3) -> int:
    """The first row count from which the packed copies, called in turn as a forward calls them,
    are faster than the kernel below them (_below) at that row count and every larger one tried;
    NEVER if none."""
    faster = [packed < quantized for _, quantized, packed, *_ in chain_times(modules, rows, reps)]
    for i, r in enumerate(rows):
        if all(faster[i:]):
            return r
    return NEVER


def chain_times(modules: Sequence[QuantizedLinear], rows: Sequence[int], reps: int = 3,
                clock: Callable[[], float] = time.perf_counter
                ) -> list[tuple[int, float, float, float, float]]:
    """-> (rows, seconds through the kernels below the copies (_below), through the packed copies,
    through the AMX kernel's tiles, through its rows path: inf where the modules have no AMX codes
    or the rows path does not take that many rows), the best of reps, for one call of each module
    in turn (each module's weights leave the cache before it comes round again, as in a forward).
    clock: a bench on a shared machine passes time.thread_time (one thread)."""
    out = []
    # AMX columns only where AMX runs and the codes are not the AVX-512 BF16 kernel's
    tiled = [m for m in modules if isinstance(m, Int4Linear) and m.tile_codes is not None
             and not m.tiles_avx512 and amx.usable()]
    below = [_below(m) for m in modules]
    with torch.inference_mode():
        for r in rows:
            xs = [torch.randn(r, m.shape()[1], dtype=m.scales_dtype()) for m in modules]
            quantized = _best(list(zip(below, xs)), reps, clock)
            copies = [(m.packed, x) for m, x in zip(modules, xs) if m.packed is not None]
            packed = _best(copies, reps, clock)
            tx = [torch.randn(r, m.shape()[1], dtype=torch.bfloat16) for m in tiled]
            tiles = [(_amx_call(m, False), x) for m, x in zip(tiled, tx)]
            by_rows = [(_amx_call(m, True), x) for m, x in zip(tiled, tx)]
            out.append((r, quantized, packed, _best(tiles, reps, clock) if tiles else float("inf"),
                        _best(by_rows, reps, clock) if tiled and r <= amx.ROWS_PATH_LIMIT
                        else float("inf")))
    return out


def prompt_ratio(modules: Sequence[Int4Linear]) -> float:
    """The AVX-512 BF16 int4 kernel's time over packed bfloat16 copies' at PROMPT_ROWS, on the
    first CALIBRATION_MATRICES of modules called in turn as a forward calls them. The copies are
    made for the timing and dropped after it; the modules leave as they came."""
    sample = list(modules[:CALIBRATION_MATRICES])
    before = [(m.tiles_avx512, m.packed) for m in sample]
    for m in sample:
        m.tiles_avx512, m.packed = True, PackedLinear(m.dequantized(), None)
    try:
        [(_, kernel, copies, *_)] = chain_times(sample, (PROMPT_ROWS,))
    finally:
        for m, (avx512, packed) in zip(sample, before):
            m.tiles_avx512, m.packed = avx512, packed
    return kernel / copies


def _below(m: QuantizedLinear) -> Callable[[torch.Tensor], torch.Tensor]:
    """The kernel m takes below its packed copy: the AVX-512 BF16 int4 kernel where tiles_avx512,
    the int8 AMX kernel's rows path where an int8 matrix has tiles_avx512, the int8 AVX2 kernel
    where m has its codes, else torch's int kernel."""
    if isinstance(m, Int4Linear) and m.tiles_avx512:
        return m.tile_mm
    if isinstance(m, Int8Linear) and m.tiles_avx512:
        tile_codes, tile_scale = m.tile_codes, m.tile_scale
        assert tile_codes is not None and tile_scale is not None  # make_tiles made both
        return lambda x: amx.int8_mm_rows(x, tile_codes, tile_scale)
    if isinstance(m, Int8Linear) and (codes := m.avx2_codes) is not None:
        return lambda x: int8_avx2.int8_mm(x, codes, m.scales)
    return m.quantized_mm


def _amx_call(m: Int4Linear, rows_path: bool) -> Callable[[torch.Tensor], torch.Tensor]:
    """x -> x @ W.T on the AMX kernel's rows path or on its tiles, whatever the rows."""
    codes, scale_zero = m.tile_codes, m.tile_scale_zero
    assert codes is not None and scale_zero is not None
    if rows_path:
        return lambda x: amx.int4_mm_rows(x, codes, scale_zero, m.tile_min_exponent)
    return lambda x: amx.int4_mm_tiles(x, codes, scale_zero)


def _best(calls: Sequence[tuple[Callable[[torch.Tensor], torch.Tensor], torch.Tensor]], reps: int,
          clock: Callable[[], float]) -> float:
    """The least seconds of reps passes over calls (f, x) -> f(x), after one that warms them."""
    best = float("inf")
    for i in range(reps + 1):
        t0 = clock()
        for f, x in calls:
            f(x)
        if i:
            best = min(best, clock() - t0)
    return best
