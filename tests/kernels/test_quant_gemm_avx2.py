"""The int4 GEMM with float32 activations for AVX2 CPUs (kernels/cpu/quant_gemm_avx2.cpp): equal
to a dequantize-then-matmul reference (float64, from the codes, scales and lows drawn here), each
row's bits independent of the rows beside it and of the thread count, and the module and load
choices around it (Int4Linear under float32, --quantization auto). Skipped, with the reason, where
the CPU lacks AVX2 / FMA / F16C."""
from __future__ import annotations

import pytest
import torch

from engine import kernel_choice
from engine.kernel_calibration import NEVER
from engine.load import int4_avx2, weights
from engine.load.quant import Int4Linear, Int8Linear

needs_avx2 = pytest.mark.skipif(
    not int4_avx2.usable(),
    reason="this CPU lacks avx2, fma or f16c (or the native kernels are not built)")
# SmolLM2's fused q/k/v and its down projection; 3 tiles over 3 groups (K not a multiple of 64);
# one tile, one group
SHAPES = [(960, 576), (576, 1536), (24, 96), (8, 32)]
# |kernel - reference| <= this x max |reference|: the products are exact, only the float32 sums'
# order and rounding differ from the float64 reference (measured: at most 6e-7 on these shapes).
TOLERANCE = 1e-5


