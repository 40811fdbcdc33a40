"""The int8 AMX GEMM (kernels/cpu/quant_int8.cpp; on AMX CPUs the default's tied LM head) against a
dequantize-then-matmul reference, against TDPBF16PS's arithmetic written out, each row's bits
independent of the rows beside it, and its rows path bitwise equal to its tiles. The tiles' tests
are skipped where the CPU has no AMX tiles; the rows path's (AVX-512 BF16, any row count: the int8
head on such CPUs without AMX) where it lacks avx512_bf16; every machine runs the packing check."""
from __future__ import annotations

import pytest
import torch

from engine.load import amx, int4_avx512
from engine.load.quant import Int8Linear
from tests.kernels.tdpbf16ps import tile_sums

needs_amx = pytest.mark.skipif(not amx.usable(), reason="this CPU (or OS) does not run AMX tiles")
needs_avx512_bf16 = pytest.mark.skipif(
    not int4_avx512.usable(),
    reason="this CPU lacks avx512_bf16 (or the native kernels are not built)")
# the tied head's width (a slice of its 49,152 rows), SmolLM2's down projection, small tails
SHAPES = [(4096, 576), (576, 1536), (48, 64), (16, 32)]


def module(n: int, k: int, seed: int = 0, avx512: bool = False) -> Int8Linear:
    """avx512: codes for the rows path alone (as on a CPU with AVX-512 BF16 and no AMX)."""
    m = Int8Linear(torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05, None,
                   torch.bfloat16)
    assert m.make_tiles(avx512) == (int4_avx512.usable() if avx512 else amx.usable())
    assert m.tiles_avx512 == (avx512 and m.tile_codes is not None)
    return m


