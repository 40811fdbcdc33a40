"""The int4 GEMM for AVX-512 BF16 CPUs without AMX (kernels/cpu/quant_gemm_avx512.cpp): equal to a
float32 dequantize-then-matmul reference (torch's own int4 kernel dequantizes), and each row's bits
independent of the rows beside it and of the thread count. It never uses AMX, so it runs on this
kind of CPU and on AMX Xeons alike; skipped, with the reason, where the CPU lacks avx512_bf16."""
from __future__ import annotations

import functools

import pytest
import torch

from engine.load import int4_avx512
from engine.load.quant import GROUP, Int4Linear

needs_avx512_bf16 = pytest.mark.skipif(
    not int4_avx512.usable(),
    reason="this CPU lacks avx512_bf16 (or the native kernels are not built)")
# SmolLM2's fused q/k/v and its down projection, an odd number of 16-column tiles, one k group
SHAPES = [(960, 576), (576, 1536), (48, 64), (16, 32)]


def module(n: int, k: int, seed: int = 0) -> Int4Linear:
    gen = torch.Generator().manual_seed(seed)
    m = Int4Linear(torch.randn(n, k, generator=gen) * 0.05, None, torch.bfloat16)
    assert m.tile_codes is not None
    m.tiles_avx512 = True
    return m


def float32_weights(m: Int4Linear) -> torch.Tensor:
    """W [N, K] in float32 as torch's int4 kernel dequantizes it ((q - 8) * scale + zero, no
    bfloat16 rounding): its product with the identity, one non-zero term per output."""
    k = m.shape()[1]
    eye = torch.eye(k)
    w: torch.Tensor = torch.ops.aten._weight_int4pack_mm_for_cpu(eye, m.qweight, GROUP,
                                                                  m.scales_zeros.float())
    return w.t()


@functools.cache
def module_and_reference(n: int, k: int) -> tuple[Int4Linear, torch.Tensor]:
    """Once a shape for every row count: the reference takes seconds at K = 1536 (torch's int4
    kernel on the identity)."""
    m = module(n, k)
    return m, float32_weights(m)


@needs_avx512_bf16
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("rows", [1, 7, 32, 300])
def test_equals_dequantize_then_matmul(n: int, k: int, rows: int) -> None:
    """Within the output's bfloat16 rounding (2^-8 relative) plus 1e-3 of the largest output: the
    kernel's products are exact and only the float32 sums' order differs."""
    m, w = module_and_reference(n, k)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
    want = x.float() @ w.t()
    got = m.tile_mm(x)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    torch.testing.assert_close(got.float(), want, rtol=2**-8, atol=1e-3 * want.abs().max().item())
    residual = torch.randn(rows, n).to(torch.bfloat16)
    with_residual = want + residual.float()
    torch.testing.assert_close(m.tile_mm(x, residual).float(), with_residual, rtol=2**-7,
                               atol=2e-3 * with_residual.abs().max().item())


@needs_avx512_bf16
@pytest.mark.parametrize("n,k", [(576, 576), (48, 64)])
def test_a_rows_bits_do_not_depend_on_the_rows_beside_it_or_the_threads(n: int, k: int) -> None:
    """A row alone, and inside calls of 2..300 rows (partial and full row blocks), at one and two
    threads: the same bits (issue #30)."""
    m = module(n, k, seed=1)
    x = torch.randn(300, k, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = [m.tile_mm(x[i:i + 1]) for i in (0, 5, 299)]
        for t in (1, 2):
            torch.set_num_threads(t)
            for rows in (2, 5, 6, 7, 12, 13, 32, 100, 300):
                got = m.tile_mm(x[:rows])
                assert torch.equal(got[:1], alone[0]), (t, rows)
                if rows > 5:
                    assert torch.equal(got[5:6], alone[1]), (t, rows)
            assert torch.equal(m.tile_mm(x[250:300])[49:], alone[2]), t
    finally:
        torch.set_num_threads(threads)


@needs_avx512_bf16
def test_a_misaligned_view_of_x_gives_the_same_bits() -> None:
    """x's rows may start at any bfloat16: a row read from an odd offset equals its copy."""
    m = module(48, 64)
    flat = torch.randn(3 * 64 + 1).to(torch.bfloat16)
    x = flat[1:].view(3, 64)
    assert torch.equal(m.tile_mm(x), m.tile_mm(x.clone()))
