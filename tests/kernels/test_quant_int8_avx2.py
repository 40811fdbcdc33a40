"""The int8 GEMM for float32 activations on AVX2 (kernels/cpu/quant_int8_avx2.cpp; the tied LM head
of a float32 quantized model) against a dequantize-then-matmul reference in float64, each row's bits
independent of the rows beside it and of the thread count, and Int8Linear taking it below the rows
from which its packed copy takes over (engine/kernel_choice.py attach_int8_avx2). Skipped where the
CPU has no AVX2 and FMA (the engine makes the codes only there); every machine runs the packing
check."""
from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch import nn

from engine import kernel_choice
from engine.load import int8_avx2
from engine.load.prepack import PackedLinear
from engine.load.quant import NEVER, Int8Linear

needs_avx2 = pytest.mark.skipif(not int8_avx2.usable(),
                                reason="this CPU has no AVX2 and FMA (or no native kernels)")
# a slice of the tied head's 49,152 rows, SmolLM2's down projection, a lone block after full panels
SHAPES = [(4096, 576), (576, 1536), (136, 96), (8, 3)]
# Largest |error| against the float64 product over the largest |output|: measured 0.7-1.1e-6 at
# K = 576 (float32 sums of 576 terms, rounded at each FMA); 1e-5 leaves a margin of ten.
RELATIVE_TO_MAX = 1e-5


def module(n: int, k: int, seed: int = 0) -> Int8Linear:
    m = Int8Linear(torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05, None,
                   torch.float32)
    assert m.make_avx2() == int8_avx2.usable()
    return m


@pytest.fixture
def threads() -> Iterator[None]:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_packing_puts_each_code_where_the_kernel_reads_it() -> None:
    """Block b holds output rows 8b..8b+7: for each k their 8 codes side by side."""
    q = torch.randint(-127, 128, (24, 5), generator=torch.Generator().manual_seed(1),
                      dtype=torch.int8)
    codes = int8_avx2.pack(q)
    assert codes.shape == (3, 5, 8) and codes.dtype == torch.int8 and codes.is_contiguous()
    for b, k, j in [(0, 0, 0), (2, 4, 7), (1, 2, 3), (0, 4, 6)]:
        assert codes[b, k, j] == q[8 * b + j, k]


@needs_avx2
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("rows", [1, 7, 32, 300])
def test_equals_dequantize_then_matmul(n: int, k: int, rows: int) -> None:
    """Through forward, within RELATIVE_TO_MAX of the float64 product of x with the module's codes
    times its scales; add_to adds the residual to that product exactly."""
    m = module(n, k)
    m.amx_from = 1
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    w = m.codes().double() * m.scales.double()[:, None]  # [N, K]
    want = x.double() @ w.t()
    got = m.forward(x)
    assert got.dtype == torch.float32 and got.shape == (rows, n)
    err = (got.double() - want).abs().max().item()
    assert err <= RELATIVE_TO_MAX * want.abs().max().item()
    h = torch.randn(rows, n)
    assert torch.equal(m.add_to(h, x), h + got)


@needs_avx2
@pytest.mark.parametrize("n", [136, 512])
@pytest.mark.parametrize("count", [1, 2])
def test_a_rows_bits_do_not_depend_on_the_calls_rows(n: int, count: int, threads: None) -> None:
    """Each row alone equals that row inside every call of 2..300 rows (register tiles of 1-8
    rows, groups of 6, chunks of 32), at 1 and 2 threads, bit for bit; and the same at either
    thread count."""
    gen = torch.Generator().manual_seed(n)
    q = torch.randint(-127, 128, (n, 96), generator=gen, dtype=torch.int8)
    scale = torch.rand(n, generator=gen) * 0.02 + 1e-3
    codes = int8_avx2.pack(q)
    x = torch.randn(300, 96, generator=gen)
    torch.set_num_threads(1)
    alone = torch.cat([int8_avx2.int8_mm(x[i:i + 1], codes, scale) for i in range(300)])
    torch.set_num_threads(count)
    for rows in range(2, 301):
        assert torch.equal(int8_avx2.int8_mm(x[:rows], codes, scale), alone[:rows]), rows


