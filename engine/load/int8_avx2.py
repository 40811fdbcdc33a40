"""The int8 GEMM for float32 activations on AVX2 + FMA CPUs (kernels/cpu/quant_int8_avx2.cpp).

torch's _weight_int8pack_mm takes a scalar loop for float32 activations, so without this kernel a
float32 model multiplies a float32 copy of an int8 matrix (the tied LM head): 4 bytes a weight read
per decode step where the codes take 1. The kernel reads each code once per call, converts it in a
register and computes every output as one FMA chain over k in order, then times its row's scale:
one arithmetic at every row count and thread count, so a row's bits do not depend on the batch.
"""
from __future__ import annotations

import torch

from engine.load import int4_avx2

BLOCK = 8  # output rows the kernel's codes interleave (one AVX2 register of float32)


def usable() -> bool:
    """Whether this CPU has AVX2 and FMA and the native kernels are built: int4_avx2's check
    (F16C too, which every AVX2 CPU has)."""
    return int4_avx2.usable()


def fits(n: int) -> bool:
    return n % BLOCK == 0


def pack(q: torch.Tensor) -> torch.Tensor:
    """int8 codes q [N, K] (Int8Linear's) -> [N/8, K, 8]: for each block of 8 output rows, the 8
    codes of each k side by side (one 8-byte load a k for the kernel)."""
    n, k = q.shape
    return q.view(n // BLOCK, BLOCK, k).transpose(1, 2).contiguous()


def unpack(codes: torch.Tensor) -> torch.Tensor:
    """pack's inverse: [N/8, K, 8] -> int8 codes [N, K]."""
    blocks, k, _ = codes.shape
    return codes.transpose(1, 2).reshape(blocks * BLOCK, k)


def rows(codes: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows ids of the codes [N, K] from pack's layout: row n at block n // 8, lane n % 8."""
    return codes[ids // BLOCK, :, ids % BLOCK]


def int8_mm(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [M, K] float32 @ (q * scale[:, None]).T -> [M, N] float32; codes from pack, scale
    float32 [N]."""
    y: torch.Tensor = torch.ops.conveyor_cpu.int8_gemm_avx2(x.contiguous(), codes, scale)
    return y
