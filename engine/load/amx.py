"""Quantized codes repacked for the AMX GEMMs of kernels/cpu/quant_gemm.cpp (and its rows path), and
int8 codes for kernels/cpu/quant_int8.cpp (pack_int8, int8_mm: the same tiles and rows path).

The kernel dequantizes one B tile (16 output columns x 32 k) at a time into the layout TDPBF16PS
reads: 16 rows, one per pair of k, each holding the 16 columns' two k values side by side (element e
of row r is column e // 2 at k = 2r + e % 2). The codes are stored in that element order, so
dequantizing a tile row is one contiguous read of 16 bytes (element j in the low nibble of byte j,
element 16 + j in the high one).

A call of at most ROWS_PATH_MAX rows takes the kernel's rows path instead (AVX-512 FMAs on the
weights dequantized in registers, the arithmetic TDPBF16PS performs, so each row's bits are the
tiles' bits: the kernel's header and docs/kernels.md): a few rows do not pay for dequantizing a
panel into tiles.
"""
from __future__ import annotations

from functools import cache

import torch

import kernels.cpu

TILE_N, TILE_K = 16, 32
# Rows up to which int4_mm takes the rows path: where it beat the tiles in `python
# bench/quantized.py --gemm` on the quiet 2-core AMX Xeon, 1 and 2 threads (docs/kernels.md,
# 2026-11-27: one row at both, since the tiles stream their panels).
ROWS_PATH_MAX = 1
ROWS_PATH_LIMIT = 8  # the most rows the kernel's rows path takes
# Rows up to which int8_mm takes its rows path (measured: docs/kernels.md, "The int8 GEMM").
INT8_ROWS_PATH_MAX = 2


@cache
def usable() -> bool:
    """Whether this CPU and OS run AMX tiles and the native kernels are built."""
    return kernels.cpu.available() and bool(torch.ops.conveyor_cpu.amx_usable())


def fits(n: int, k: int) -> bool:
    return n % TILE_N == 0 and k % TILE_K == 0


