"""The decoder layers in one native call (kernels/cpu/decoder_layers.cpp) for float32 models,
against each layer's Python forward, the reference: projections on oneDNN's packed matrices (and
MKL on the plain ones from PLAIN_FROM_ROWS rows, where this CPU kind has it), the float32 native
norms, RoPE, SiLU x up and attention, so the same bits in the residual stream and in every K/V
row written. On a tiny random Llama checkpoint and on SmolLM2-135M's GGUF unquantized (the float32
default on CPUs without native bfloat16)."""
from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from engine import kernel_choice
from engine.load import int4_avx2
from engine.load.prepack import PackedLinear
from engine.load.quant import Int4Linear
from engine.load.weights import load_model
from engine.models.llama import LlamaForCausalLM
from engine.models.native_stack import INT4_AVX2, PACKED
from engine.native_stack_choice import native_stack_of
from kernels import cpu
from kernels.torch_backend import TorchBackend
from shared.model_source import ModelSource, resolve_model
from tests.conftest import causal_lm
from tests.kernels.test_decoder_layers import BLOCK, BLOCKS, forward, layout

pytestmark = pytest.mark.skipif(not cpu.available() or not torch.backends.mkldnn.is_available(),
                                reason="no native kernels or oneDNN here")
# 1, 2, 7, 32 decodes; a prompt chunk beside decodes; one of 150 rows (MKL's plain matrix on CPUs
# with PLAIN_FROM_ROWS, oneDNN's packed one elsewhere)
QUERY_LENS = [[1], [1, 1], [1] * 7, [1] * 32, [1, 1, 37, 1], [150, 1]]
IDS = ["1", "2", "7", "32", "prompt-chunk", "150-row-chunk"]


def float32_model(source: ModelSource) -> LlamaForCausalLM:
    loaded, _ = load_model(source, torch.float32, "cpu", "none")
    lm = causal_lm(loaded)
    assert lm.native_stack is not None, "float32 on packed weights is the native call's case"
    assert set(lm.native_stack.projections[::2]) == {PACKED}, "every projection packed"
    return lm


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir: Path) -> LlamaForCausalLM:
    return float32_model(resolve_model(str(tiny_llama_dir)))