class TiedHead(nn.Module):
    """The parts of a model kernel_choice reads: a tied head is the embedding (no lm_head)."""

    def __init__(self, head: Int8Linear) -> None:
        super().__init__()
        self.model = nn.Module()
        self.model.embed_tokens = head
        self.lm_head = None


@needs_avx2
def test_int8linear_takes_the_kernel_below_its_handover(monkeypatch) -> None:
    """attach_int8_avx2 with a calibrated handover: calls of fewer rows give the kernel's bits,
    calls from the handover on the packed copy's; without a copy, or deterministic, the kernel at
    every row count and no copy."""
    m = module(136, 96)
    m.packed = copy = PackedLinear(m.dequantized(), None)
    monkeypatch.setattr(kernel_choice, "calibrate", lambda modules, rows: 16)
    assert kernel_choice.attach_int8_avx2(TiedHead(m), torch.float32) == 16
    assert m.amx_from == 1 and m.packed_from == 16
    x = torch.randn(20, 96, generator=torch.Generator().manual_seed(2))
    codes = m.avx2_codes
    assert codes is not None
    for rows in (1, 8, 15):
        assert torch.equal(m.forward(x[:rows]), int8_avx2.int8_mm(x[:rows], codes, m.scales))
    assert torch.equal(m.forward(x[:16]), copy.forward(x[:16]))
    assert torch.equal(m.forward(x), copy.forward(x))
    assert kernel_choice.attach_int8_avx2(TiedHead(m), torch.float32, deterministic=True) == NEVER
    assert m.packed is None and torch.equal(m.forward(x), int8_avx2.int8_mm(x, codes, m.scales))
    assert kernel_choice.attach_int8_avx2(TiedHead(module(136, 96)), torch.float32) == NEVER


@needs_avx2
def test_the_head_keeps_only_the_kernels_layout_of_its_codes() -> None:
    """Once attach_int8_avx2 has put the matrix on the kernel, its [N, K] codes are dropped (the
    tied head's codes took twice their size): embedding lookups, the dequantized matrix (what
    packed copies are made from) and every product are the same as with them."""
    m = module(136, 96)
    ids = torch.tensor([0, 7, 8, 135, 64, 7])
    x = torch.randn(40, 96, generator=torch.Generator().manual_seed(3))
    m.amx_from = 1  # the kernel, as after the attach: its products with the [N, K] codes still held
    q, rows, matrix, before = m.codes().clone(), m.rows(ids), m.dequantized(), m.forward(x)
    assert kernel_choice.attach_int8_avx2(TiedHead(m), torch.float32, deterministic=True) == NEVER
    assert m.qweight is None and m.shape() == (136, 96)
    assert torch.equal(m.codes(), q) and torch.equal(m.rows(ids), rows)
    assert torch.equal(m.dequantized(), matrix) and torch.equal(m.forward(x), before)
    assert m.forward(x[:0]).shape == (0, 136)  # a step with no rows for the head
    assert torch.equal(int8_avx2.unpack(int8_avx2.pack(q)), q)


def test_attach_leaves_other_activations_and_widths_alone() -> None:
    """bfloat16 activations (the AMX or AVX-512 kernels' case) and widths not a multiple of 8 get
    no AVX2 codes."""
    bf16 = Int8Linear(torch.randn(136, 96), None, torch.bfloat16)
    assert not bf16.make_avx2()
    assert kernel_choice.attach_int8_avx2(TiedHead(bf16), torch.bfloat16) is None
    odd = Int8Linear(torch.randn(13, 96), None, torch.float32)
    assert not odd.make_avx2()
    assert kernel_choice.attach_int8_avx2(TiedHead(odd), torch.float32) is None
    assert odd.amx_from == NEVER
