"""The vectorized layer ops of kernels/cpu/layer_ops.cpp (SiLU x up, RMSNorm, RoPE) against the
PyTorch ops the model runs without them, at 1, 7, 32 and 300 rows and odd widths, and each row's
bits independent of the rows around it (docs/determinism.md)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.models.llama import mlp_act
from engine.models.rope import apply_rope, rotation
from kernels import cpu

native = pytest.mark.skipif(not cpu.available(), reason="the native CPU kernels did not build here")
DTYPES = [torch.float32, torch.bfloat16]
ROWS = [1, 7, 32, 300]
BF16_ULP = 2.0**-7  # bfloat16's relative spacing: one rounding step


def silu_mul_reference(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=1)
    return F.silu(gate).mul_(up)


def strided_rows(rows: int, width: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """[rows, width] whose rows sit 6 elements apart inside a wider buffer, as a slice of a fused
    GEMM's output; values wide enough to reach SiLU's saturated ends."""
    gen = torch.Generator().manual_seed(seed)
    return (4 * torch.randn(rows, width + 6, generator=gen)).to(dtype)[:, 3:width + 3]


def assert_one_rounding_apart(got: torch.Tensor, want: torch.Tensor) -> None:
    """bfloat16: the same bits but for rare last-bit ties (the float32 values before rounding differ
    in their last bits), and never more than one rounding step apart."""
    assert (got != want).float().mean().item() <= 0.01
    torch.testing.assert_close(got.float(), want.float(), rtol=BF16_ULP, atol=1e-30)


def assert_near(got: torch.Tensor, want: torch.Tensor, rtol: float, atol: float) -> None:
    """bfloat16: one rounding apart; float32: within the given tolerance of another summation
    order."""
    if got.dtype == torch.bfloat16:
        assert_one_rounding_apart(got, want)
    else:
        torch.testing.assert_close(got, want, rtol=rtol, atol=atol)


def test_the_portable_mlp_act_is_silu_times_up() -> None:
    """The path every machine runs without the native library (and the reference of the
    tests below)."""
    x = strided_rows(5, 2 * 37, torch.float32, 0)
    gate, up = x[:, :37], x[:, 37:]
    torch.testing.assert_close(mlp_act(x, gelu=False), gate * torch.sigmoid(gate) * up, rtol=1e-6,
                               atol=1e-6)
    assert torch.equal(mlp_act(x, gelu=True, native=True),
                       F.gelu(gate, approximate="tanh") * up), "GeGLU stays on PyTorch ops"


@native
@pytest.mark.parametrize("width", [1536, 1000, 37])
def test_silu_lookup_gives_the_formulas_bits_for_every_bfloat16_gate(width: int) -> None:
    """bfloat16 gates take their SiLU from a 65,536-entry table (AVX-512 CPUs) that the formula
    fills: every bit pattern of the gate (NaNs, infinities, denormals included), three times over
    beside random, zero, infinite and denormal ups, gives the formula's bits, ragged row ends
    included."""
    gen = torch.Generator().manual_seed(width)
    patterns = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    gate = torch.cat([patterns, patterns[torch.randperm(65536, generator=gen)], patterns.flip(0)])
    rows = -(-gate.numel() // width)
    gate = torch.cat([gate, patterns[:rows * width - gate.numel()]]).view(rows, width)
    up = torch.randn(rows, width, generator=gen).to(torch.bfloat16)
    up.view(-1)[::97], up.view(-1)[::89], up.view(-1)[::83] = float("inf"), 0.0, 1e-39
    x = torch.cat([gate, up], 1)
    looked_up = torch.ops.conveyor_cpu.silu_and_mul(x).view(torch.int16)
    assert torch.equal(looked_up, torch.ops.conveyor_cpu.silu_and_mul(x, False).view(torch.int16))


@native
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("width", [1536, 1000, 37, 8])
def test_silu_and_mul_equals_torch(dtype: torch.dtype, rows: int, width: int) -> None:
    """float32: F.silu's vector formula with its exp, so its bits wherever torch's kernel vectorizes
    too (all of a row whose width is a multiple of 32); its scalar tail calls std::exp, within 2 ulp
    of ours.
    bfloat16: a faster exp before the same rounding (assert_one_rounding_apart)."""
    x = strided_rows(rows, 2 * width, dtype, rows * width)
    got, want = torch.ops.conveyor_cpu.silu_and_mul(x), silu_mul_reference(x)
    assert got.dtype == dtype and got.shape == (rows, width) and got.is_contiguous()
    if dtype == torch.bfloat16:
        assert_one_rounding_apart(got, want)
    elif width % 32 == 0:
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, rtol=2.4e-7, atol=1e-30)
    assert torch.equal(mlp_act(x, gelu=False, native=True), got)


@native
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("width", [576, 577, 100, 7])
def test_rms_norm_equals_torch_at_odd_widths(dtype: torch.dtype, rows: int, width: int) -> None:
    """The sum of squares in another order than F.rms_norm's: float32 within its rounding, bfloat16
    one rounding of nearly the same float32 value."""
    x = strided_rows(rows, width, dtype, rows + width)
    w = torch.randn(width, generator=torch.Generator().manual_seed(width)).to(dtype)
    got, want = torch.ops.conveyor_cpu.rms_norm(x, w, 1e-6), F.rms_norm(x, (width,), w, 1e-6)
    assert_near(got, want, rtol=2e-6, atol=1e-6)


@native
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("head_dim", [128, 64, 34, 6])
def test_rope_equals_the_complex_multiply_at_odd_head_dims(dtype: torch.dtype, rows: int,
                                                           head_dim: int) -> None:
    """Head dims that are not a multiple of the vector width rotate their last pairs right too."""
    gen = torch.Generator().manual_seed(rows + head_dim)
    angles = torch.rand(64, head_dim // 2, generator=gen) * 6.3
    table = torch.stack((angles.cos(), angles.sin()), dim=-1)
    pos = torch.randint(0, 64, (rows,), generator=gen)
    qk = torch.randn(rows, 5, head_dim, generator=gen).to(dtype)
    want = apply_rope(qk.clone(), rotation(table, pos, native=False))
    got = apply_rope(qk.clone(), rotation(table, pos, native=True))
    assert_near(got, want, rtol=1e-6, atol=1e-6)


@native
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_rows_bits_do_not_depend_on_the_batch(dtype: torch.dtype) -> None:
    """Row i computed alone, among 32 and among 300 rows (where the ops split rows over threads)
    gives the same bits, at odd widths."""
    ops = torch.ops.conveyor_cpu
    x = strided_rows(300, 2 * 1000, dtype, 7)
    w = torch.randn(577, generator=torch.Generator().manual_seed(3)).to(dtype)
    gen = torch.Generator().manual_seed(5)
    table, pos = torch.randn(80, 17, 2, generator=gen), torch.randint(0, 80, (300,), generator=gen)
    qk = torch.randn(300, 5, 34, generator=gen).to(dtype)

    def all_three(r: slice) -> list[torch.Tensor]:
        turned = qk[r].clone()
        ops.rope_(turned, table, pos[r])
        return [ops.silu_and_mul(x[r]), ops.rms_norm(x[r, :577], w, 1e-5), turned]

    batch, some = all_three(slice(0, 300)), all_three(slice(0, 32))
    for i in (0, 17, 31):
        for alone, among_32, among_300 in zip(all_three(slice(i, i + 1)), some, batch, strict=True):
            assert torch.equal(alone[0], among_32[i]) and torch.equal(alone[0], among_300[i])
    for i in (150, 299):
        for alone, among_300 in zip(all_three(slice(i, i + 1)), batch, strict=True):
            assert torch.equal(alone[0], among_300[i])