def _tile_order(q: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [N/16, K/32, 16, 32]: tile (column block, k block), row r, element e."""
    n, k = q.shape
    t = q.reshape(n // TILE_N, TILE_N, k // TILE_K, TILE_K // 2, 2)  # [nb, column, kb, r, parity]
    return t.permute(0, 2, 3, 1, 4).reshape(n // TILE_N, k // TILE_K, TILE_K // 2, 2 * TILE_N)


def _panel_order(t: torch.Tensor) -> torch.Tensor:
    """[N/16, K/32, ...] by tile -> [N/16 * K/32, ...] in the order the kernels read them: panel by
    panel (two column tiles; the last one alone where N/16 is odd), k tile by k tile, the panel's
    column tiles side by side. One sequential stream per thread (its panels are consecutive)."""
    nt, kt = t.shape[:2]
    pairs = t[:nt - nt % 2].unflatten(0, (nt // 2, 2)).transpose(1, 2)  # [panel, kt, 2, ...]
    return torch.cat((pairs.flatten(0, 2), t[nt - nt % 2:].flatten(0, 1)))


def pack_int4(q: torch.Tensor, scale: torch.Tensor,
              zero: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes q [N, K] in 0..15 with w = (q - 8) * scale + zero, scale and zero [N, K/32] ->
    (codes uint8 [N/16 * K/32, 256], scale_zero bfloat16 [N/16 * K/32, 2, 16]), tiles in
    _panel_order. Matrices whose N are multiples of 32 stack along dim 0."""
    t = _tile_order(q.to(torch.uint8))
    codes = (t[..., :TILE_N] | (t[..., TILE_N:] << 4)).reshape(t.shape[0], t.shape[1], -1)
    n, groups = scale.shape

    def by_tile(v: torch.Tensor) -> torch.Tensor:
        return v.to(torch.bfloat16).reshape(n // TILE_N, TILE_N, groups).permute(0, 2, 1)

    scale_zero = torch.stack((by_tile(scale), by_tile(zero)), dim=2)
    return _panel_order(codes).contiguous(), _panel_order(scale_zero).contiguous()


def min_exponent(codes: torch.Tensor, scale_zero: torch.Tensor) -> int:
    """The least binary exponent of the matrix's non-zero weights as the tiles see them: the rows
    path checks from it whether a call can skip denormal handling (exactly, see the kernel)."""
    return int(torch.ops.conveyor_cpu.int4_min_exponent(codes, scale_zero))


def int4_mm(x: torch.Tensor, codes: torch.Tensor, scale_zero: torch.Tensor, w_min_exponent: int,
            residual: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] bfloat16 @ W.T (+ residual) -> [M, N] bfloat16: the rows path up to ROWS_PATH_MAX
    rows, else the tiles; a row's bits are the same either way."""
    if x.shape[0] <= ROWS_PATH_MAX:
        return int4_mm_rows(x, codes, scale_zero, w_min_exponent, residual)
    return int4_mm_tiles(x, codes, scale_zero, residual)


def int4_mm_tiles(x: torch.Tensor, codes: torch.Tensor, scale_zero: torch.Tensor,
                  residual: torch.Tensor | None = None) -> torch.Tensor:
    """int4_mm on AMX tiles, whatever the rows."""
    y: torch.Tensor = torch.ops.conveyor_cpu.int4_gemm_amx(x.contiguous(), codes, scale_zero,
                                                           residual)
    return y


def int4_silu_tiles(x: torch.Tensor, codes: torch.Tensor, scale_zero: torch.Tensor) -> torch.Tensor:
    """silu(x @ Wg.T) * (x @ Wu.T) -> [M, N / 2] for the codes of W = [Wg; Wu] (a gate_up
    projection), on the tiles in one pass: the bits of silu_and_mul(int4_mm_tiles(x))."""
    y: torch.Tensor = torch.ops.conveyor_cpu.int4_gemm_silu_amx(x.contiguous(), codes, scale_zero)
    return y


def int4_mm_rows(x: torch.Tensor, codes: torch.Tensor, scale_zero: torch.Tensor,
                 w_min_exponent: int, residual: torch.Tensor | None = None) -> torch.Tensor:
    """int4_mm on the rows path (at most ROWS_PATH_LIMIT rows); w_min_exponent:
    min_exponent of these codes."""
    y: torch.Tensor = torch.ops.conveyor_cpu.int4_gemm_rows(x.contiguous(), codes, scale_zero,
                                                            residual, w_min_exponent)
    return y


def pack_int8(q: torch.Tensor) -> torch.Tensor:
    """int8 codes q [N, K] (one scale per row, Int8Linear) -> codes int8 [N/16 * K/32, 512] for
    kernels/cpu/quant_int8.cpp: each tile's 16 rows of 32 codes in the element order TDPBF16PS
    reads (the int4 codes' order before their nibbles are packed), tiles in _panel_order."""
    t = _tile_order(q)
    return _panel_order(t.reshape(t.shape[0], t.shape[1], -1)).contiguous()


def int8_mm(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [M, K] bfloat16 @ (q * scale[:, None]).T -> [M, N] bfloat16: the rows path up to
    INT8_ROWS_PATH_MAX rows, else the tiles (the rows path reads the codes once for all rows; the
    tiles convert each panel first); a row's bits are the same either way. scale float32 [N]."""
    if x.shape[0] <= INT8_ROWS_PATH_MAX:
        return int8_mm_rows(x, codes, scale)
    return int8_mm_tiles(x, codes, scale)


def int8_mm_tiles(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """int8_mm on AMX tiles, whatever the rows."""
    y: torch.Tensor = torch.ops.conveyor_cpu.int8_gemm_amx(x.contiguous(), codes, scale)
    return y


def int8_mm_rows(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """int8_mm on the rows path (AVX-512 BF16, no AMX: the tiles' bits, 5 rows at a time), at any
    row count."""
    y: torch.Tensor = torch.ops.conveyor_cpu.int8_gemm_rows(x.contiguous(), codes, scale)
    return y
