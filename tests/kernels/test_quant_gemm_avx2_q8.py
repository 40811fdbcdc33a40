"""The int4 GEMM with activations rounded to 8 bits on AVX2 (kernels/cpu/quant_gemm_avx2_q8.cpp,
--quantization w4a8): x's rounding against gguf's Q8_0 (llama.cpp's own quantizer), the kernel
against a float64 product of the rounded x and the dequantized weights, and the module and load
choices around it (each row's bits independent of the rows beside it and of the thread count:
test_quant_gemm_avx2.py, for both kernels). Skipped, with the reason, where the CPU lacks AVX2 /
FMA / F16C."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from engine import kernel_choice
from engine.load import int4_avx2, weights
from engine.load.quant import Int4Linear, Int8Linear
from tests.kernels.test_quant_gemm_avx2 import SHAPES, drawn, reference

needs_avx2 = pytest.mark.skipif(
    not int4_avx2.usable(),
    reason="this CPU lacks avx2, fma or f16c (or the native kernels are not built)")
# |kernel - reference| <= this x max |reference| where the reference multiplies the same rounded x:
# the integer sums are exact, only float32's scale products and group sums round (measured: at
# most 4e-7 on these shapes).
TOLERANCE = 1e-5
# ... and where the reference multiplies x itself: x's rounding to 8 bits (measured 3-10e-3).
ROUNDING_TOLERANCE = 2e-2


def round_x(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] float32 as int4_gemm_avx2_q8 rounds it: per group of 32, d = max |x| / 127 and
    q = round-half-even(x * (127 / max |x|)) in -127..127 (0 where the group is all zero).
    -> (q float32 [M, K], d float32 [M, K/32])."""
    m, k = x.shape
    g = x.float().reshape(m, k // 32, 32)
    amax = g.abs().amax(dim=-1)
    inv = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros_like(amax))
    return torch.round(g * inv[..., None]).reshape(m, k), amax / 127