def test_packing_puts_each_code_where_the_tile_reads_it() -> None:
    """Element e of tile row r is column e // 2 at k = 2r + e % 2, one byte each; tiles panel by
    panel (32 columns, the last 16 where N / 16 is odd), then by k, then side by side."""
    n, k = 48, 64
    q = torch.randint(-127, 128, (n, k), generator=torch.Generator().manual_seed(1),
                      dtype=torch.int8)
    codes = amx.pack_int8(q)
    assert codes.shape == (6, 512) and codes.dtype == torch.int8
    place = {(0, 0): 0, (1, 0): 1, (0, 1): 2, (1, 1): 3, (2, 0): 4, (2, 1): 5}
    for nb, kb, r, e in [(0, 0, 0, 0), (1, 1, 15, 31), (0, 1, 7, 16), (1, 0, 3, 9), (2, 1, 5, 20),
                         (2, 0, 0, 1)]:
        assert codes[place[nb, kb], 32 * r + e] == q[16 * nb + e // 2, 32 * kb + 2 * r + e % 2]


@pytest.mark.parametrize("avx512", [pytest.param(False, marks=needs_amx),
                                    pytest.param(True, marks=needs_avx512_bf16)])
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("rows", [1, 7, 32, 300])
def test_equals_dequantize_then_matmul(n: int, k: int, rows: int, avx512: bool) -> None:
    """Within 2^-8 relative (the output's bfloat16 rounding) plus 1e-4 of the largest output (the
    sum's order) of the float32 product with the module's codes times its scales in float32 (the
    kernel rounds once, at the end; the module's bfloat16 dequantized() would add its own rounding
    of each weight), through forward; add_to adds the residual to that. avx512: the rows path at
    every row count."""
    m = module(n, k, avx512=avx512)
    m.amx_from = 1
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
    w = m.codes().float() * m.scales.float()[:, None]  # [N, K]
    want = x.float() @ w.t()
    got = m.forward(x)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    torch.testing.assert_close(got.float(), want, rtol=2**-8, atol=1e-4 * want.abs().max().item())
    h = torch.randn(rows, n).to(torch.bfloat16)
    assert torch.equal(m.add_to(h, x), h + got)  # the residual added to the rounded product


def tdpbf16ps_reference(q: torch.Tensor, scale: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """x @ (q * scale).T as the kernel's header specifies it: TDPBF16PS's sums over the codes (the
    products x * q are exact in float32), then C * scale in float32, rounded once to bfloat16."""
    return (tile_sums(x, q) * scale.float()).to(torch.bfloat16)


@pytest.mark.parametrize("path", [pytest.param("tiles", marks=needs_amx),
                                  pytest.param("rows", marks=needs_avx512_bf16)])
@pytest.mark.parametrize("n,k", [(576, 576), (48, 64), (80, 96)])
def test_each_path_equals_the_tdpbf16ps_reference_bitwise(n: int, k: int, path: str) -> None:
    """The tiles, and the rows path (AVX-512 FMAs in TDPBF16PS's order, 5 rows at a time: on CPUs
    without AMX the head's arithmetic), at row counts on either side of the tiles' 16-row blocks
    and of the rows path's chunks, bit for bit against tdpbf16ps_reference (80 columns end on a
    lone column tile)."""
    gen = torch.Generator().manual_seed(n + k)
    q = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    scale = torch.rand(n, generator=gen) * 0.02 + 1e-3
    codes = amx.pack_int8(q)
    x = torch.randn(40, k, generator=gen).to(torch.bfloat16)
    want = tdpbf16ps_reference(q, scale, x).view(torch.int16)
    mm = amx.int8_mm_tiles if path == "tiles" else amx.int8_mm_rows
    for rows in (1, 2, 4, 5, 6, 8, 9, 10, 11, 15, 16, 17, 24, 32, 33, 40):
        assert torch.equal(mm(x[:rows], codes, scale).view(torch.int16), want[:rows]), rows


@needs_amx
def test_denormal_sums_are_flushed_as_the_tiles_flush_them() -> None:
    """Activations near float32's smallest normal, whose partial sums fall below it: the rows
    path (DAZ and FTZ set around its FMAs) still gives the tiles' bits."""
    gen = torch.Generator().manual_seed(3)
    q = torch.randint(-127, 128, (64, 64), generator=gen, dtype=torch.int8)
    scale = torch.rand(64, generator=gen) + 0.5
    codes = amx.pack_int8(q)
    x = (torch.randn(8, 64, generator=gen) * 2.0**-124).to(torch.bfloat16)
    x[0, :8] = torch.tensor(2.0**-130)  # denormal inputs: read as zero by both
    tiles = amx.int8_mm_tiles(x, codes, scale)
    for rows in range(1, 9):
        assert torch.equal(amx.int8_mm_rows(x[:rows], codes, scale).view(torch.int16),
                           tiles[:rows].view(torch.int16)), rows


@pytest.mark.parametrize("avx512", [pytest.param(False, marks=needs_amx),
                                    pytest.param(True, marks=needs_avx512_bf16)])
@pytest.mark.parametrize("threads", [1, 2])
def test_a_rows_bits_do_not_depend_on_the_calls_rows(threads: int, avx512: bool) -> None:
    """Issue #30: each row's bits alone equal its bits inside calls of 1..300 rows, at 1 and 2
    threads: through int8_mm (the rows path or the tiles by row count), or avx512 (CPUs without
    AMX) through the rows path alone (chunks of 5 and their remainders)."""
    m = module(1024, 576, seed=4, avx512=avx512)
    m.amx_from = 1
    x = torch.randn(300, 576, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        alone = torch.cat([m.forward(x[i:i + 1]) for i in range(300)]).view(torch.int16)
        for size in [*range(1, 41), 63, 64, 65, 100, 255, 300]:
            got = torch.cat([m.forward(x[i:i + size]) for i in range(0, 300, size)])
            assert torch.equal(got.view(torch.int16), alone), size
    finally:
        torch.set_num_threads(saved)


@needs_avx512_bf16
def test_rows_path_refuses_what_it_cannot_take() -> None:
    m = module(48, 64, avx512=True)
    assert m.tile_codes is not None and m.tile_scale is not None
    with pytest.raises(RuntimeError, match="do not match"):
        amx.int8_mm_rows(torch.zeros(1, 128, dtype=torch.bfloat16), m.tile_codes, m.tile_scale)