def drawn(n: int, k: int, seed: int = 0, half: bool = True
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q int [N, K] in 0..15, scale, low float32 [N, K/32]); half: values exact in float16, as a
    GGUF Q4_1 file's."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=gen)
    scale = torch.rand(n, k // 32, generator=gen) * 0.01 + 0.001
    low = -torch.rand(n, k // 32, generator=gen) * 0.08
    return (q, scale.half().float(), low.half().float()) if half else (q, scale, low)


def reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, low: torch.Tensor
              ) -> torch.Tensor:
    """x @ W.T in float64, W = q * scale + low per group of 32 along K."""
    w = q.double() * scale.double().repeat_interleave(32, 1) + low.double().repeat_interleave(32, 1)
    return x.double() @ w.t()


@needs_avx2
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("half", [True, False])
def test_equals_dequantize_then_matmul(n: int, k: int, half: bool) -> None:
    """At 1, 7, 32 and 300 rows (one register block, partial blocks, kept panels), with and without
    the residual, scales read as float16 (exact) or float32."""
    q, scale, low = drawn(n, k, half=half)
    codes, scale_low = int4_avx2.pack_codes(q), int4_avx2.pack_scales(scale, low)
    assert scale_low.dtype == (torch.float16 if half else torch.float32)
    for rows in (1, 7, 32, 300):
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
        want = reference(x, q, scale, low)
        got = int4_avx2.int4_mm(x, codes, scale_low)
        assert got.dtype == torch.float32 and got.shape == (rows, n)
        assert (got.double() - want).abs().max() <= TOLERANCE * want.abs().max(), rows
        residual = torch.randn(rows, n)
        with_residual = want + residual.double()
        got = int4_avx2.int4_mm(x, codes, scale_low, residual)
        assert (got.double() - with_residual).abs().max() <= TOLERANCE * with_residual.abs().max()


def test_unpack_inverts_pack() -> None:
    """The packed layout holds the codes and groups it was given (the packed copies and the
    reference both read the matrix back through unpack)."""
    q, scale, low = drawn(24, 96, seed=2)
    w = int4_avx2.unpack(int4_avx2.pack_codes(q), int4_avx2.pack_scales(scale, low))
    assert torch.equal(w, q.float() * scale.repeat_interleave(32, 1) + low.repeat_interleave(32, 1))


@needs_avx2
@pytest.mark.parametrize("n,k", [(576, 576), (24, 96)])
@pytest.mark.parametrize("round_x", [False, True], ids=["float-x", "w4a8"])
def test_a_rows_bits_do_not_depend_on_the_rows_beside_it_or_the_threads(n: int, k: int,
                                                                        round_x: bool) -> None:
    """A row alone, and inside calls of 2..300 rows (the float kernel's few-row panels, full and
    partial row blocks, kept panels; w4a8's blocks of 5 and, at k = 576, its panels of 225 rows:
    row 299 lies in the second), at one and two threads: the same bits (issue #30)."""
    q, scale, low = drawn(n, k, seed=1)
    codes, scale_low = int4_avx2.pack_codes(q), int4_avx2.pack_scales(scale, low)
    x = torch.randn(300, k, generator=torch.Generator().manual_seed(3))

    def mm(rows: torch.Tensor) -> torch.Tensor:
        return int4_avx2.int4_mm(rows, codes, scale_low, round_x=round_x)

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = [mm(x[i:i + 1]) for i in (0, 5, 299)]
        for t in (1, 2):
            torch.set_num_threads(t)
            for rows in (2, 3, 5, 6, 7, 12, 13, 32, 100, 300):
                got = mm(x[:rows])
                assert torch.equal(got[:1], alone[0]), (t, rows)
                if rows > 5:
                    assert torch.equal(got[5:6], alone[1]), (t, rows)
                if rows == 300:
                    assert torch.equal(got[299:], alone[2]), t
            assert torch.equal(mm(x[250:300])[49:], alone[2]), t
    finally:
        torch.set_num_threads(threads)


@needs_avx2
def test_int4_linear_takes_the_kernel_below_the_handover_and_the_copy_from_it(monkeypatch) -> None:
    """Under float32 an Int4Linear keeps the AVX2 kernel's codes; attach_float32_copies gives it a
    float32 copy from the calibrated rows (both sides checked bit for bit against each path), the
    int8 head its copy at every row count, and the copy from 128 rows at the latest."""
    m = Int4Linear(torch.randn(48, 64) * 0.05, None, torch.float32)
    head = Int8Linear(torch.randn(40, 64), None, torch.float32)
    assert m.avx2_scale_low is not None
    monkeypatch.setattr(kernel_choice, "calibrate", lambda modules, rows: 5)
    assert kernel_choice.attach_float32_copies([m, head], deterministic=False) == {"int4": 5,
                                                                                   "int8": 1}
    assert m.packed is not None and m.packed_from == 5
    assert head.packed is not None and head.packed_from == 1
    for rows in (1, 4, 5, 40):
        x, h = torch.randn(rows, 64), torch.randn(rows, 48)
        path = m.packed if rows >= 5 else None
        want = (int4_avx2.int4_mm(x, m.qweight, m.avx2_scale_low, h) if path is None
                else path.add_to(h, x))
        assert torch.equal(m.add_to(h, x), want), rows
        want = m.packed.forward(x) if rows >= 5 else int4_avx2.int4_mm(x, m.qweight,
                                                                        m.avx2_scale_low)
        assert torch.equal(m(x), want), rows
    # the copy holds W = q * scale + low, the reference's matrix
    torch.testing.assert_close(m(torch.eye(64)[:40]).t(), m.dequantized()[:, :40])
    # a kernel that wins at every row count calibrated still hands 128 rows and more to the copy
    monkeypatch.setattr(kernel_choice, "calibrate", lambda modules, rows: NEVER)
    m = Int4Linear(torch.randn(48, 64) * 0.05, None, torch.float32)
    assert kernel_choice.attach_float32_copies([m, head], deterministic=False) == {"int4": 128,
                                                                                   "int8": 1}
    assert m.packed is not None and m.packed_from == 128
    # deterministic: the kernel at every row count, no copy of the int4 matrices
    m = Int4Linear(torch.randn(48, 64) * 0.05, None, torch.float32)
    kernel_choice.attach_float32_copies([m], deterministic=True)
    assert m.packed is None and m.amx_from == 1


@needs_avx2
def test_auto_keeps_int4_under_float32_where_the_kernel_runs(monkeypatch) -> None:
    """--quantization auto with float32 activations: the file's int4 codes where the AVX2 kernel
    runs (as w4a8: tests/kernels/test_quant_gemm_avx2_q8.py), dequantized where it does not (and
    for an int8 file, which has no float32 kernel)."""
    cpu = torch.device("cpu")
    assert weights._quantization("auto", "int4", torch.float32, cpu) == weights.AUTO_FLOAT32_INT4
    assert weights._quantization("auto", "int8", torch.float32, cpu) == "none"
    monkeypatch.setattr(int4_avx2, "usable", lambda: False)
    assert weights._quantization("auto", "int4", torch.float32, cpu) == "none"
    assert weights._quantization("auto", "int4", torch.bfloat16, cpu) == "int4"
    assert Int4Linear(torch.randn(16, 32), None, torch.float32).avx2_scale_low is None