def rounded_reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                      low: torch.Tensor) -> torch.Tensor:
    """(rounded x) @ W.T in float64, except the low term, which the kernel takes from x's own
    group sums: sum_k x[k] * (q scale + low) = scale * d * sum(q_x q) + low * sum(x)."""
    qx, d = round_x(x)
    m, k = x.shape
    xr = (qx.double().view(m, k // 32, 32) * d.double()[..., None]).view(m, k)
    qs = (q.double() * scale.double().repeat_interleave(32, 1))
    lows = (x.double().view(m, k // 32, 32).sum(-1)) @ low.double().t()
    return xr @ qs.t() + lows


def test_round_x_is_q8_0_within_one_step() -> None:
    """Our rounding is llama.cpp's AVX2 one (127 / max |x|, round to nearest): gguf's Q8_0
    (1 / d, round half away, d stored in float16) gives the same codes but where x * 127 / max
    lies within rounding of a half, and the same values within one step d."""
    x = torch.randn(64, 576, generator=torch.Generator().manual_seed(4)) * 3
    x[3, :32] = 0  # an all-zero group: codes 0, d 0
    qx, d = round_x(x)
    assert qx.abs().max() <= 127 and torch.equal(qx[3, :32], torch.zeros(32)) and d[3, 0] == 0
    blocks = quantize(x.numpy(), GGMLQuantizationType.Q8_0)
    theirs = torch.from_numpy(np.asarray(dequantize(blocks, GGMLQuantizationType.Q8_0)))
    ours = (qx.view(64, 18, 32) * d[..., None]).view(64, 576)
    step = d.repeat_interleave(32, 1)
    assert ((ours - theirs).abs() <= step * 1.01).all()
    their_codes = torch.from_numpy(blocks.reshape(64, 18, 34)[..., 2:].view(np.int8).copy())
    assert (their_codes.view(64, 576).float() == qx).float().mean() > 0.99


@needs_avx2
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("half", [True, False])
def test_equals_the_rounded_product_and_is_close_to_the_exact_one(n: int, k: int,
                                                                  half: bool) -> None:
    """At 1, 7, 32 and 300 rows (one register block of 6, partial blocks), with and without the
    residual, scales read as float16 (exact) or float32."""
    q, scale, low = drawn(n, k, half=half)
    codes, scale_low = int4_avx2.pack_codes(q), int4_avx2.pack_scales(scale, low)
    for rows in (1, 7, 32, 300):
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
        want = rounded_reference(x, q, scale, low)
        got = int4_avx2.int4_mm(x, codes, scale_low, round_x=True)
        assert got.dtype == torch.float32 and got.shape == (rows, n)
        assert (got.double() - want).abs().max() <= TOLERANCE * want.abs().max(), rows
        exact = reference(x, q, scale, low)
        assert (got.double() - exact).abs().max() <= ROUNDING_TOLERANCE * exact.abs().max(), rows
        residual = torch.randn(rows, n)
        with_residual = want + residual.double()
        got = int4_avx2.int4_mm(x, codes, scale_low, residual, round_x=True)
        assert (got.double() - with_residual).abs().max() <= TOLERANCE * with_residual.abs().max()


@needs_avx2
def test_w4a8_matrices_take_the_kernel_at_every_row_count_and_no_copy(monkeypatch) -> None:
    """An Int4Linear made for w4a8 multiplies rounded activations through forward and add_to, and
    attach_float32_copies gives it no float32 copy (the kernel beat them at 1..512 rows), while the
    int8 head keeps its copy as under int4."""
    w = torch.randn(48, 64) * 0.05
    m = Int4Linear(w, None, torch.float32, round_x=True)
    head = Int8Linear(torch.randn(40, 64), None, torch.float32)
    assert m.avx2_q8 and m.avx2_scale_low is not None
    monkeypatch.setattr(kernel_choice, "calibrate", lambda modules, rows: 5)
    assert kernel_choice.attach_float32_copies([m, head], deterministic=False) == {"int8": 1}
    assert m.packed is None and m.amx_from == 1 and head.packed is not None
    for rows in (1, 5, 40, 200):
        x, h = torch.randn(rows, 64), torch.randn(rows, 48)
        want = int4_avx2.int4_mm(x, m.qweight, m.avx2_scale_low, round_x=True)
        assert torch.equal(m(x), want), rows
        assert torch.equal(m.add_to(h, x),
                           int4_avx2.int4_mm(x, m.qweight, m.avx2_scale_low, h, round_x=True))
        assert not torch.equal(want, int4_avx2.int4_mm(x, m.qweight, m.avx2_scale_low)), rows
    # the same matrix under int4 keeps float32 activations
    assert not Int4Linear(w, None, torch.float32).avx2_q8


def test_w4a8_is_what_auto_serves_an_int4_file_in_float32_on_avx2(monkeypatch) -> None:
    """--quantization auto under float32: w4a8 where the AVX2 kernel runs, dequantized where it
    does not; w4a8 asked for is refused, with the reason, where the kernel cannot run it."""
    cpu = torch.device("cpu")
    if int4_avx2.usable():
        assert weights._quantization("auto", "int4", torch.float32, cpu) == "w4a8"
        assert weights._quantization("w4a8", "int4", torch.float32, cpu) == "w4a8"
        assert weights._quantization("int4", "int4", torch.float32, cpu) == "int4"
    with pytest.raises(ValueError, match="float32"):
        weights._quantization("w4a8", "int4", torch.bfloat16, cpu)
    monkeypatch.setattr(int4_avx2, "usable", lambda: False)
    assert weights._quantization("auto", "int4", torch.float32, cpu) == "none"
    with pytest.raises(ValueError, match="AVX2"):
        weights._quantization("w4a8", "int4", torch.float32, cpu)
    assert not Int4Linear(torch.randn(16, 32), None, torch.float32, round_x=True).avx2_q8
