"""The int4 GEMM for CPUs with AVX-512 BF16 and no AMX (kernels/cpu/quant_gemm_avx512.cpp).

It reads the AMX kernel's repacked codes (engine/load/amx.py) and computes with VDPBF16PS in one
arithmetic at every row count and thread count, so on such CPUs (the AMD EPYC kind) the quantized
default needs no switch between torch's int4 kernel and a packed bfloat16 copy, whose rows round
differently (docs/determinism.md).
"""
from __future__ import annotations

from functools import cache

import torch

import kernels.cpu


@cache
def usable() -> bool:
    """Whether this CPU has AVX-512 BF16 (CPUID, checked by the kernel) and the native kernels
    are built."""
    return kernels.cpu.available() and bool(torch.ops.conveyor_cpu.avx512_bf16_usable())


def int4_mm(x: torch.Tensor, codes: torch.Tensor, scale_zero: torch.Tensor,
            residual: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] bfloat16 @ W.T (+ residual) -> [M, N] bfloat16, W as amx.pack_int4 holds it; a
    row's bits do not depend on M or on the thread count."""
    y: torch.Tensor = torch.ops.conveyor_cpu.int4_gemm_avx512(x.contiguous(), codes, scale_zero,
                                                              residual)
    return y
