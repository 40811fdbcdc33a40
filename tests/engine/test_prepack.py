"""Prepacked projections (engine/load/prepack.py): oneDNN's packed kernel for few rows, MKL on the
kept plain matrix from plain_from rows on. Both sides of the threshold must give F.linear's numbers,
with and without a bias, alone and with the residual added inside the GEMM."""
from __future__ import annotations

from typing import cast

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from engine.load import prepack
from engine.load.prepack import PackedLinear

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(),
                                reason="oneDNN absent from this torch")


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("rows", [1, 7, 8, 33])
def test_packed_linear_equals_f_linear_on_either_side_of_the_threshold(rows: int,
                                                                       with_bias: bool) -> None:
    torch.manual_seed(rows)
    w, b = torch.randn(48, 32), torch.randn(48) if with_bias else None
    x, h = torch.randn(rows, 32), torch.randn(rows, 48)
    # rows 1 and 7 on the packed kernel, 8 and 33 on the plain matrix
    packed = PackedLinear(w, b, plain_from=8)
    torch.testing.assert_close(packed(x), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(packed.add_to(h.clone(), x), h + F.linear(x, w, b), rtol=1e-5,
                               atol=1e-5)


class _Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv_proj = nn.Linear(32, 48, bias=False)


class _Model(nn.Module):
    """The attributes prepack_model reads: model.layers, model.embed_tokens, lm_head."""

    def __init__(self) -> None:
        super().__init__()
        self.model = _Inner()
        self.lm_head = None


class _Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_Layer(), _Layer()])
        self.embed_tokens = nn.Embedding(64, 32)

    def projections(self) -> list[nn.Module]:
        return [cast(_Layer, layer).qkv_proj for layer in self.layers]


def test_plain_copies_are_kept_only_while_the_projections_are_small(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(prepack, "PLAIN_FROM_ROWS", {torch.backends.cpu.get_cpu_capability(): 16})
    model = _Model()
    prepack.prepack_model(model, ("qkv_proj",))  # type: ignore[arg-type]
    layer = model.model.projections()[0]
    assert isinstance(layer, PackedLinear) and layer.plain is not None and layer.plain_from == 16
    # one byte short of both matrices
    monkeypatch.setattr(prepack, "PLAIN_MAX_BYTES", 2 * 48 * 32 * 4 - 1)
    model = _Model()
    prepack.prepack_model(model, ("qkv_proj",))  # type: ignore[arg-type]
    assert all(cast(PackedLinear, proj).plain is None for proj in model.model.projections())
    assert model.lm_head.plain is None  # type: ignore[attr-defined]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_padded_one_row_call_equals_that_row_of_any_larger_call(dtype: torch.dtype) -> None:
    """--deterministic: oneDNN computes one row of some shapes (K = 1536: SmolLM2's down
    projection) with another kernel than larger calls, so a decode step alone would round
    differently from the same row in a batch or a prompt; padded to two rows, a row's bits do not
    depend on the row count."""
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("oneDNN packs bfloat16 only on CPUs with bfloat16 instructions")
    torch.manual_seed(0)
    w, x = torch.randn(96, 1536).to(dtype), torch.randn(40, 1536).to(dtype)
    h = torch.randn(40, 96).to(dtype)
    packed = PackedLinear(w, None, pad_one_row=True)
    with torch.inference_mode():
        full, full_add = packed(x), packed.add_to(h, x)
        for rows in (1, 2, 3, 17, 40):
            assert torch.equal(packed(x[:rows]), full[:rows]), rows
            assert torch.equal(packed.add_to(h[:rows], x[:rows]), full_add[:rows]), rows


def test_deterministic_prepack_cuts_large_calls_where_onednn_needs_it() -> None:
    """--deterministic on a plain model: every packed matrix is padded at one row and, on AMX CPUs
    (where oneDNN rounds a few rows of a call over 32 rows otherwise), cut into calls of 32 rows; a
    row's bits then hold in calls of any size (tests/kernels/test_quant_gemm.py checks the cut's
    bits on AMX)."""
    from engine.load.dtype import cpu_kind

    model = _Model()
    prepack.prepack_model(model, ("qkv_proj",), deterministic=True)  # type: ignore[arg-type]
    packed = [cast(PackedLinear, proj) for proj in model.model.projections()]
    packed.append(cast(PackedLinear, model.lm_head))
    want = prepack.ONEDNN_SAME_BITS_ROWS if cpu_kind() == "AMX" else None
    assert all(m.pad_one_row and m.plain is None and m.max_rows == want for m in packed)
    x = torch.randn(70, 32)
    with torch.inference_mode():
        alone = torch.cat([packed[0](x[i:i + 1]) for i in range(70)])
        assert torch.equal(packed[0](x), alone)
