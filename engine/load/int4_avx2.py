"""The int4 GEMM with float32 activations for AVX2 + FMA CPUs (kernels/cpu/quant_gemm_avx2.cpp).

On CPUs without native bfloat16 the engine computes in float32, where torch's int4 kernel takes a
slow path; this one reads the file's 4-bit codes and dequantizes in registers, so a decode step
reads about a seventh of the float32 weights' bytes. One arithmetic at every row count and thread
count: a row's bits do not depend on the rows beside it (docs/determinism.md). Under --quantization
w4a8 the same codes multiply activations rounded to 8 bits (int4_mm's round_x), as llama.cpp does.
"""
from __future__ import annotations

from functools import cache

import torch

import kernels.cpu

COLS = 8  # output columns of a tile: one AVX2 register of float32 outputs
CHUNK = 8  # k of one 32-bit word of codes
GROUP = 32  # k of one scale group


@cache
def usable() -> bool:
    """Whether this CPU has AVX2, FMA and F16C (CPUID, checked by the kernel) and the native
    kernels are built."""
    return kernels.cpu.available() and bool(torch.ops.conveyor_cpu.avx2_fma_usable())


def fits(n: int, k: int) -> bool:
    """Whether an [n, k] matrix takes the kernel: whole tiles of 8 columns, whole groups of 32."""
    return n % COLS == 0 and k % GROUP == 0 and n > 0 and k > 0


def pack_codes(q: torch.Tensor) -> torch.Tensor:
    """q int [N, K] in 0..15 -> int32 [N/8, K/8, 8]: per tile of 8 columns and k chunk of 8, word j
    holds column j's 8 codes, k 8c + i in bits 4i..4i+3 (the kernel's layout). Rows in multiples of
    8 pack apart and concatenate (Int4Linear packs in chunks)."""
    n, k = q.shape
    tiles = q.to(torch.int64).view(n // COLS, COLS, k // CHUNK, CHUNK).permute(0, 2, 1, 3)
    words = (tiles << (4 * torch.arange(CHUNK))).sum(dim=-1)  # [N/8, K/8, 8] in 0 .. 2^32 - 1
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32).contiguous()


def pack_scales(scale: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    """scale, low float32 [N, K/32] -> [N/8, K/32, 2, 8]: per tile and group its 8 scales, then its
    8 lows. float16 where every value is exact in it (GGUF's Q4_0 / Q4_1 store them so): the same
    values in half the bytes the kernel reads; else float32."""
    n, groups = scale.shape
    both = torch.stack((scale.float(), low.float()), dim=1)  # [N, 2, K/32]
    packed = both.view(n // COLS, COLS, 2, groups).permute(0, 3, 2, 1).contiguous()
    half = packed.half()
    return half if torch.equal(half.float(), packed) else packed


def unpack(codes: torch.Tensor, scale_low: torch.Tensor) -> torch.Tensor:
    """The packed matrix -> W float32 [N, K] = q * scale + low (float32, rounded twice), as a
    dequantized file holds it."""
    nt, chunks, _ = codes.shape
    q = (codes.to(torch.int64)[..., None] >> (4 * torch.arange(CHUNK))) & 0xF  # [N/8, K/8, 8, 8]
    q = q.permute(0, 2, 1, 3).reshape(nt * COLS, chunks * CHUNK).float()
    sl = scale_low.float().permute(0, 3, 2, 1).reshape(nt * COLS, 2, -1)  # [N, 2, K/32]
    scale, low = (sl[:, i].repeat_interleave(GROUP, dim=1) for i in (0, 1))
    return q * scale + low


def int4_mm(x: torch.Tensor, codes: torch.Tensor, scale_low: torch.Tensor,
            residual: torch.Tensor | None = None, round_x: bool = False) -> torch.Tensor:
    """x [M, K] float32 @ W.T (+ residual [M, N] float32) -> [M, N] float32; a row's bits do not
    depend on M or on the thread count. round_x: x rounded to 8 bits per group of 32 first
    (kernels/cpu/quant_gemm_avx2_q8.cpp, --quantization w4a8): integer dot products, faster
    than the float-x kernel and than MKL's float32 GEMM at every row count measured, 1..512
    (docs/kernels.md)."""
    ops = torch.ops.conveyor_cpu
    op = ops.int4_gemm_avx2_q8 if round_x else ops.int4_gemm_avx2
    y: torch.Tensor = op(x.contiguous(), codes, scale_low, residual)
    return y
