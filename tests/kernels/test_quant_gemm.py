"""The AMX int4 GEMM (kernels/cpu/quant_gemm.cpp) against a dequantize-then-matmul reference, and each
row's bits independent of the rows beside it. Skipped where the CPU has no AMX tiles; every machine runs
the packing checks, which need no kernel."""
from __future__ import annotations

import pytest
import torch

from engine.load import amx
from engine.load.prepack import PackedLinear
from engine.load.quant import Int4Linear

needs_amx = pytest.mark.skipif(not amx.usable(), reason="this CPU (or OS) does not run AMX tiles")
SHAPES = [(960, 576), (576, 1536), (48, 64), (16, 32)]  # SmolLM2's q/k/v and down projections, small tails


def module(n: int, k: int, seed: int = 0) -> Int4Linear:
    gen = torch.Generator().manual_seed(seed)
    return Int4Linear(torch.randn(n, k, generator=gen) * 0.05, None, torch.bfloat16)


def test_packing_puts_each_code_where_the_tile_reads_it() -> None:
    """Element e of tile row r is column e // 2 at k = 2r + e % 2; byte j holds elements j and 16 + j."""
    n, k = 32, 64
    q = torch.randint(0, 16, (n, k), generator=torch.Generator().manual_seed(1))
    scale, zero = torch.rand(n, k // 32), torch.rand(n, k // 32)
    codes, sz = amx.pack_int4(q, scale, zero)
    assert codes.shape == (2, 2, 256) and sz.shape == (2, 2, 2, 16)
    for nb, kb, r, e in [(0, 0, 0, 0), (1, 1, 15, 31), (0, 1, 7, 16), (1, 0, 3, 9)]:
        byte = codes[nb, kb, 16 * r + e % 16]
        code = (byte >> 4) if e >= 16 else (byte & 15)
        assert code == q[16 * nb + e // 2, 32 * kb + 2 * r + e % 2]
    assert sz[1, 0, 0, 5] == scale[21, 0].to(torch.bfloat16) and sz[0, 1, 1, 3] == zero[3, 1].to(torch.bfloat16)


@needs_amx
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("rows", [1, 7, 32, 300])
def test_equals_dequantize_then_matmul(n: int, k: int, rows: int) -> None:
    """Within the output's bfloat16 rounding of the float32 product with torch's own dequantized matrix
    (the weights are the same bfloat16 values; only the sum's order and the last rounding differ)."""
    m = module(n, k)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
    want = x.float() @ m.dequantized().float().t()
    got = m.tile_mm(x)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    torch.testing.assert_close(got.float(), want, rtol=2**-8, atol=1e-3 * want.abs().max().item())
    residual = torch.randn(rows, n).to(torch.bfloat16)
    torch.testing.assert_close(m.tile_mm(x, residual).float(), want + residual.float(), rtol=2**-7,
                               atol=2e-3 * (want + residual.float()).abs().max().item())


@needs_amx
def test_a_rows_bits_do_not_depend_on_the_rows_beside_it() -> None:
    """Row 0 alone, and inside calls of every size to 300 rows (partial 16- and 32-row blocks, full
    ones), at one and two threads: the same bits (issue #30)."""
    m = module(576, 576)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(300, 576, generator=gen).to(torch.bfloat16)
    alone = m.tile_mm(x[:1])
    threads = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            for rows in (2, 15, 16, 17, 31, 32, 33, 64, 100, 300):
                assert torch.equal(m.tile_mm(x[:rows])[0], alone[0]), (t, rows)
            assert torch.equal(m.tile_mm(x[250:300])[49], m.tile_mm(x[299:300])[0])
    finally:
        torch.set_num_threads(threads)


@needs_amx
def test_the_module_takes_the_tiles_in_their_row_range() -> None:
    """forward and add_to run the AMX kernel from amx_from rows and hand over to the packed copy from
    packed_from: each range gives that kernel's own bits."""
    m = module(576, 576)
    m.packed, m.packed_from = PackedLinear(m.dequantized(), None), 64
    m.amx_from = 8
    x = torch.randn(70, 576).to(torch.bfloat16)
    h = torch.randn(70, 576).to(torch.bfloat16)
    assert torch.equal(m.forward(x[:4]), m.quantized_mm(x[:4]))
    assert torch.equal(m.forward(x[:8]), m.tile_mm(x[:8]))
    assert torch.equal(m.add_to(h[:40], x[:40]), m.tile_mm(x[:40], h[:40]))
    assert torch.equal(m.forward(x), m.packed.forward(x))
