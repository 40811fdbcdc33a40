"""TDPBF16PS's arithmetic written out plainly, for the bitwise tests of the AMX kernels and their
rows paths: what the SDM's pseudo-code specifies and bench/tdpbf16ps_probe.cpp confirmed here."""
from __future__ import annotations

import torch


def tile_sums(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ w [N, K].T in float32 as TDPBF16PS sums it: per 32-k tile an even-k and an odd-k
    float32 chain from zero in k order (each product exact in float32, so each step rounds as an
    add), then C += even + odd. Normal inputs whose partial sums stay normal (no denormals)."""
    xf, wf = x.float(), w.float()
    c = torch.zeros(x.shape[0], w.shape[0])
    for t in range(w.shape[1] // 32):
        even, odd = torch.zeros_like(c), torch.zeros_like(c)
        for p in range(16):
            k = 32 * t + 2 * p
            even = even + xf[:, k, None] * wf[None, :, k]
            odd = odd + xf[:, k + 1, None] * wf[None, :, k + 1]
        c = c + (even + odd)
    return c
