"""The native RMSNorm and RoPE (kernels/cpu/layer_ops.cpp) against PyTorch's F.rms_norm and the
complex-multiply RoPE the model uses without them, and each row's result independent of the
others."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.models.rope import apply_rope, rotation
from kernels import cpu

pytestmark = pytest.mark.skipif(not cpu.available(),
                                reason="the native CPU kernels did not build here")
DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_rms_norm_equals_torch(dtype: torch.dtype, rows: int) -> None:
    """Within float32 rounding of F.rms_norm (the sum of squares in another order); rows that are
    strided views (a slice of a wider buffer) read right."""
    gen = torch.Generator().manual_seed(rows)
    wide = (3 * torch.randn(rows, 700, generator=gen)).to(dtype)
    w = torch.randn(576, generator=gen).to(dtype)
    for x in (wide[:, :576].contiguous(), wide[:, 100:676]):
        got = torch.ops.conveyor_cpu.rms_norm(x, w, 1e-6)
        want = F.rms_norm(x, (576,), w, 1e-6)
        assert got.dtype == dtype and got.shape == want.shape and got.is_contiguous()
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        else:  # one rounding of the same float32 value: equal but where the sum's last bit tips it
            assert (got == want).float().mean() > 0.999
            torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rope_equals_complex_multiply(dtype: torch.dtype) -> None:
    """In place on a strided q/k view of a fused QKV buffer, as the model calls it; the same values
    as the PyTorch path within float32 rounding (bfloat16: the same bits but for rare last-bit
    ties)."""
    gen = torch.Generator().manual_seed(0)
    t, h, hkv, d = 9, 6, 2, 64
    table = torch.randn(50, d // 2, 2, generator=gen)
    pos = torch.randint(0, 50, (t,), generator=gen)
    qkv = torch.randn(t, (h + 2 * hkv) * d, generator=gen).to(dtype)
    qk = qkv[:, : (h + hkv) * d].view(t, h + hkv, d)
    want = apply_rope(qk.clone(), rotation(table, pos, native=False))
    v_before = qkv[:, (h + hkv) * d:].clone()
    got = apply_rope(qk, rotation(table, pos, native=True))
    assert got.data_ptr() == qkv.data_ptr(), "not in place"
    assert torch.equal(qkv[:, (h + hkv) * d:], v_before), "wrote past q and k"
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    else:
        assert (got == want).float().mean() > 0.999
        torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2)


def test_rope_refuses_a_position_outside_the_table() -> None:
    x = torch.zeros(2, 1, 8)
    with pytest.raises(RuntimeError, match="outside the table"):
        torch.ops.conveyor_cpu.rope_(x, torch.zeros(4, 4, 2), torch.tensor([1, 4]))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_rows_result_does_not_depend_on_the_other_rows(dtype: torch.dtype) -> None:
    """Batch invariance (docs/determinism.md): row i alone and inside 64 rows gives the same
    bits."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(64, 576, generator=gen).to(dtype)
    w = torch.randn(576, generator=gen).to(dtype)
    batch = torch.ops.conveyor_cpu.rms_norm(x, w, 1e-5)
    table, pos = torch.randn(80, 32, 2, generator=gen), torch.randint(0, 80, (64,), generator=gen)
    qk = torch.randn(64, 4, 64, generator=gen).to(dtype)
    turned = qk.clone()
    torch.ops.conveyor_cpu.rope_(turned, table, pos)
    for i in (0, 17, 63):
        assert torch.equal(torch.ops.conveyor_cpu.rms_norm(x[i:i + 1], w, 1e-5), batch[i:i + 1])
        one = qk[i:i + 1].clone()
        torch.ops.conveyor_cpu.rope_(one, table, pos[i:i + 1])
        assert torch.equal(one, turned[i:i + 1])
