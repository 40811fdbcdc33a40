"""The AMX int4 gate_up GEMM with SiLU x up in its epilogue (kernels/cpu/quant_gemm.cpp
int4_gemm_silu): bit for bit the GEMM's output through silu_and_mul, the two ops it replaces in the
native decoder stack, at every block shape of the tiles and at one and two threads; and the native
stack, which takes it for every call past the rows path, still gives the Python layer's bits
(tests/kernels/test_decoder_layers.py). Skipped where the CPU has no AMX tiles."""
from __future__ import annotations

import pytest
import torch

from engine.load import amx

needs_amx = pytest.mark.skipif(not amx.usable(), reason="this CPU (or OS) does not run AMX tiles")


def gate_up(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random codes of an [n, k] gate_up matrix (gate rows first), in the tiles' layout."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=gen)
    scale = torch.rand(n, k // 32, generator=gen) * 0.02 + 1e-3
    zero = torch.randn(n, k // 32, generator=gen) * 0.02
    return amx.pack_int4(q, scale, zero)


def two_ops(x: torch.Tensor, codes: torch.Tensor, sz: torch.Tensor) -> torch.Tensor:
    return torch.ops.conveyor_cpu.silu_and_mul(amx.int4_mm_tiles(x, codes, sz))


@needs_amx
@pytest.mark.parametrize("n,k", [(3072, 576), (128, 64), (96, 64)])
def test_fused_equals_the_gemm_then_silu_and_mul_bitwise(n: int, k: int) -> None:
    """SmolLM2's gate_up, a small one, and one whose halves do not end on a 32-column panel (96
    columns: the kernel runs the two ops). Calls of 2..2,100 rows cover the tiles' blocks of at
    most 16 rows (four column tiles at once), of 17..32, the kept panels past 32 rows and the panel
    groups where x leaves L2. Rows of tiny values (denormal products), of huge ones (infinities)
    and with a NaN take the rounding's exact path: their bits must match too."""
    codes, sz = gate_up(n, k, n + k)
    gen = torch.Generator().manual_seed(k)
    x = torch.randn(2100, k, generator=gen)
    x[3] *= 3e-20
    x[5] *= 1e36
    x[9, 7] = float("nan")
    x = x.to(torch.bfloat16)
    threads = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            for rows in (2, 7, 16, 17, 32, 33, 100, 300, 2100):
                got = amx.int4_silu_tiles(x[:rows], codes, sz)
                assert got.shape == (rows, n // 2) and got.dtype == torch.bfloat16
                want = two_ops(x[:rows], codes, sz)
                assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (t, rows)
    finally:
        torch.set_num_threads(threads)


@needs_amx
def test_the_cases_that_need_the_exact_rounding_occur() -> None:
    """The rows above do reach the rounding's exact path: a denormal product, a NaN."""
    codes, sz = gate_up(128, 64, 1)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(4, 64, generator=gen)
    x[0] *= 1e-19
    x[1, 0] = float("nan")
    got = amx.int4_silu_tiles(x.to(torch.bfloat16), codes, sz).float()
    tiny = got[0][got[0] != 0].abs()
    assert len(tiny) and bool((tiny < torch.finfo(torch.float32).tiny).all())
    assert bool(got[1].isnan().all())


@needs_amx
def test_refuses_activations_not_in_bfloat16() -> None:
    codes, sz = gate_up(128, 64, 3)
    with pytest.raises(RuntimeError, match="bfloat16"):
        amx.int4_silu_tiles(torch.randn(4, 64), codes, sz)
