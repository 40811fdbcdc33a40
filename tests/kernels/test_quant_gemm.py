"""The AMX int4 GEMM (kernels/cpu/quant_gemm.cpp) against a dequantize-then-matmul reference, each
row's bits independent of the rows beside it, its rows path (a few rows on AVX-512) bitwise equal to
its tiles, and where oneDNN's packed bfloat16 copies give the tiles' bits. Skipped where the CPU has
no AMX tiles (the engine makes the codes only there); every machine runs the packing checks, which
need no kernel."""
from __future__ import annotations

import pytest
import torch

from engine.load import amx
from engine.load.prepack import PackedLinear
from engine.load.quant import Int4Linear, Int8Linear
from tests.kernels.tdpbf16ps import tile_sums

needs_amx = pytest.mark.skipif(not amx.usable(), reason="this CPU (or OS) does not run AMX tiles")
# SmolLM2's q/k/v and down projections, small tails
SHAPES = [(960, 576), (576, 1536), (48, 64), (16, 32)]


def module(n: int, k: int, seed: int = 0) -> Int4Linear:
    gen = torch.Generator().manual_seed(seed)
    return Int4Linear(torch.randn(n, k, generator=gen) * 0.05, None, torch.bfloat16)


def test_packing_puts_each_code_where_the_tile_reads_it() -> None:
    """Element e of tile row r is column e // 2 at k = 2r + e % 2; byte j holds elements j and 16 +
    j; tiles panel by panel (32 columns, the last 16 where N / 16 is odd), then by k, then the
    panel's column tiles side by side."""
    n, k = 48, 64
    q = torch.randint(0, 16, (n, k), generator=torch.Generator().manual_seed(1))
    scale, zero = torch.rand(n, k // 32), torch.rand(n, k // 32)
    codes, sz = amx.pack_int4(q, scale, zero)
    assert codes.shape == (6, 256) and sz.shape == (6, 2, 16)
    # tile (column block nb, k block kb) -> its place: panels 0 (nb 0, 1) and 1 (nb 2, alone)
    place = {(0, 0): 0, (1, 0): 1, (0, 1): 2, (1, 1): 3, (2, 0): 4, (2, 1): 5}
    for nb, kb, r, e in [(0, 0, 0, 0), (1, 1, 15, 31), (0, 1, 7, 16), (1, 0, 3, 9), (2, 1, 5, 20),
                         (2, 0, 0, 1)]:
        byte = codes[place[nb, kb], 16 * r + e % 16]
        code = (byte >> 4) if e >= 16 else (byte & 15)
        assert code == q[16 * nb + e // 2, 32 * kb + 2 * r + e % 2]
    assert sz[place[1, 0], 0, 5] == scale[21, 0].to(torch.bfloat16)
    assert sz[place[0, 1], 1, 3] == zero[3, 1].to(torch.bfloat16)
    assert sz[place[2, 1], 1, 15] == zero[47, 1].to(torch.bfloat16)


@needs_amx
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("rows", [1, 7, 32, 300])
def test_equals_dequantize_then_matmul(n: int, k: int, rows: int) -> None:
    """Within the output's bfloat16 rounding of the float32 product with torch's own dequantized
    matrix (the weights are the same bfloat16 values; only the sum's order and the last rounding
    differ)."""
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
    """forward and add_to run the AMX kernel from amx_from rows and hand over to the packed copy
    from packed_from: each range gives that kernel's own bits."""
    m = module(576, 576)
    m.packed, m.packed_from = PackedLinear(m.dequantized(), None), 64
    m.amx_from = 8
    x = torch.randn(70, 576).to(torch.bfloat16)
    h = torch.randn(70, 576).to(torch.bfloat16)
    assert torch.equal(m.forward(x[:4]), m.quantized_mm(x[:4]))
    assert torch.equal(m.forward(x[:8]), m.tile_mm(x[:8]))
    assert torch.equal(m.add_to(h[:40], x[:40]), m.tile_mm(x[:40], h[:40]))
    assert torch.equal(m.forward(x), m.packed.forward(x))


def rows_path(m: Int4Linear, x: torch.Tensor, residual: torch.Tensor | None = None,
              w_min_exponent: int | None = None) -> torch.Tensor:
    """The rows path over x, at most ROWS_PATH_LIMIT rows a call."""
    assert m.tile_codes is not None and m.tile_scale_zero is not None
    e = m.tile_min_exponent if w_min_exponent is None else w_min_exponent
    step = amx.ROWS_PATH_LIMIT
    return torch.cat([amx.int4_mm_rows(x[i:i + step], m.tile_codes, m.tile_scale_zero, e,
                                       None if residual is None else residual[i:i + step])
                      for i in range(0, x.shape[0], step)])


def tiles(m: Int4Linear, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
    assert m.tile_codes is not None and m.tile_scale_zero is not None
    return amx.int4_mm_tiles(x, m.tile_codes, m.tile_scale_zero, residual)


@needs_amx
@pytest.mark.parametrize("n,k", SHAPES + [(80, 96)])
@pytest.mark.parametrize("rows", range(1, 9))
def test_the_rows_path_equals_dequantize_then_matmul(n: int, k: int, rows: int) -> None:
    """Within the same tolerance as the tiles (bfloat16 output rounding; the sum's order differs
    from the reference's), with and without the residual."""
    m = module(n, k, seed=rows)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
    want = x.float() @ m.dequantized().float().t()
    got = rows_path(m, x)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    torch.testing.assert_close(got.float(), want, rtol=2**-8, atol=1e-3 * want.abs().max().item())
    residual = torch.randn(rows, n).to(torch.bfloat16)
    torch.testing.assert_close(rows_path(m, x, residual).float(), want + residual.float(),
                               rtol=2**-7, atol=2e-3 * (want + residual.float()).abs().max().item())


@needs_amx
@pytest.mark.parametrize("rows", [1, 3, 7, 32, 300])
def test_the_rows_path_gives_each_row_the_tiles_bits(rows: int) -> None:
    """Each row through the rows path (8 rows a call) has the bits of the same row inside one tiles
    call of `rows` rows: plain activations, activations over 2^-60..2^60 (large cancellations), and
    ones with denormal and near-denormal values, where the kernel takes its MXCSR-switched way; that
    way is also forced on plain activations. With and without the residual, at 1 and 2 threads."""
    m = module(576, 1536, seed=5)
    gen = torch.Generator().manual_seed(rows)
    plain = torch.randn(rows, 1536, generator=gen)
    wide = plain * torch.exp2(torch.randint(-60, 61, (rows, 1536), generator=gen).float())
    tiny = plain * 2.0**-120
    residual = torch.randn(rows, 576, generator=gen).to(torch.bfloat16)
    threads = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            for x in (plain, wide, tiny):
                xb = x.to(torch.bfloat16)
                assert torch.equal(rows_path(m, xb).view(torch.int16),
                                   tiles(m, xb).view(torch.int16)), t
                assert torch.equal(rows_path(m, xb, residual).view(torch.int16),
                                   tiles(m, xb, residual).view(torch.int16)), t
            xb = plain.to(torch.bfloat16)
            assert torch.equal(rows_path(m, xb, w_min_exponent=-(1 << 20)).view(torch.int16),
                               tiles(m, xb).view(torch.int16))
    finally:
        torch.set_num_threads(threads)


@needs_amx
def test_the_module_takes_the_rows_path_for_a_few_rows() -> None:
    """tile_mm (what forward and add_to call) goes to the rows path up to ROWS_PATH_MAX rows: the
    tiles' bits either way."""
    m = module(576, 576)
    x = torch.randn(amx.ROWS_PATH_MAX + 1, 576).to(torch.bfloat16)
    for r in (1, amx.ROWS_PATH_MAX, amx.ROWS_PATH_MAX + 1):
        assert torch.equal(m.tile_mm(x[:r]), tiles(m, x[:r]))


@needs_amx
def test_the_rows_path_refuses_what_it_does_not_take() -> None:
    """More than ROWS_PATH_LIMIT rows, and x whose K does not match the codes (K is a multiple of 32
    and N of 16 by construction: amx.fits)."""
    m = module(48, 64)
    assert m.tile_codes is not None and m.tile_scale_zero is not None
    with pytest.raises(RuntimeError, match="at most"):
        amx.int4_mm_rows(torch.zeros(amx.ROWS_PATH_LIMIT + 1, 64, dtype=torch.bfloat16),
                         m.tile_codes, m.tile_scale_zero, m.tile_min_exponent)
    with pytest.raises(RuntimeError, match="codes do not match"):
        amx.int4_mm_rows(torch.zeros(1, 48, dtype=torch.bfloat16), m.tile_codes, m.tile_scale_zero,
                         m.tile_min_exponent)
    assert not amx.fits(48, 48) and not amx.fits(40, 64)


@needs_amx
@pytest.mark.parametrize("n,k", [(960, 576), (576, 1536)])
def test_onednns_packed_copies_round_as_the_tiles_only_in_small_calls(n: int, k: int) -> None:
    """Issue #30 asks whether the default's handover from the tiles to oneDNN's packed bfloat16
    copies (QUANTIZED_TILES_ROWS: from 1,024 rows at 2 threads, 128 at 1) keeps a row's bits: both
    multiply the same bfloat16 weights on TDPBF16PS, so it depends on how oneDNN blocks the call.
    Measured on this AMX Xeon (torch 2.13.0+cpu, 1 and 2 threads): up to 32 rows every row has the
    tiles' bits; in calls of 33 to 512 rows a few rows differ, from the tiles and from the same row
    in a small call. So a row-count invariant quantized default needs the tiles at prompt chunks
    too, and the unquantized bfloat16 default is not row-count invariant on AMX either
    (docs/determinism.md). If this fails after a torch or oneDNN upgrade, the answer changed:
    measure again."""
    m = module(n, k, seed=2)
    packed = PackedLinear(m.dequantized(), None)
    x = torch.randn(512, k, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    want = m.tile_mm(x)
    threads = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            for rows in (2, 3, 8, 17, 32):
                assert torch.equal(packed.forward(x[:rows]), want[:rows]), (t, rows)
            differing = sum(int((packed.forward(x[:rows]) != want[:rows]).any(dim=1).sum())
                            for rows in (33, 64, 96, 128, 256, 512))
            assert differing > 0, t
    finally:
        torch.set_num_threads(threads)


@needs_amx
def test_deterministic_packed_copies_give_a_row_its_bits_in_calls_of_any_size() -> None:
    """--deterministic on AMX CPUs: a matrix on its packed copy (the tied int8 head) has each row's
    bits of the row alone (padded to two rows) in calls of up to 160 rows, because calls of more
    than 32 rows are cut (oneDNN rounds a few rows of a larger call otherwise: the test above)."""
    from engine.load.prepack import ONEDNN_SAME_BITS_ROWS

    m = Int8Linear(torch.randn(4096, 576, generator=torch.Generator().manual_seed(6)) * 0.05, None,
                   torch.bfloat16)
    m.packed = PackedLinear(m.dequantized(), None, pad_one_row=True, max_rows=ONEDNN_SAME_BITS_ROWS)
    m.packed_from = 1
    x = torch.randn(160, 576, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    h = torch.randn(160, 4096, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
    alone = torch.cat([m.forward(x[i:i + 1]) for i in range(160)])
    for rows in (33, 64, 100, 160):
        assert torch.equal(m.forward(x[:rows]), alone[:rows]), rows
    assert torch.equal(m.add_to(h, x),
                       torch.cat([m.add_to(h[i:i + 1], x[i:i + 1]) for i in range(160)]))


def tdpbf16ps_reference(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, x: torch.Tensor,
                        residual: torch.Tensor | None = None) -> torch.Tensor:
    """x @ W.T as the kernel's header specifies it, written out plainly: each weight (q - 8) * scale
    + zero in float32 (q * scale is exact, so the FMA's one rounding is the add's) rounded once to
    bfloat16; then TDPBF16PS's sums (tests/kernels/tdpbf16ps.py); the residual added in float32,
    one rounding to bfloat16. Normal inputs only (no denormal handling)."""
    s, z = scale.to(torch.bfloat16).float(), zero.to(torch.bfloat16).float()
    low = z - 8 * s
    w = (q.float() * s.repeat_interleave(32, 1) + low.repeat_interleave(32, 1))
    w = w.to(torch.bfloat16).float()  # [N, K]
    c = tile_sums(x, w)
    return (c if residual is None else c + residual.float()).to(torch.bfloat16)


@needs_amx
@pytest.mark.parametrize("n,k", [(576, 576), (48, 64), (80, 96)])
def test_tiles_and_rows_path_equal_the_tdpbf16ps_reference_bitwise(n: int, k: int) -> None:
    """Both kernels, any row count, with and without the residual, bit for bit against
    tdpbf16ps_reference: pins the packed layout, the tile configuration per row count and the
    rows path's arithmetic to the dequantization and TDPBF16PS order the bits were fixed with."""
    gen = torch.Generator().manual_seed(n + k)
    q = torch.randint(0, 16, (n, k), generator=gen)
    scale = torch.rand(n, k // 32, generator=gen) * 0.02 + 1e-3
    zero = torch.randn(n, k // 32, generator=gen) * 0.02
    codes, sz = amx.pack_int4(q, scale, zero)
    e = amx.min_exponent(codes, sz)
    x = torch.randn(40, k, generator=gen).to(torch.bfloat16)
    h = torch.randn(40, n, generator=gen).to(torch.bfloat16)
    want, with_h = tdpbf16ps_reference(q, scale, zero, x), tdpbf16ps_reference(q, scale, zero, x, h)
    for rows in (1, 2, 5, 8, 15, 16, 17, 32, 33, 40):
        assert torch.equal(amx.int4_mm_tiles(x[:rows], codes, sz).view(torch.int16),
                           want[:rows].view(torch.int16)), rows
        assert torch.equal(amx.int4_mm_tiles(x[:rows], codes, sz, h[:rows]).view(torch.int16),
                           with_h[:rows].view(torch.int16)), rows
        if rows <= amx.ROWS_PATH_LIMIT:
            assert torch.equal(amx.int4_mm_rows(x[:rows], codes, sz, e).view(torch.int16),
                               want[:rows].view(torch.int16)), rows


@needs_amx
@pytest.mark.parametrize("n,k", [(3072, 576), (720, 1536)])
def test_calls_past_a_chunk_of_rows_keep_each_rows_bits(n: int, k: int) -> None:
    """Prompt-sized calls, to past the 2,048-token step budget (720 columns end on a lone column
    tile): rows on either side of the kept panel's 32-row blocks and of 256-row marks equal
    tdpbf16ps_reference bit for bit, with the residual, at 1 and 2 threads, in calls of 257 to
    2,100 rows (issue #30: a prompt's row count must not move a bit, now that the tiles take
    prompt chunks up to QUANTIZED_TILES_ROWS's bound)."""
    gen = torch.Generator().manual_seed(n * k)
    q = torch.randint(0, 16, (n, k), generator=gen)
    scale = torch.rand(n, k // 32, generator=gen) * 0.02 + 1e-3
    zero = torch.randn(n, k // 32, generator=gen) * 0.02
    codes, sz = amx.pack_int4(q, scale, zero)
    x = torch.randn(2100, k, generator=gen).to(torch.bfloat16)
    h = torch.randn(2100, n, generator=gen).to(torch.bfloat16)
    picks = [0, 31, 32, 255, 256, 257, 288, 299, 511, 512, 1055, 2047, 2099]
    want = tdpbf16ps_reference(q, scale, zero, x[picks], h[picks]).view(torch.int16)
    threads = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            for rows in (257, 300, 600, 2100):
                got = amx.int4_mm_tiles(x[:rows], codes, sz, h[:rows]).view(torch.int16)
                inside = [i for i, p in enumerate(picks) if p < rows]
                assert torch.equal(got[[picks[i] for i in inside]], want[inside]), (t, rows)
    finally:
        torch.set_num_threads(threads)