def int4_model(source: ModelSource, quantization: str) -> LlamaForCausalLM:
    """int4 projections on the AVX2 kernel below 8 rows and their float32 copies from 8 (the
    handover a calibration would measure, fixed here so both sides of it run)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(kernel_choice, "calibrate", lambda modules, rows: 8)
        loaded, _ = load_model(source, torch.float32, "cpu", quantization)
    lm = causal_lm(loaded)
    assert lm.native_stack is not None, "int4 on the AVX2 kernel is the native call's case"
    assert INT4_AVX2 in lm.native_stack.projections, "the int4 projections as such"
    return lm


needs_avx2 = pytest.mark.skipif(not int4_avx2.usable(), reason="no AVX2 + FMA + F16C here")


@pytest.fixture(scope="module")
def tiny_int4(tiny_llama_dir: Path) -> LlamaForCausalLM:
    return int4_model(resolve_model(str(tiny_llama_dir)), "int4")


@pytest.fixture(scope="module")
def tiny_w4a8(tiny_llama_dir: Path) -> LlamaForCausalLM:
    lm = int4_model(resolve_model(str(tiny_llama_dir)), "w4a8")
    int4 = [m for m in lm.modules() if isinstance(m, Int4Linear)]
    assert int4 and all(m.avx2_q8 and m.packed is None for m in int4), "x rounded, no copies"
    return lm


@pytest.fixture(scope="module")
def smollm2(smollm2_source: ModelSource) -> LlamaForCausalLM:
    return float32_model(smollm2_source)


def python_and_native(model: LlamaForCausalLM, query_lens: list[int],
                      eps: float | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                         torch.Tensor]:
    """-> (the Python layers' hidden states, the native call's, and the two caches after them),
    from one random cache and random tokens. Contexts up to 300 tokens: a sequence takes one or
    two of the kernel's 256-token tasks. eps: the native call's norms take it instead (a
    mutation)."""
    cfg = model.config
    contexts = [random.Random(i).randrange(0, 300) for i in range(len(query_lens))]
    lay = layout(query_lens, contexts, seed=len(query_lens))
    gen = torch.Generator().manual_seed(0)
    kv = torch.randn(cfg.num_layers, 2, BLOCKS, BLOCK, cfg.num_kv_heads, cfg.head_dim,
                     generator=gen)  # earlier tokens' K/V, as random values
    backend = TorchBackend("cpu", native=True, dtype=torch.float32, native_prompts=True)
    kv_python = kv.clone()
    want = forward(model, backend, lay, kv_python, native=False)
    stack = model.native_stack
    assert stack is not None
    if eps is not None:
        model.native_stack = stack._replace(eps=eps)
    try:
        got = forward(model, backend, lay, kv, native=True)
    finally:
        model.native_stack = stack
    return want, got, kv_python, kv


@pytest.mark.parametrize("query_lens", QUERY_LENS, ids=IDS)
def test_tiny_llama_one_native_call_equals_the_python_layers(tiny: LlamaForCausalLM,
                                                              query_lens: list[int]) -> None:
    """Bit for bit: the hidden states, and the cache (K/V rows written, nothing else touched)."""
    want, got, kv_python, kv = python_and_native(tiny, query_lens)
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert torch.equal(got, want)
    assert torch.equal(kv, kv_python)


@pytest.mark.slow
@pytest.mark.parametrize("query_lens", QUERY_LENS, ids=IDS)
def test_smollm2_one_native_call_equals_the_python_layers(smollm2: LlamaForCausalLM,
                                                           query_lens: list[int]) -> None:
    """The same on the real model, 30 layers of its shapes (576 wide, 9 heads over 3)."""
    want, got, kv_python, kv = python_and_native(smollm2, query_lens)
    assert torch.equal(got, want)
    assert torch.equal(kv, kv_python)


@needs_avx2
@pytest.mark.parametrize("query_lens", QUERY_LENS, ids=IDS)
@pytest.mark.parametrize("model", ["tiny_int4", "tiny_w4a8"])
def test_tiny_llama_int4_one_native_call_equals_the_python_layers(model: str,
                                                                   query_lens: list[int],
                                                                   request: pytest.FixtureRequest
                                                                   ) -> None:
    """The same with the AVX2 kernels' int4 projections: float32 x below the handover (1, 2 and
    7 rows) and the float32 copies from it (MKL's plain matrix at 150 rows on AVX2 CPUs); under
    w4a8 the 8-bit-activation kernel at every row count."""
    want, got, kv_python, kv = python_and_native(request.getfixturevalue(model), query_lens)
    assert torch.equal(got, want)
    assert torch.equal(kv, kv_python)


@pytest.mark.slow
@needs_avx2
@pytest.mark.parametrize("query_lens", [[1], [1] * 32, [150, 1]], ids=["1", "32", "150-row-chunk"])
def test_smollm2_int4_one_native_call_equals_the_python_layers(smollm2_source: ModelSource,
                                                                query_lens: list[int]) -> None:
    """SmolLM2's GGUF as --quantization auto serves it in float32 on AVX2 CPUs (w4a8)."""
    want, got, kv_python, kv = python_and_native(int4_model(smollm2_source, "auto"), query_lens)
    assert torch.equal(got, want)
    assert torch.equal(kv, kv_python)


def test_another_eps_in_the_native_call_fails_the_comparison(tiny: LlamaForCausalLM) -> None:
    """The comparison can fail: the norms' eps perturbed in the native call alone changes the
    hidden states and the K/V rows written."""
    eps = tiny.native_stack.eps if tiny.native_stack is not None else 0.0
    want, got, kv_python, kv = python_and_native(tiny, [1, 1, 37, 1], eps=eps * 1.5 + 1e-4)
    assert not torch.equal(got, want)
    assert not torch.equal(kv, kv_python)


def test_a_packed_projection_with_calls_padded_keeps_every_layer_in_python(
        tiny: LlamaForCausalLM) -> None:
    """--deterministic pads one-row calls to two (PackedLinear.pad_one_row), which the native
    call does not: a model with one such projection has no native stack."""
    down = tiny.model.layers[1].down_proj
    assert isinstance(down, PackedLinear)
    down.pad_one_row = True
    try:
        assert native_stack_of(tiny) is None
    finally:
        down.pad_one_row = False
    assert native_stack_of(tiny) is not None


def test_a_malformed_description_fails_before_the_cache_is_written(tiny: LlamaForCausalLM) -> None:
    """A projection kind the call does not know: an error, and no layer has run."""
    stack = tiny.native_stack
    assert stack is not None
    lay = layout([1], [5], seed=0)
    backend = TorchBackend("cpu", native=True, dtype=torch.float32, native_prompts=True)
    step = backend.native_step(backend.plan(lay))
    assert step is not None
    cfg = tiny.config
    kv = torch.zeros(cfg.num_layers, 2, BLOCKS, BLOCK, cfg.num_kv_heads, cfg.head_dim)
    projections = [*stack.projections[:-2], 7, stack.projections[-1]]
    h = torch.randn(1, cfg.hidden_size)
    with pytest.raises(RuntimeError, match="no projection kind 7"):
        torch.ops.conveyor_cpu.decoder_layers(
            h, stack.weights, projections, kv, tiny.rope, torch.tensor([5]), stack.num_heads,
            stack.num_kv_heads, stack.eps, stack.scale, *step)
    assert not kv.any()
